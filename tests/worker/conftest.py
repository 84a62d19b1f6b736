from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # for worker_helpers

from worker_helpers import save_tiny_model  # noqa: E402

# The test machines have few cores shared with other jobs; more threads only add contention.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
