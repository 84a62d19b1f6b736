"""Linear layers whose weights load from one or several checkpoint tensors.

`MergedLinear` stacks several checkpoint projections (q/k/v, gate/up) along the output dimension
so one matmul replaces several; `load_shard` copies one of them into its slice at load time.

On a CPU, float32 weights are repacked once after loading into oneDNN's blocked layout
(`prepack_cpu_weights`): BLAS otherwise re-packs every weight on every call, which at decode batch
sizes costs as much as the multiply (measured: 30 layers' matmuls at 64 rows 259 -> 184 ms, at
2048 rows 4.6 -> 3.5 s, the 113 MB LM head at one row 22 -> 12 ms). On a CPU with native bfloat16
arithmetic (AVX512_BF16 or AMX), bfloat16 weights are prepacked the same way and multiplied
natively at every batch size: about 400 GFLOP/s against float32's 210 at 64 rows on a 2-core
AVX512_BF16 machine, and the LM head at one row 3.3 -> 1.6 ms.

`linear` is the matmul every layer calls. On a CPU without native bfloat16 arithmetic (AVX2),
a bfloat16 matmul of more than a couple of rows is emulated and several times slower than
float32, while reading bfloat16 weights halves the memory traffic that bounds a small decode
batch. So 16-bit weights multiply natively only for one or two rows. Larger batches use a
float32 oneDNN copy of the weight when the worker keeps one (`add_float32_copies`, three times
the weight memory; a batch-32 decode step 378 -> 221 ms), else widen the weight to float32 a
chunk of rows at a time (the chunk stays in cache for its matmul). Either way the float32 result
is rounded back, which is how a native bfloat16 GEMM accumulates anyway.

Up to `MAX_GEMV_ROWS` rows, bfloat16 weights multiply on the compiled GEMV where the platform
hands one over (`gemv`, gemv.py): those matmuls only stream the weight, and the GEMV reads it at
close to the memory bandwidth where oneDNN does not. It needs the plain weight, which `prepack`
then keeps. Where the kernels have AVX512_BF16 the weight is held in column tiles instead
(`gemv_tiles`), which take every bfloat16 matmul of up to `MAX_TILE_ROWS` rows; oneDNN's packed
weight serves longer ones (prefill).

With `--quantization int8` the platform swaps each weight for an `Int8Weight` (int8_linear.py)
instead of packing it (`use_int8`), and `forward` multiplies on that.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from services.worker.layers.amx_gemm import AmxGemm, AmxWeight
    from services.worker.layers.gemv import Gemv, TiledWeight
    from services.worker.layers.int8_linear import Int8Weight


class LinearBase(nn.Module):
    """x W^T (+ b) on `weight` (and `bias`), which the CPU platform may repack once after loading:
    `prepack` in the weight's own dtype, or `add_float32_copy` beside a 16-bit weight."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, keeps_weight_when_packed: bool = False):
        super().__init__()
        self.keeps_weight_when_packed = keeps_weight_when_packed  # a tied weight still serves its embedding
        # oneDNN layout: the weight itself after prepack(), or a float32 copy beside a 16-bit weight.
        self.packed_weight: torch.Tensor | None = None
        self.packed_bias: torch.Tensor | None = None  # float32, beside a 16-bit weight's packed copy
        self.weight_is_packed = False
        self.int8_weight: Int8Weight | None = None  # --quantization int8: replaces `weight`
        # The checkpoint's own int8 weight and per-channel scales (GGUF Q8_0), for quantization to use.
        self.checkpoint_int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.gemv: Gemv | None = None  # the compiled GEMV for x of a few rows, on the plain weight
        self.gemv_tiles: TiledWeight | None = None  # or the weight in column tiles, up to MAX_TILE_ROWS rows
        # The AMX kernel and the weight in its B tiles, for rows above the column tiles' (amx_gemm.py).
        self.amx_gemm: AmxGemm | None = None
        self.amx_weight: AmxWeight | None = None

    def use_int8(self, int8_weight: Int8Weight) -> None:
        """Multiplies on `int8_weight` from now on and frees the float weight (a tied one too: its
        embedding then reads `int8_weight`'s rows)."""
        self.int8_weight = int8_weight
        self.checkpoint_int8 = None
        self.weight.data = self.weight.data.new_empty(0)

    def prepack(self) -> None:
        """Repacks the CPU weight for oneDNN in its own dtype and frees the plain copy (unless kept)."""
        self.packed_weight = pack_weight(self.weight)
        if not self.keeps_weight_when_packed and (self.gemv is None or self.gemv_tiles is not None):
            self.weight.data = self.weight.data.new_empty(0)
        self.weight_is_packed = True

    def add_float32_copy(self) -> None:
        """Beside a 16-bit weight, a float32 oneDNN copy for matmuls of more than a few rows."""
        self.packed_weight = pack_weight(self.weight.float())
        self.packed_bias = self.bias.float() if self.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_weight is not None:
            return self.int8_weight.linear(x, self.bias)
        if self.gemv_tiles is not None:
            if x.shape[0] <= self.gemv_tiles.max_rows and x.dtype == torch.bfloat16:
                return self.gemv.tiles(x, self.gemv_tiles, self.bias)
        elif self.gemv is not None and x.shape[0] <= MAX_GEMV_ROWS:
            return self.gemv(x, self.weight, self.bias)
        if self.amx_weight is not None and x.shape[0] <= self.amx_weight.max_rows and x.dtype == torch.bfloat16:
            return self.amx_gemm(x, self.amx_weight, self.bias)
        if self.packed_weight is None:
            return linear(x, self.weight, self.bias)
        if self.weight_is_packed:
            return packed_linear(x, self.packed_weight, self.bias)
        return linear_16bit_with_copy(x, self.weight, self.bias, self.packed_weight, self.packed_bias)


