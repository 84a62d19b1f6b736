from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.harness import save_tiny_model

# The test machines have few cores shared with other jobs; more threads only add contention.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
