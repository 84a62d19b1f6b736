"""The int8 KV cache (`--kv-cache-dtype int8`): its layout, the compiled writer and dequantizer, and
their PyTorch references (the quantizer, the dequantization of blocks for prefill attention).

One int8 tensor per layer, [2, num_blocks, block_bytes] (0 keys, 1 values). Each (token, KV head)
row is quantized on its own, so an outlier in one head or token costs precision nowhere else, and
about its own midpoint: x = mid + q * scale, q in [-127, 127], scale = (max - min) / 254. A
symmetric rule (scale = max|x| / 127) spends half its levels on values a one-sided row never
takes; on 32 chat prompts with float32 weights the centered rule kept greedy output identical to
float32's for 45.5 tokens of 64 on average against 34.6 (docs/benchmarks.md, "The int8 KV cache
about each row's midpoint"). A value block holds its tokens' rows, int8 [block_size,
num_kv_heads, head_dim]; a key block holds them per KV head with each row's dimensions in fours and
the block's tokens side by side per four, int8 [num_kv_heads, head_dim / 4, block_size, 4], so the
decode kernel's key pass sums 16 tokens' dot products in 16 lanes (csrc/decode_int8_keys.h). Both
end with their scales, float32 [num_kv_heads, block_size], then their midpoints, float32
[num_kv_heads, block_size]. Block 0, the null block, is zeros with scale 0 and midpoint 0.
"""
from __future__ import annotations

import ctypes

import torch

META_BYTES = 8  # a float32 scale and a float32 midpoint per (token, KV head)
MAX_HEAD_DIM = 256  # csrc/kv_int8.c
KEY_GROUP = 4  # a key row's dimensions lie in fours, the block's tokens side by side per four
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_WRITE_ARGTYPES = [_P, _I64, _P, _I64, _P, _I64, _I32, _I32, _I32, _I64, _I64, _P, _P]
_DEQUANTIZE_ARGTYPES = [_P, _I64, _P, _I64, _I32, _I32, _I32, _I32, _P]


def int8_row_bytes(head_dim: int) -> int:
    """Bytes one (token, KV head) row takes: its int8 values, its scale and its midpoint."""
    return head_dim + META_BYTES


