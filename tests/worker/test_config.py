from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from services.worker.config import WorkerConfig, config_from_args, parse_bytes, resolve_device, resolve_dtype
from services.worker.kv_cache import KVCacheLayout, num_blocks_for_budget


def test_flags_environment_and_defaults(monkeypatch):
    monkeypatch.setenv("SPINDLE_WORKER_ADDR", "0.0.0.0:6000")
    monkeypatch.setenv("SPINDLE_KV_CACHE_BYTES", "256MiB")
    config = config_from_args(["--max-num-seqs", "8", "--dtype", "float32"])
    assert config.worker_addr == "0.0.0.0:6000" and config.kv_cache_bytes == 256 * 2**20
    assert config.max_num_seqs == 8 and config.dtype == "float32" and config.model is None
    assert config.block_size == 16 and config.max_num_batched_tokens == 2048
    assert config_from_args(["--worker-addr", "127.0.0.1:1"]).worker_addr == "127.0.0.1:1"  # flag beats env
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32


def test_invalid_values_are_refused():
    with pytest.raises(ValueError):
        WorkerConfig(block_size=0)
    with pytest.raises(ValueError):
        WorkerConfig(dtype="int8")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_parse_bytes_and_dtype():
    assert parse_bytes("1073741824") == 2**30 and parse_bytes("1GiB") == 2**30 and parse_bytes("1.5K") == 1536
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.float32, torch.bfloat16)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
        assert resolve_device("auto") == torch.device("cpu")


def test_kv_cache_sizing():
    layout = KVCacheLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    assert layout.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert num_blocks_for_budget(layout, 2**30, max_model_len=8192, max_num_seqs=256) == 2**30 // layout.bytes_per_block
    # capped by what max_num_seqs requests of max_model_len could use
    assert num_blocks_for_budget(layout, 2**30, max_model_len=64, max_num_seqs=2) == 2 * 4 + 1
    with pytest.raises(ValueError, match="--kv-cache-bytes"):
        num_blocks_for_budget(layout, 2**20, max_model_len=8192, max_num_seqs=1)
