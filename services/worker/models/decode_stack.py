"""A decode step's decoder layers in one compiled call (csrc/decode_layers.c) on the CPU.

At one row a SmolLM2-135M layer is about 0.3 ms of kernels, and the nine calls that make it from
Python (norms, GEMVs, RoPE + cache write, attention), with their tensors and checks, add a visible
share on top. At 48 rows on AMX that share was still about a sixth of a step (the second thread
idle while the first ran Python), so above the column tiles' rows the stack multiplies on the AMX
GEMM too, up to each projection's measured limit. `DecodeStack` hands the whole stack to C, which
runs the same kernels in the same order, so a step's hidden states are those of the layer-by-layer
path bit for bit.

`attach_decode_stack` gives one to a `LlamaModel` whose every layer qualifies: plain (unsharded)
projections all on the bfloat16 GEMV or its column tiles (bfloat16 activations; above the tiles the
AMX GEMM where every layer's projection has it) or all on the int8 GEMV (with bfloat16 activations
the int8 AMX GEMM above it, likewise, or without AMX the column tiles holding the int8 weight),
biases in the activations'
dtype, the compiled fused ops and paged-decode attention (on a cache in the activations' dtype, or
on the int8 cache with its compiled writer), SiLU. `LlamaModel.forward` then takes it for all-decode
steps of up to the kernels' row limit (every layer's).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from services.worker.attention.cpu_backend import CpuAttentionBackend, CpuDecodeMetadata, KernelDecode
from services.worker.attention.cpu_int8_backend import Int8CacheCpuBackend, Int8DecodeMetadata, Int8KernelDecode
from services.worker.attention.int8_kv_cache import int8_block_bytes
from services.worker.attention.torch_backend import TorchAttentionMetadata
from services.worker.layers.activation import SiluAndMul
from services.worker.layers.fused_ops import CpuLayerOps
from services.worker.layers.linear import MAX_GEMV_ROWS, MAX_TILE_ROWS, Linear, LinearBase, MergedLinear, QKVLinear

if TYPE_CHECKING:
    from services.worker.models.llama import LlamaModel

_P, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_PP = ctypes.POINTER(ctypes.c_void_p)
# decode_layers.c's weight kinds
WEIGHTS_BF16, WEIGHTS_INT8, WEIGHTS_BF16_TILES, WEIGHTS_INT8_TILES, WEIGHTS_INT8_WIDENED = 0, 1, 2, 3, 4
_PLAIN_LINEARS = (Linear, MergedLinear, QKVLinear)  # a sharded one (tensor parallelism) reduces after
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class _Plan(ctypes.Structure):
    """csrc/decode_layers.c's DecodeStack."""

    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("block_size", _I64), ("eps", _F32), ("scale", _F32),
                ("weight_kind", _I32), ("input_norm", _PP), ("post_norm", _PP), ("weight", _PP * 4),
                ("scales", _PP * 4), ("bias", _PP * 4), ("key_cache", _PP), ("value_cache", _PP),
                ("final_norm", _P), ("tiles", _PP * 4), ("max_gemv_rows", _I64), ("kv_block_bytes", _I64),
                ("num_blocks", _I64), ("act_group_size", _I64), ("tile_rows", _I64 * 4), ("amx_rows", _I64 * 4),
                ("amx", _PP * 4)]