class Linear(LinearBase):
    """y = x W^T (+ b). Parameters are left uninitialised: weights always come from a checkpoint."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None


class MergedLinear(Linear):
    """Several projections of the same input, concatenated along the output dimension."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self._offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        """Copies the checkpoint tensor of projection number `shard` into its rows of `param`."""
        start, size = self._offsets[shard], self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard}: expected {size} output rows, checkpoint has {tuple(loaded.shape)}")
        param.data[start : start + size].copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """The q, k and v projections of attention in one matmul (shards 0, 1, 2)."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(
            hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias
        )


MAX_NATIVE_16BIT_ROWS = 2  # CPU: above this, 16-bit weights are widened to float32 chunk by chunk
WIDEN_CHUNK_ROWS = 1024  # weight rows widened per matmul
MAX_GEMV_ROWS = 8  # CPU: up to this many rows, bfloat16 weights multiply on the compiled GEMV (gemv.py)
# CPU with AVX512_BF16: up to this many rows on the column tiles (gemv.py), at or ahead of oneDNN's
# prepacked bfloat16 GEMM for every SmolLM2 shape measured (docs/benchmarks.md, "Column tiles").
# With AMX oneDNN multiplies on the tile unit: each weight shape's limit is then measured at
# start-up, from MAX_GEMV_ROWS (where a matmul only streams its weight) to this (tile_rows.py).
MAX_TILE_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for x [T, in] and W [out, in], in the dtype of x."""
    if weight.dtype == torch.float32 or weight.device.type != "cpu" or x.shape[0] <= MAX_NATIVE_16BIT_ROWS:
        return F.linear(x, weight, bias)
    # One float32 matmul per chunk of weight rows, widened while it is in cache.
    x32 = x.float()
    out = x32.new_empty(x.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], WIDEN_CHUNK_ROWS):
        end = start + WIDEN_CHUNK_ROWS
        torch.mm(x32, weight[start:end].float().t(), out=out[:, start:end])
    if bias is not None:
        out += bias
    return out.to(x.dtype)


def linear_16bit_with_copy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           packed_weight: torch.Tensor, packed_bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) with a 16-bit W: natively for a few rows, else on W's packed float32 copy."""
    if x.shape[0] <= MAX_NATIVE_16BIT_ROWS:
        return F.linear(x, weight, bias)
    return packed_linear(x.float(), packed_weight, packed_bias).to(x.dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 CPU weight [out, in] in oneDNN's blocked layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "none", [], "")


def can_prepack(device: torch.device, dtype: torch.dtype, native_bf16: bool = False) -> bool:
    """float32 CPU weights, and bfloat16 ones where the CPU multiplies bfloat16 natively."""
    return (
        device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def add_float32_copies(model: nn.Module) -> int:
    """Gives every matmul weight in `model` a float32 packed copy; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for layer in layers:
        layer.add_float32_copy()
    return len(layers)


def prepack_cpu_weights(model: nn.Module) -> int:
    """Prepacks every matmul weight (`LinearBase`) in `model`; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for layer in layers:
        layer.prepack()
    return len(layers)
