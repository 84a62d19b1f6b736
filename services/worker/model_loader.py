"""Builds a model from a Hugging Face folder of safetensors (sharded or not), or a GGUF file.

GGUF files are first converted once into a safetensors folder by `services.common.model_files`;
under `--quantization int8` the file's Q8_0 weights are then read from it as int8 (layers/gguf_int8.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors import safe_open
from torch import nn

from services.common.model_files import gguf_source, resolve_model
from services.worker.config import INT8_WEIGHT_QUANTIZATIONS
from services.worker.layers.gguf_int8 import attach_q8_0_weights
from services.worker.models import get_model_class
from services.worker.platforms import Platform

if TYPE_CHECKING:  # imported by tensor-parallel workers only
    from services.worker.parallel import ModelShard

logger = logging.getLogger(__name__)


def load_config(model_path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path))


def safetensors_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_path}")
    return files


def iterate_weights(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor, one file open at a time (memory-mapped)."""
    for path in safetensors_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model: str | Path, platform: Platform, cache_dir: str | None = None, config=None,
               shard: ModelShard | None = None) -> nn.Module:
    """Returns the model in eval mode, built on `platform` (its dtype, device, attention backend and
    layer ops), with every parameter filled from the checkpoint and then repacked by the platform.
    With a tensor-parallel `shard`, `config` is the rank's (`shard.local_hf_config`): the row-parallel
    projections are swapped in before loading and each checkpoint tensor is cut to the rank's part."""
    model_path = Path(model)
    if model_path.suffix == ".gguf":
        model_path = resolve_model(str(model_path), cache_dir).path
    config = config or load_config(model_path)
    model_cls = get_model_class(getattr(config, "architectures", None))
    start = time.monotonic()
    with _default_dtype(platform.dtype), torch.device(platform.device):
        # Parameters are created uninitialised (torch.empty): the checkpoint fills them.
        net = model_cls(config, platform)
        if shard is not None:
            shard.parallelize(net)
    weights = iterate_weights(model_path)
    with torch.no_grad():
        loaded = net.load_weights(shard.slice_weights(weights) if shard is not None else weights)
    missing = {name for name, _ in net.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_path} lacks {sorted(missing)[:5]} ({len(missing)} missing)")
    net.eval().requires_grad_(False)
    source = gguf_source(model_path) if platform.quantization in INT8_WEIGHT_QUANTIZATIONS else None
    if source is not None and shard is None:  # a rank's shard would need its int8 cut the same way
        logger.info("%d matmul weights from the Q8_0 tensors of %s", attach_q8_0_weights(net, source, config),
                    source.name)
    num_params = sum(p.numel() for p in net.parameters())
    packing = platform.process_weights_after_loading(net)
    if platform.decode_layers is not None and shard is None:
        packing += ", " + net.fuse_decode_layers(platform.decode_layers)
    logger.info(
        "loaded %s (%s, %.0fM parameters, %s, %s) in %.1f s",
        model_cls.__name__, model_path.name, num_params / 1e6, str(platform.dtype).removeprefix("torch."), packing,
        time.monotonic() - start,
    )
    return net
