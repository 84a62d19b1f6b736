"""Every e2e cluster checks the attention backend the worker reports (SpindleCluster.start): the
parity tests cannot pass on the PyTorch fallback when the compiled C decode kernel failed to load."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.e2e.cluster import SpindleCluster
from tests.e2e.test_tiny_models import build_tiny_model


def test_a_worker_on_the_pytorch_fallback_fails_the_cluster_check(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", "llama")
    # --attention-backend torch stands in for a failed kernel build: the worker runs, on PyTorch.
    cluster = SpindleCluster(tmp_path, env={"SPINDLE_MODEL": str(model_dir), "SPINDLE_ATTENTION_BACKEND": "torch"})
    try:
        with pytest.raises(RuntimeError, match="attention backend 'torch', expected 'cpu'"):
            cluster.start()
        with urllib.request.urlopen(cluster.base_url + "/stats", timeout=10) as resp:
            stats = json.load(resp)
        assert (stats["device"], stats["dtype"], stats["attention_backend"]) == ("cpu", "float32", "torch")
    finally:
        cluster.stop()