class DecodeLayersKernel:
    """The bound C entry points, one per activation dtype."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, suffix in _SUFFIXES.items():
            function = getattr(library, f"decode_layers_{suffix}")
            function.argtypes = [ctypes.POINTER(_Plan)] + [_P] * 6 + [_I64, _P, _I64, _I64, ctypes.c_int]
            function.restype = ctypes.c_int
            self._functions[dtype] = function

    def function(self, dtype: torch.dtype):
        return self._functions[dtype]


def _pointers(tensors: list[torch.Tensor | None]):
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


class DecodeStack:
    """The layers of one `LlamaModel` as one call. Holds the model's tensors' addresses: the plan is
    rebuilt whenever the runner binds other KV cache tensors."""

    def __init__(self, model: LlamaModel, kernel: DecodeLayersKernel, dtype: torch.dtype, weight_kind: int,
                 projections: list[list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                              torch.Tensor | None, torch.Tensor | None]]],
                 max_num_rows: int, max_gemv_rows: int = 0, kv_int8: bool = False, act_group_size: int = 0,
                 tile_rows: tuple[int, ...] = (0,) * 4, amx_rows: tuple[int, ...] = (0,) * 4):
        self.model, self.dtype, self.weight_kind = model, dtype, weight_kind
        self.kv_int8 = kv_int8  # the int8 cache (its writer and kernel), else one in the activations' dtype
        self.max_num_rows = max_num_rows
        self.max_gemv_rows = max_gemv_rows  # WEIGHTS_INT8_TILES: the int8 GEMV's rows, the tiles' above
        self.act_group_size = act_group_size  # WEIGHTS_INT8_TILES: W8A8's activation groups (0: per row)
        # Per projection: the rows of its few-row kernel (bfloat16 column tiles; the int8 GEMV where an int8
        # weight has the AMX GEMM), and the AMX GEMM's above them (0: none)
        self.tile_rows, self.amx_rows = tuple(tile_rows), tuple(amx_rows)
        self._function = kernel.function(dtype)
        self._projections = projections  # per layer: (weight, scales, bias, tiles, amx) of qkv, o, gate_up, down
        self._attns = [layer.self_attn.attn for layer in model.layers]  # read every step: no module lookups
        self._caches: list[torch.Tensor] = []
        self._plan: _Plan | None = None
        self._keep: list = []  # the ctypes arrays the plan points into

    def _bound_plan(self) -> _Plan | None:
        attns = self._attns
        if len(self._caches) == len(attns) and all(a.kv_cache is c for a, c in zip(attns, self._caches)):
            return self._plan
        caches = [a.kv_cache for a in attns]
        cache_dtype = torch.int8 if self.kv_int8 else self.dtype
        if any(c is None or c.dtype != cache_dtype or not c.is_contiguous() for c in caches):
            self._caches, self._plan = [], None
            return None
        self._caches = caches
        self._plan = self._build_plan(caches)
        return self._plan

    def _build_plan(self, caches: list[torch.Tensor]) -> _Plan:
        layers, first = self.model.layers, self.model.layers[0]
        attn, mlp = first.self_attn.attn, first.mlp
        arrays = {
            "input_norm": _pointers([layer.input_layernorm.weight for layer in layers]),
            "post_norm": _pointers([layer.post_attention_layernorm.weight for layer in layers]),
            "key_cache": _pointers([c[0] for c in caches]),
            "value_cache": _pointers([c[1] for c in caches]),
        }
        per_proj = [[_pointers([p[i][part] for p in self._projections]) for i in range(4)] for part in range(5)]
        if self.kv_int8:  # [2, num_blocks, block_bytes]: a block's rows, then their scales and midpoints
            block_bytes = caches[0].shape[2]
            block_size = block_bytes // int8_block_bytes(1, attn.num_kv_heads, attn.head_dim)
        else:  # [2, num_blocks, block_size, num_kv_heads, head_dim]
            block_bytes, block_size = 0, caches[0].shape[2]
        plan = _Plan(num_layers=len(layers), hidden=self.model.norm.weight.shape[0], num_heads=attn.num_heads,
                     num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                     intermediate=mlp.down_proj.input_size, block_size=block_size,
                     eps=first.input_layernorm.eps, scale=attn.scale, weight_kind=self.weight_kind,
                     final_norm=self.model.norm.weight.data_ptr(), max_gemv_rows=self.max_gemv_rows,
                     kv_block_bytes=block_bytes, num_blocks=caches[0].shape[1],
                     act_group_size=self.act_group_size, **arrays)
        for name, arrays_of_part in zip(("weight", "scales", "bias", "tiles", "amx"), per_proj):
            field = getattr(plan, name)
            for i, array in enumerate(arrays_of_part):
                field[i] = ctypes.cast(array, _PP)
        for i in range(4):
            plan.tile_rows[i], plan.amx_rows[i] = self.tile_rows[i], self.amx_rows[i]
        self._keep = [arrays, per_proj]
        return plan

    def accepts(self, hidden_states: torch.Tensor, attn_metadata) -> bool:
        return (isinstance(attn_metadata, TorchAttentionMetadata) and attn_metadata.is_all_decode
                and isinstance(attn_metadata.decode, Int8DecodeMetadata if self.kv_int8 else CpuDecodeMetadata)
                and 0 < hidden_states.shape[0] <= self.max_num_rows and hidden_states.dtype == self.dtype
                and attn_metadata.slot_mapping.dtype == torch.int64
                and attn_metadata.decode.seq_lens.dtype == torch.int64
                and self._bound_plan() is not None)

    def __call__(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 attn_metadata: TorchAttentionMetadata) -> torch.Tensor:
        """The final norm's output [T, hidden] for the step's embeddings `hidden_states` (as
        `LlamaModel.forward` returns it); call only where `accepts` said yes."""
        cos, sin = (t.contiguous() for t in rope)
        hidden = hidden_states.contiguous()  # the embedding's fresh rows: overwritten in place
        residual = torch.empty_like(hidden)
        decode: CpuDecodeMetadata = attn_metadata.decode
        status = self._function(ctypes.byref(self._plan), hidden.data_ptr(), residual.data_ptr(), cos.data_ptr(),
                                sin.data_ptr(), attn_metadata.slot_mapping.data_ptr(), decode.block_table.data_ptr(),
                                decode.block_table.stride(0), decode.seq_lens.data_ptr(), decode.max_seq_len,
                                hidden.shape[0], torch.get_num_threads())
        if status:
            what = "no memory" if status < 0 else "int8 cache writer" if status > 10 else "bad heads"
            raise RuntimeError(f"decode layers: kernel status {status} ({what})")
        return hidden


def attach_decode_stack(model: LlamaModel, kernel: DecodeLayersKernel) -> str:
    """Gives `model` a `DecodeStack` where every layer qualifies; returns why not, or ''."""
    dtype = model.norm.weight.dtype
    if dtype not in _SUFFIXES:
        return f"activations in {dtype}"
    kinds, projections, max_rows, gemv_rows, group_sizes = set(), [], [], [], set()
    tile_rows, amx_rows = set(), set()  # per layer, each projection's (the C stack keeps one per projection)
    kv_int8 = isinstance(model.layers[0].self_attn.attn.backend, Int8CacheCpuBackend)
    for layer in model.layers:
        attn = layer.self_attn.attn
        decode = Int8KernelDecode if kv_int8 else KernelDecode
        if not (isinstance(attn.ops, CpuLayerOps) and isinstance(attn.backend, CpuAttentionBackend)
                and isinstance(attn.backend.decode, decode) and isinstance(layer.mlp.act_fn, SiluAndMul)):
            return "not on the compiled fused ops, paged-decode attention and SiLU"
        row, limits = [], []
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            entry = _gemv_operands(proj, dtype)
            if entry is None:
                return f"{type(proj).__name__} not on a GEMV for {dtype}"
            kinds.add(entry[0])
            max_rows.append(_max_rows(proj, entry[0]))
            if entry[0] == WEIGHTS_INT8_TILES:
                gemv_rows.append(proj.int8_weight.max_gemv_rows)
                group_sizes.add(proj.int8_weight.w8a8.group_size)
            row.append(entry[1:])
            limits.append((_tile_rows(proj), _amx_rows(proj)))
        projections.append(row)
        tile_rows.add(tuple(t for t, _ in limits))
        amx_rows.add(tuple(a for _, a in limits))
    if len(kinds) != 1:
        return "bfloat16 and int8 GEMVs mixed"
    if len(set(gemv_rows)) > 1:
        return "int8 GEMV row limits differ between W8A8 weights"
    if len(group_sizes) > 1:
        return "W8A8 activation groups differ between weights"
    if len(tile_rows) > 1 or len(amx_rows) > 1:
        return "a projection's column-tile or AMX GEMM row limits differ between layers"
    # Every layer's matmuls must be on their compiled kernels at the stack's row counts.
    model.decode_stack = DecodeStack(model, kernel, dtype, kinds.pop(), projections, min(max_rows),
                                     gemv_rows[0] if gemv_rows else 0, kv_int8=kv_int8,
                                     act_group_size=group_sizes.pop() if group_sizes else 0,
                                     tile_rows=tile_rows.pop(), amx_rows=amx_rows.pop())
    return ""


def _tile_rows(proj: LinearBase) -> int:
    """The rows of the projection's few-row kernel below its AMX GEMM or widened int8 tiles: column
    tiles, or the int8 GEMV."""
    if proj.int8_weight is not None:
        int8 = proj.int8_weight
        return int8.max_gemv_rows if int8.amx_weight is not None or int8.widened_tiles is not None else 0
    return proj.gemv_tiles.max_rows if proj.gemv_tiles is not None else 0


def _amx_rows(proj: LinearBase) -> int:
    amx_weight = proj.int8_weight.amx_weight if proj.int8_weight is not None else proj.amx_weight
    return amx_weight.max_rows if amx_weight is not None else 0


def _max_rows(proj: LinearBase, weight_kind: int) -> int:
    """The rows `proj` multiplies on its compiled kernel: the tiles' and the int8 GEMV's limit per weight."""
    if weight_kind == WEIGHTS_BF16_TILES:  # the AMX GEMM, where the weight has it, above the tiles
        return max(_tile_rows(proj), _amx_rows(proj))
    if weight_kind == WEIGHTS_INT8_TILES:
        return max(proj.int8_weight.tiles.max_rows, proj.int8_weight.max_gemv_rows)
    if weight_kind == WEIGHTS_INT8:  # the int8 AMX GEMM above the GEMV, where the weight has it
        return max(proj.int8_weight.max_gemv_rows, _amx_rows(proj))
    if weight_kind == WEIGHTS_INT8_WIDENED:  # every row count: the bfloat16 tiles' decode limit
        return MAX_TILE_ROWS
    return MAX_GEMV_ROWS


def _gemv_operands(proj: LinearBase, dtype: torch.dtype):
    """(weight kind, weight, scales, bias, tiles, amx) where `proj` multiplies a few rows on a GEMV
    (and, for W8A8, on its int8 tiles above; for bfloat16 tiles, on the AMX GEMM above where it has
    it) exactly as the C stack calls it; None otherwise."""
    if type(proj) not in _PLAIN_LINEARS:
        return None
    bias = proj.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None  # the layer path adds such a bias after the GEMV, rounding twice
    if proj.int8_weight is not None:
        int8 = proj.int8_weight
        if int8.gemv is None:
            return None
        if int8.tiles is not None and dtype == torch.bfloat16:
            if int8.tiles.asymmetric and int8.max_gemv_rows:
                return None  # the stack passes one scale per channel to both, and these differ
            return WEIGHTS_INT8_TILES, int8.qweight, int8.tiles.scales, bias, int8.tiles.data, None
        if int8.widened_tiles is not None and dtype == torch.bfloat16:
            return WEIGHTS_INT8_WIDENED, int8.qweight, int8.scales, bias, int8.widened_tiles.data, None
        amx = int8.amx_weight.data if int8.amx_weight is not None and dtype == torch.bfloat16 else None
        return WEIGHTS_INT8, int8.qweight, int8.scales, bias, None, amx
    if proj.gemv_tiles is not None and dtype == torch.bfloat16:
        amx = proj.amx_weight.data if proj.amx_weight is not None else None
        return WEIGHTS_BF16_TILES, proj.gemv_tiles.data, None, bias, None, amx
    if proj.gemv is not None and dtype == torch.bfloat16 and proj.weight.dtype == torch.bfloat16:
        return WEIGHTS_BF16, proj.weight, None, bias, None, None
    return None
