"""Starts the three services as separate processes on free ports, as a deployment would."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# The small engine most end-to-end modules share: 256 MiB of KV cache, a 2,048-token context.
SMALL_ENGINE_ENV = {"SPINDLE_KV_CACHE_BYTES": str(256 * 2**20), "SPINDLE_MAX_MODEL_LEN": "2048"}


def module_cluster(tmp_path_factory, env: dict[str, str] | None = None):
    """A module fixture's body (`yield from module_cluster(tmp_path_factory)`): a started cluster
    with the small engine (and `env` on top), stopped after the module."""
    cluster = SpindleCluster(tmp_path_factory.mktemp("logs"), env={**SMALL_ENGINE_ENV, **(env or {})})
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def free_port() -> int:
    return free_ports(1)[0]


_GIVEN_PORTS: set[int] = set()  # every port free_ports has handed out in this process


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports, none handed out before in this process: the sockets are held
    together until all are picked, since one released port may be handed out again at once (to the
    next cluster too, picked before the first one starts: two clusters side by side then collided),
    and gRPC servers bind with SO_REUSEPORT, so two services given the same port would share it
    silently (an HTTP client then reads HTTP/2 frames)."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sockets.append(s := socket.socket())
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in _GIVEN_PORTS:
                ports.append(port)
                _GIVEN_PORTS.add(port)
        return ports
    finally:
        for s in sockets:
            s.close()


class SpindleCluster:
    """frontend + scheduler + worker, each `python -m services.<name>`, configured by SPINDLE_* variables."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, attention_backend: str = "cpu",
                 service_env: dict[str, dict[str, str]] | None = None, tensor_parallel_size: int = 1):
        """attention_backend: what the worker must report once healthy ("cpu" is the compiled C decode
        kernel), so a failed kernel build cannot pass the parity tests on the PyTorch fallback.
        service_env: variables for one service only (its certificate, its tokens), by service name.
        tensor_parallel_size: worker ranks; rank 0 is the service "worker", rank r "worker{r}"."""
        self.log_dir = log_dir
        self.attention_backend = attention_backend
        num_ranks = tensor_parallel_size
        ports = free_ports(5 + num_ranks)
        http_port, frontend_grpc_port, engine_grpc_port, scheduler_port, worker_port = ports[:5]
        self.worker_names = ["worker"] + [f"worker{r}" for r in range(1, num_ranks)]
        self.worker_addrs = [f"127.0.0.1:{worker_port}"] + [f"127.0.0.1:{p}" for p in ports[5:-1]]
        tp_env = {} if num_ranks == 1 else {
            "SPINDLE_TENSOR_PARALLEL_SIZE": str(num_ranks),
            "SPINDLE_WORKER_ADDRS": ",".join(self.worker_addrs),
            "SPINDLE_TENSOR_PARALLEL_PORT": str(ports[-1]),  # rank 0's rendezvous store
        }
        self.http_port = http_port
        self.frontend_grpc_addr = f"127.0.0.1:{frontend_grpc_port}"
        self.engine_grpc_port = engine_grpc_port  # vLLM's engine protocol (VllmEngine)
        self.scheduler_addr = f"127.0.0.1:{scheduler_port}"
        self.worker_addr = f"127.0.0.1:{worker_port}"
        self.env = {
            **os.environ,
            "SPINDLE_HTTP_HOST": "127.0.0.1",
            "SPINDLE_HTTP_PORT": str(self.http_port),
            "SPINDLE_FRONTEND_GRPC_ADDR": self.frontend_grpc_addr,
            "SPINDLE_ENGINE_GRPC_PORT": str(self.engine_grpc_port),
            "SPINDLE_SCHEDULER_ADDR": self.scheduler_addr,
            "SPINDLE_WORKER_ADDR": self.worker_addr,
            "SPINDLE_DTYPE": "float32",
            "SPINDLE_SHUTDOWN_TIMEOUT": "5",
            # One intra-op thread: on a 2-core machine shared with the frontend, the scheduler and the
            # test process, two spinning OpenMP threads slow small matmuls down by an order of magnitude.
            "SPINDLE_NUM_THREADS": "1",
            # Clusters of several tests may run side by side: no fixed metrics ports.
            "SPINDLE_METRICS_PORT": "0",
            "PYTHONUNBUFFERED": "1",
            **tp_env,
            **(env or {}),
        }
        self.service_env = dict(service_env or {})
        for rank, (name, addr) in enumerate(zip(self.worker_names, self.worker_addrs)):
            if num_ranks > 1:
                rank_env = {"SPINDLE_WORKER_ADDR": addr, "SPINDLE_TENSOR_PARALLEL_RANK": str(rank)}
                self.service_env[name] = {**rank_env, **self.service_env.get(name, {})}
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def engine_grpc_addr(self) -> str:
        return f"127.0.0.1:{self.engine_grpc_port}"

    def start_service(self, name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        module = "worker" if name in self.worker_names else name
        proc = subprocess.Popen([sys.executable, "-m", f"services.{module}"], cwd=ROOT,
                                env={**self.env, **self.service_env.get(name, {})},
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 300) -> "SpindleCluster":
        for name in (*self.worker_names, "scheduler", "frontend"):
            self.start_service(name)
        self.wait_healthy(timeout_s)
        with urllib.request.urlopen(self.base_url + "/stats", timeout=10) as resp:
            backend = json.load(resp)["attention_backend"]
        if backend != self.attention_backend:
            raise RuntimeError(f"worker runs attention backend {backend!r}, expected {self.attention_backend!r}:\n"
                               + self.log_tail("worker"))
        return self

    def wait_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError("services did not become healthy:\n" + "\n".join(self.log_tail(n) for n in self.procs))

    def log_tail(self, name: str, num_chars: int = 4000) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name} ---\n{text[-num_chars:]}"

    def stop_service(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop(self) -> None:
        for name in ("frontend", "scheduler", *self.worker_names):
            if name in self.procs:
                self.stop_service(name)

    def wait_for_idle(self, timeout_s: float = 30.0) -> dict:
        """Polls /stats until no request runs or waits and returns those stats; raises TimeoutError
        (with the last stats) otherwise, so a slow engine is not mistaken for leaked blocks."""
        import json

        deadline = time.monotonic() + timeout_s
        while True:
            with urllib.request.urlopen(self.base_url + "/stats", timeout=10) as resp:
                stats = json.load(resp)
            if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still running or waiting after {timeout_s} s: {stats}")
            time.sleep(0.1)
