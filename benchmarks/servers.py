"""Servers under test, each started on loopback by the harness and stopped after its scenarios.

`Server.start()` returns a `Target` (URL, model name, extra body fields); `stop()` ends the
processes it started, by their ids. Spindle is started as its three services (tests/e2e/cluster.py);
peers come from benchmarks/peers.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.loadgen import Target
from tests.e2e.cluster import SpindleCluster, free_port

# transformers serve's faster dtype on a CPU with bfloat16 arithmetic (docs/benchmarks.md, "The peers").
TRANSFORMERS_SERVE_DTYPE_BF16_CPU = "bfloat16"
RESULTS_DIR = Path(__file__).parent / "results"
LOG_DIR = RESULTS_DIR / "logs"
SMOLLM2_EOS_ID = 2  # <|im_end|>


@dataclass
class Server:
    """A server the harness starts. `note` goes beside its row in the table."""

    name: str
    note: str = ""
    skip_reason: str = ""
    forces_length: bool = False  # whether the server honours the output-length forcing we send
    max_concurrency: int | None = None  # run only the concurrency levels up to this (and no rates)
    info: dict = field(default_factory=dict)

    def start(self) -> Target:
        raise NotImplementedError

    def stop(self) -> None:
        pass


def transformers_serve_dtype() -> str:
    """The dtype transformers serve runs fastest in here: bfloat16 where the CPU multiplies in it
    (measured on an AVX512_BF16 machine), else float32 (bfloat16 matmuls are emulated there)."""
    from services.worker.config import cpu_has_native_bf16

    return TRANSFORMERS_SERVE_DTYPE_BF16_CPU if cpu_has_native_bf16() else "float32"


class SpindleServer(Server):
    def __init__(self, name: str, env: dict[str, str] | None = None, note: str = "", tensor_parallel_size: int = 1):
        super().__init__(name, note=note, forces_length=True)
        self.env = env or {}
        self.tensor_parallel_size = tensor_parallel_size  # worker ranks (processes) splitting the model
        self.cluster: SpindleCluster | None = None

    def start(self, timeout_s: float = 600) -> Target:
        log_dir = LOG_DIR / self.name
        log_dir.mkdir(parents=True, exist_ok=True)
        # The test cluster pins the worker to one torch thread; a benchmark gives it every core, as
        # the peers get (torch's default), unless SPINDLE_NUM_THREADS says otherwise.
        threads = os.environ.get("SPINDLE_NUM_THREADS") or str(os.cpu_count() or 1)
        env = {"SPINDLE_LOG_LEVEL": "WARNING", "SPINDLE_NUM_THREADS": threads, **self.env}
        # A benchmark of the PyTorch fallback would pass for one of the compiled kernels: refuse it.
        backend = "none" if env.get("SPINDLE_FAKE_MODEL") == "true" else \
            "cpu-int8kv" if env.get("SPINDLE_KV_CACHE_DTYPE") == "int8" else "cpu"
        self.cluster = SpindleCluster(log_dir, env=env, attention_backend=backend,
                                      tensor_parallel_size=self.tensor_parallel_size).start(timeout_s)
        with urllib.request.urlopen(self.cluster.base_url + "/v1/models", timeout=10) as resp:
            import json

            model = json.load(resp)["data"][0]["id"]
        self.info = {"env": {k: v for k, v in env.items() if k != "SPINDLE_LOG_LEVEL"}, "logs": str(log_dir)}
        # ignore_eos (a vLLM extension Spindle accepts) makes every output exactly max_tokens long.
        return Target(self.cluster.base_url, model, {"ignore_eos": True})

    def stats(self) -> dict:
        import json

        with urllib.request.urlopen(self.cluster.base_url + "/stats", timeout=10) as resp:
            return json.load(resp)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


class ProcessServer(Server):
    """A peer started as one command that serves an OpenAI-compatible API on `port`."""

    def __init__(self, name: str, command: list[str], port: int, model: str, extra_body: dict | None = None,
                 env: dict[str, str] | None = None, note: str = "", health_path: str = "/v1/models",
                 forces_length: bool = False, start_timeout_s: float = 300):
        super().__init__(name, note=note, forces_length=forces_length)
        self.command, self.port, self.model = command, port, model
        self.extra_body = extra_body or {}
        self.env = env or {}
        self.health_path = health_path
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Target:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log_path = LOG_DIR / f"{self.name}.log"
        log = open(log_path, "ab")
        self.proc = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                   f"{log_path.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.base_url + self.health_path, timeout=2) as resp:
                    if resp.status == 200:
                        self.info = {"command": self.command, "log": str(log_path)}
                        return Target(self.base_url, self.model, self.extra_body)
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer on {self.health_path} in {self.start_timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and any children it forked
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


__all__ = ["Server", "SpindleServer", "ProcessServer", "free_port", "transformers_serve_dtype", "SMOLLM2_EOS_ID",
           "RESULTS_DIR", "LOG_DIR"]
