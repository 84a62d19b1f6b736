"""The compiled CPU prefill-attention kernel (csrc/paged_prefill.c): a step's prefill and chunk
slices attended in one call over the paged bfloat16 cache, on CPUs with AVX512_BF16.

`PrefillSlices` holds the step's per-slice arrays (built once per step by `build_prefill_slices`);
`PagedPrefillKernel` checks the tensors and calls the kernel, which writes each slice's rows of the
output in place. A library built without AVX512_BF16 (an AVX2-only target) has the entry point but
no kernel behind it: `supports` is then False for everything and PyTorch's SDPA stays in use.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from services.worker.attention.backend import CommonAttentionMetadata

MAX_HEAD_DIM = 256  # and a multiple of 32 (csrc/paged_prefill.c)
MAX_GROUP = 16  # query heads per KV head
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _P, _P, _I64, _I32, _P, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I32, _I32, _I32, _F32, _I32]
# The kernel's status codes (PREFILL_* in csrc/paged_prefill.c) other than 0.
_ERRORS = {
    1: "this library was built without AVX512_BF16",
    2: "the query heads cannot share the KV heads evenly",
    3: f"head_dim must be a multiple of 32 up to {MAX_HEAD_DIM}",
    4: f"at most {MAX_GROUP} query heads per KV head",
    5: "a slice's rows, lengths or block ids are out of range",
}


@dataclass(frozen=True)
class PrefillSlices:
    """A step's requests with more than one query token, in batch order, as the kernel reads them."""

    query_starts: torch.Tensor  # [S] int64: first row in the flat batch
    query_lens: torch.Tensor  # [S] int64
    seq_lens: torch.Tensor  # [S] int64: context + this step's tokens
    block_table: torch.Tensor  # [S, num_blocks] int64, contiguous

    def __post_init__(self):
        table = self.block_table
        if table.dtype != torch.int64 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError("the slices' block table must be a contiguous [S, num_blocks] int64 tensor")
        arrays = (self.query_starts, self.query_lens, self.seq_lens)
        if any(a.dtype != torch.int64 or a.shape != (table.shape[0],) or not a.is_contiguous() for a in arrays):
            raise ValueError(f"the slices' starts and lengths must be contiguous int64 [{table.shape[0]}] tensors")

    @property
    def num_slices(self) -> int:
        return int(self.query_lens.shape[0])


def build_prefill_slices(common: CommonAttentionMetadata) -> PrefillSlices | None:
    """The prefill slices of a step (None when it has none), as TorchAttentionBackend counts them:
    requests with more than one query token."""
    rows = [i for i, n in enumerate(common.query_lens_cpu) if n > 1]
    if not rows:
        return None
    starts = common.query_start_loc.tolist()
    seq_lens = [common.seq_lens_cpu[i] for i in rows]
    num_blocks = -(-max(seq_lens) // common.block_size)
    index = torch.tensor(rows, dtype=torch.int64)
    return PrefillSlices(
        query_starts=torch.tensor([starts[i] for i in rows], dtype=torch.int64),
        query_lens=torch.tensor([common.query_lens_cpu[i] for i in rows], dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_table=common.block_table[index, :num_blocks].to(torch.int64).contiguous(),
    )


class PagedPrefillKernel:
    def __init__(self, library: ctypes.CDLL):
        self._function = library.paged_prefill_bf16
        self._function.argtypes, self._function.restype = _ARGTYPES, ctypes.c_int
        available = library.paged_prefill_available
        available.argtypes, available.restype = [], ctypes.c_int
        self.is_available = bool(available())  # False for a build without AVX512_BF16

    def supports(self, cache_dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
        return (self.is_available and cache_dtype == torch.bfloat16 and 0 < head_dim <= MAX_HEAD_DIM
                and head_dim % 32 == 0 and num_kv_heads > 0 and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= MAX_GROUP)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slices: PrefillSlices, out: torch.Tensor, scale: float) -> None:
        """query [T, H, D] bfloat16 (any row stride, heads contiguous), caches [num_blocks, bs, H_kv, D]
        bfloat16 holding this step's K/V, out [T, H * D] bfloat16 (any row stride): writes the
        slices' rows of `out` and leaves the others alone."""
        if query.dim() != 3 or key_cache.dim() != 4:
            raise ValueError(f"query must be [T, H, D] and the caches [num_blocks, bs, H_kv, D], not "
                             f"{tuple(query.shape)} and {tuple(key_cache.shape)}")
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, cache_dim = key_cache.shape
        if not (query.dtype == key_cache.dtype == value_cache.dtype == out.dtype == torch.bfloat16):
            raise ValueError("paged prefill kernel needs bfloat16 query, caches and output, not "
                             f"{query.dtype}, {key_cache.dtype}, {value_cache.dtype}, {out.dtype}")
        if cache_dim != head_dim or value_cache.shape != key_cache.shape:
            raise ValueError(f"caches {tuple(key_cache.shape)} and {tuple(value_cache.shape)} do not fit "
                             f"query heads of {head_dim}")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("paged prefill kernel needs contiguous caches")
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            raise ValueError(f"query heads must be contiguous rows of {head_dim}, strides are {query.stride()}")
        if out.dim() != 2 or out.shape != (num_tokens, num_heads * head_dim) or out.stride(1) != 1:
            raise ValueError(f"out must be [{num_tokens}, {num_heads * head_dim}] with contiguous rows, "
                             f"not {tuple(out.shape)} with strides {out.stride()}")
        table = slices.block_table  # PrefillSlices checked its own arrays when it was built
        status = self._function(
            query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), num_blocks, block_size,
            slices.query_starts.data_ptr(), slices.query_lens.data_ptr(), slices.seq_lens.data_ptr(),
            table.data_ptr(), table.stride(0), slices.num_slices, out.data_ptr(), out.stride(0), num_tokens,
            num_heads, num_kv_heads, head_dim, scale, torch.get_num_threads(),
        )
        if status == 6:
            raise MemoryError("paged prefill kernel: out of memory for its scratch")
        if status:
            raise ValueError(f"paged prefill kernel ({num_heads} heads, {num_kv_heads} KV heads, head_dim "
                             f"{head_dim}): {_ERRORS.get(status, f'status {status}')}")