def int8_block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return block_size * num_kv_heads * int8_row_bytes(head_dim)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D] in [-127, 127], float32 scales [...]), as csrc/kv_int8.c
    computes them: in float32, q = round_half_even(x * (127 / amax)), scale = amax / 127."""
    x = torch.nan_to_num(x.float(), nan=0.0)
    amax = x.abs().amax(dim=-1)
    # A tensor divided, not `127.0 / amax`: PyTorch computes a scalar over a tensor as a reciprocal
    # times the scalar, rounded twice, which moves values near .5 to the other integer.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(x * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D] in [-127, 127], float32 scales [...], float32 midpoints [...]),
    as csrc/kv_int8.c computes them (int8_quant.h's centered rule): in float32, after nan_to_num,
    half = max * 0.5 - min * 0.5, mid = min + half, q = round_half_even((x - mid) * (127 / half)),
    scale = half / 127; x = mid + q * scale."""
    x = torch.nan_to_num(x.float(), nan=0.0)
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    half = hi * 0.5 - lo * 0.5
    mid = lo + half
    # A tensor divided, not `127.0 / half`: as in quantize_int8_rows.
    inv = torch.where(half > 0, torch.full_like(half, 127.0) / torch.where(half > 0, half, 1.0), 0.0)
    q = torch.round((x - mid[..., None]) * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, half / 127.0, mid


def split_int8_cache(cache: torch.Tensor, half: int, block_size: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One half of a layer's cache (`half` 0 keys, 1 values), [num_blocks, block_bytes] int8, as
    views: data [num_blocks, block_size, H_kv, D / 4, 4] int8 (a row's dimensions in fours: the
    key layout is not a strided [..., D] view), scales and midpoints [num_blocks, block_size, H_kv]
    float32."""
    num_blocks, block_bytes = cache.shape
    data_bytes = block_size * num_kv_heads * head_dim
    meta_bytes = block_size * num_kv_heads * 4
    if block_bytes != int8_block_bytes(block_size, num_kv_heads, head_dim) or head_dim % KEY_GROUP:
        raise ValueError(f"an int8 cache block of {block_bytes} bytes does not hold {block_size} tokens of "
                         f"{num_kv_heads} KV heads of {head_dim}")
    data = cache[:, :data_bytes]
    if half == 0:
        data = data.view(num_blocks, num_kv_heads, head_dim // KEY_GROUP, block_size, KEY_GROUP).permute(0, 3, 1, 2, 4)
    else:
        data = data.view(num_blocks, block_size, num_kv_heads, head_dim // KEY_GROUP, KEY_GROUP)

    def meta(start: int) -> torch.Tensor:
        return (cache[:, start:start + meta_bytes].view(torch.float32).view(num_blocks, num_kv_heads, block_size)
                .transpose(1, 2))

    return data, meta(data_bytes), meta(data_bytes + meta_bytes)


def dequantize_blocks(cache: torch.Tensor, half: int, block_ids: torch.Tensor, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `block_ids` of one half of a layer's cache as [len(block_ids), block_size, H_kv, D] in
    `dtype`, contiguous: a dense cache the prefill kernels read through remapped block tables. The
    reference of Int8KVDequantizer, which serves."""
    data, scales, mids = split_int8_cache(cache.index_select(0, block_ids), half, block_size, num_kv_heads, head_dim)
    return (data.to(torch.float32).flatten(-2) * scales[..., None] + mids[..., None]).to(dtype).contiguous()


def _bind_per_dtype(library: ctypes.CDLL, prefix: str, argtypes: list) -> dict:
    """The library's `<prefix>_f32` and `<prefix>_bf16`, typed, by the torch dtype they serve."""
    functions = {}
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        function = getattr(library, f"{prefix}_{suffix}")
        function.argtypes, function.restype = argtypes, ctypes.c_int
        functions[dtype] = function
    return functions


class Int8KVWriter:
    """The compiled writer (csrc/kv_int8.c) of a step's keys and values into the int8 cache."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = _bind_per_dtype(library, "write_kv_int8", _WRITE_ARGTYPES)

    def __call__(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 block_size: int) -> None:
        """key, value [T, H_kv, D] (float32 or bfloat16, heads contiguous, any token stride) into
        `kv_cache` [2, num_blocks, block_bytes] at `slot_mapping` [T] int64 (-1 skips a token)."""
        num_tokens, num_kv_heads, head_dim = key.shape
        if key.dtype not in self._functions or value.dtype != key.dtype or value.shape != key.shape:
            raise ValueError(f"int8 KV writer takes float32 or bfloat16 key and value of one shape, not "
                             f"{key.dtype} {tuple(key.shape)} and {value.dtype} {tuple(value.shape)}")
        if not 0 < head_dim <= MAX_HEAD_DIM or head_dim % KEY_GROUP:
            raise ValueError(f"int8 KV cache: head_dim {head_dim} is not a multiple of {KEY_GROUP} "
                             f"up to {MAX_HEAD_DIM}")
        for name, x in (("key", key), ("value", value)):
            if x.stride(2) != 1 or x.stride(1) != head_dim:
                raise ValueError(f"{name} heads must be contiguous rows of {head_dim}, strides are {x.stride()}")
        if (kv_cache.dtype != torch.int8 or kv_cache.dim() != 3 or not kv_cache.is_contiguous()
                or kv_cache.shape[2] != int8_block_bytes(block_size, num_kv_heads, head_dim)):
            raise ValueError(f"not an int8 cache of {block_size}-token blocks for {num_kv_heads} KV heads of "
                             f"{head_dim}: {kv_cache.dtype} {tuple(kv_cache.shape)}")
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,) or not slot_mapping.is_contiguous():
            raise ValueError(f"slot mapping must be a contiguous int64 [{num_tokens}] tensor")
        block_bytes = kv_cache.shape[2]
        value_cache_ptr = kv_cache.data_ptr() + kv_cache.stride(0)  # kv_cache[1]: int8, one byte an element
        status = self._functions[key.dtype](
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slot_mapping.data_ptr(), num_tokens,
            num_kv_heads, head_dim, block_size, block_bytes, kv_cache.shape[1], kv_cache.data_ptr(), value_cache_ptr)
        if status:  # 1 (head_dim) is checked above
            raise ValueError(f"int8 KV writer: a slot is past the cache's {kv_cache.shape[1] * block_size} slots")


class Int8KVDequantizer:
    """The compiled dequantizer (csrc/kv_int8.c) of cache blocks for prefill attention: one pass,
    where `dequantize_blocks` takes five; the same values bit for bit."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = _bind_per_dtype(library, "dequantize_kv_int8", _DEQUANTIZE_ARGTYPES)

    def __call__(self, cache: torch.Tensor, half: int, block_ids: torch.Tensor, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """As `dequantize_blocks`: one half of a layer's cache, [num_blocks, block_bytes] int8,
        blocks `block_ids` (int64, each in the cache) -> [len(block_ids), block_size, H_kv, D]."""
        if dtype not in self._functions:
            raise ValueError(f"int8 KV dequantizer gives float32 or bfloat16, not {dtype}")
        if (cache.dtype != torch.int8 or cache.dim() != 2 or not cache.is_contiguous() or head_dim % KEY_GROUP
                or cache.shape[1] != int8_block_bytes(block_size, num_kv_heads, head_dim) or half not in (0, 1)):
            raise ValueError(f"not a contiguous int8 cache half of {block_size}-token blocks for {num_kv_heads} KV "
                             f"heads of {head_dim}: {cache.dtype} {tuple(cache.shape)}")
        block_ids = block_ids.to(torch.int64).contiguous()
        if block_ids.numel() and not 0 <= int(block_ids.min()) <= int(block_ids.max()) < cache.shape[0]:
            raise ValueError(f"block ids must lie in the cache's {cache.shape[0]} blocks")
        out = torch.empty(block_ids.numel(), block_size, num_kv_heads, head_dim, dtype=dtype)
        status = self._functions[dtype](cache.data_ptr(), cache.shape[1], block_ids.data_ptr(), block_ids.numel(),
                                        half, block_size, num_kv_heads, head_dim, out.data_ptr())
        if status:  # head_dim is checked above
            raise RuntimeError(f"dequantize_kv_int8 returned status {status}")
        return out
