"""The slower target: every kernel once in the shim's threads mode (one OS thread per CUDA
thread, real barriers) under ThreadSanitizer, which must report no data race; and a copy with a
barrier removed, which it must report."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.kernels.loader import MODULES, read_source
from tests.kernels.cuda_shim.build import REPO_ROOT, TSAN_FLAGS, ShimSpec, build_shim, gxx

pytestmark = pytest.mark.slow
INSTANCES = ("spindle::reshape_and_cache<float>", "spindle::reshape_and_cache<spindle::bf16>",
             "spindle::paged_attention<float, 64, 4>", "spindle::paged_attention<float, 64, 8>",
             "spindle::paged_attention_combine<float, 64>", "spindle::prefill_attention<spindle::f16, 64>",
             "spindle::sample_rows<128>")


def libtsan() -> str:
    if gxx() is None:
        pytest.skip("g++ not found: the CPU kernel shim cannot be built")
    path = subprocess.run([gxx(), "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.skip("libtsan not installed (Debian: libtsan2) for the ThreadSanitizer run")
    return path


def run_under_tsan(library: Path, *checks: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LD_PRELOAD=libtsan(), TSAN_OPTIONS="halt_on_error=0 report_signal_unsafe=0",
               PYTHONPATH=str(REPO_ROOT))
    # setarch -R: TSan's shadow memory needs the fixed layout that address randomisation may break.
    cmd = [sys.executable, "-m", "tests.kernels.tsan_run", str(library), *checks]
    if subprocess.run(["setarch", "--help"], capture_output=True).returncode == 0:
        cmd = ["setarch", os.uname().machine, "-R", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=900)


def test_kernels_are_race_free_under_thread_sanitizer():
    spec = ShimSpec({m: read_source(m) for m in MODULES}, INSTANCES, flags=TSAN_FLAGS)
    result = run_under_tsan(build_shim(spec))
    print(result.stdout)
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


def test_thread_sanitizer_reports_a_missing_barrier():
    source = read_source("attention").replace("__syncthreads();  // [barrier:probs]", "")
    spec = ShimSpec({"attention": source, "cache": read_source("cache")},
                    ("spindle::paged_attention<float, 64, 4>", "spindle::paged_attention<float, 64, 8>",
                     "spindle::paged_attention_combine<float, 64>", "spindle::reshape_and_cache<float>"),
                    flags=TSAN_FLAGS)
    result = run_under_tsan(build_shim(spec), "attention")
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
