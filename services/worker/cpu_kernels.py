"""The compiled CPU kernels (csrc/*.c: paged decode and prefill attention, fused norm and
activation, the grammar bitmask, the decode GEMVs on bfloat16 and int8 weights): build
and load one shared library.

Built with the system C compiler (`-O3 -march=<SPINDLE_CPU_KERNEL_MARCH, default native>
-fopenmp`) into the Spindle cache folder, keyed by the sources, the flags and (for `native`) this
CPU's feature flags, under a file lock so workers starting together build it once. An image can
ship a library built for a portable target (x86-64-v3) and no compiler: it is loaded when this CPU
has that target's features. No library and no compiler, or a failed build, leaves the PyTorch
paths in use (`load_cpu_kernels` returns None and says why in the log).
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

from services.common.model_files import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode.c", "paged_prefill.c", "fused_ops.c", "token_bitmask.c", "gemv.c", "gemv_int8.c",
           "kv_int8.c", "paged_decode_int8.c", "w8a8.c", "decode_layers.c", "gemm_tiles.c", "gemm_int8_tiles.c",
           "gemm_amx_bf16.c", "paged_decode_amx.c", "argmax.c", "greedy_screen.c", "head_int8_amx.c")
HEADERS = ("vec.h", "decode_common.h", "decode_items.h", "decode_int8_keys.h", "decode_int8_values.h",
           "paged_decode_int8_amx.h", "int8_bf16.h", "int8_quant.h", "int8_groups.h", "paged_decode_bf16.h", "paged_prefill_amx.h",
           "amx_tiles.h")
BASE_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# CPU flags (as /proc/cpuinfo names them) a portable target needs; `native` is built on this CPU.
MARCH_FEATURES = {"x86-64-v3": {"avx", "avx2", "fma", "bmi2", "f16c", "movbe"}, "x86-64-v2": {"sse4_2", "popcnt"}}


def load_cpu_kernels(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    march = os.environ.get("SPINDLE_CPU_KERNEL_MARCH", "native")
    cpu_flags = _cpu_flags()
    missing = MARCH_FEATURES.get(march, set()) - cpu_flags
    if missing:
        logger.warning("CPU lacks %s for the %s CPU kernels: using the PyTorch paths", sorted(missing), march)
        return None
    cflags = (*BASE_CFLAGS, f"-march={march}")
    identity = b"".join((SOURCE_DIR / name).read_bytes() for name in SOURCES + HEADERS) + " ".join(cflags).encode()
    if march == "native":  # a shared cache folder must not hand this build to another CPU
        identity += " ".join(sorted(cpu_flags)).encode()
    key = hashlib.sha256(identity).hexdigest()[:16]
    folder = (cache_dir or default_cache_dir()) / "kernels"
    library_path = folder / f"cpu_kernels-{key}.so"
    try:
        if not library_path.exists():
            compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
            if compiler is None:
                logger.warning("no C compiler and no prebuilt CPU kernels: the CPU stays on the PyTorch paths")
                return None
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f".cpu_kernels-{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not library_path.exists():
                    _build(compiler, cflags, library_path)
        return ctypes.CDLL(str(library_path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU kernels unavailable (%s): using the PyTorch paths", str(detail).strip()[:500])
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
        sources = [str(SOURCE_DIR / name) for name in SOURCES]
        subprocess.run([compiler, *cflags, "-o", str(tmp_path), *sources, "-lm"],
                       check=True, capture_output=True, text=True, timeout=180)
        os.replace(tmp_path, library_path)
    logger.info("built CPU kernels %s", library_path)
