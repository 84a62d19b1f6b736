"""The compiled CPU decode-attention kernel (csrc/paged_decode.c): build, load, call.

Built with the system C compiler (`-O3 -march=<SPINDLE_CPU_KERNEL_MARCH, default native>
-fopenmp`) into the Spindle cache folder, keyed by the source, the flags and (for `native`) this
CPU's feature flags, under a file lock so workers starting together build it once. An image can
ship a library built for a portable target (x86-64-v3) and no compiler: it is loaded when this CPU
has that target's features. No library and no compiler, or a failed build, leaves the PyTorch path
in use (`load_paged_decode` returns None and says why in the log).
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from services.common.model_files import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
BASE_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# CPU flags (as /proc/cpuinfo names them) a portable target needs; `native` is built on this CPU.
MARCH_FEATURES = {"x86-64-v3": {"avx", "avx2", "fma", "bmi2", "f16c", "movbe"}, "x86-64-v2": {"sse4_2", "popcnt"}}
_SUPPORTED = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _P, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32, _F32, _I64, _P, _I32]


class PagedDecodeKernel:
    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, name in _SUPPORTED.items():
            function = getattr(library, name)
            function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
            self._functions[dtype] = function

    def supports(self, cache_dtype: torch.dtype) -> bool:
        return cache_dtype in self._functions

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
        """query [B, H, D] (any float dtype), caches [num_blocks, bs, H_kv, D], block_table [B, n]
        and seq_lens [B] int64 -> attention output [B, H, D] float32."""
        num_reqs, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("paged decode kernel needs contiguous caches")
        query = query.float().contiguous()
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = torch.empty_like(query)
        num_threads = torch.get_num_threads()
        scratch = torch.empty(num_threads * num_heads * max(max_seq_len, 1), dtype=torch.float32)
        status = self._functions[key_cache.dtype](
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
            block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads, num_kv_heads,
            head_dim, block_size, scale, max_seq_len, scratch.data_ptr(), num_threads,
        )
        if status:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        return out


def load_paged_decode(cache_dir: Path | None = None) -> PagedDecodeKernel | None:
    march = os.environ.get("SPINDLE_CPU_KERNEL_MARCH", "native")
    cpu_flags = _cpu_flags()
    missing = MARCH_FEATURES.get(march, set()) - cpu_flags
    if missing:
        logger.warning("CPU lacks %s for the %s decode kernel: using the PyTorch path", sorted(missing), march)
        return None
    cflags = (*BASE_CFLAGS, f"-march={march}")
    identity = SOURCE.read_bytes() + " ".join(cflags).encode()
    if march == "native":  # a shared cache folder must not hand this build to another CPU
        identity += " ".join(sorted(cpu_flags)).encode()
    key = hashlib.sha256(identity).hexdigest()[:16]
    folder = (cache_dir or default_cache_dir()) / "kernels"
    library_path = folder / f"paged_decode-{key}.so"
    try:
        if not library_path.exists():
            compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
            if compiler is None:
                logger.warning("no C compiler and no prebuilt decode kernel: CPU decode stays on the PyTorch path")
                return None
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f".paged_decode-{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not library_path.exists():
                    _build(compiler, cflags, library_path)
        return PagedDecodeKernel(ctypes.CDLL(str(library_path)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU decode kernel unavailable (%s): using the PyTorch path", str(detail).strip()[:500])
        return None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(compiler: str, cflags: tuple[str, ...], library_path: Path) -> None:
    # Build beside the target and rename, so a reader never sees half a library.
    with tempfile.TemporaryDirectory(dir=library_path.parent) as tmp:
        tmp_path = Path(tmp) / library_path.name
        subprocess.run([compiler, *cflags, "-o", str(tmp_path), str(SOURCE), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp_path, library_path)
    logger.info("built CPU decode kernel %s", library_path)
