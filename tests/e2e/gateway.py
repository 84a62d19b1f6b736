"""The SMG gateway (`smg` on PyPI, a Rust binary) for end-to-end tests: installed once into
`<repo>/.venv-smg` (the venv `make gateway` uses) and started on a free port in front of engines
that speak vLLM's engine gRPC protocol."""
from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.cluster import ROOT, free_port

SMG_VERSION = "1.13.0"
SMG_VENV = ROOT / ".venv-smg"
# The Makefile's stamp, so that `make gateway` and the tests share one install.
_STAMP = SMG_VENV / ".installed"
INSTALL_TIMEOUT_S = 600


def smg_binary() -> Path:
    """`<repo>/.venv-smg/bin/smg`, installing smg into a fresh venv first when missing. Parallel
    callers wait on a file lock so that only one installs. Skips the test when the install fails
    (no network, no wheel for this platform), with pip's last words as the reason."""
    binary = SMG_VENV / "bin" / "smg"
    if _STAMP.exists() and binary.exists():
        return binary
    SMG_VENV.mkdir(exist_ok=True)
    with open(SMG_VENV / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _STAMP.exists() and binary.exists():  # installed while we waited
            return binary
        for step in ([sys.executable, "-m", "venv", str(SMG_VENV)],
                     [str(SMG_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                      f"smg=={SMG_VERSION}"]):
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.skip(f"installing smg=={SMG_VERSION} took over {INSTALL_TIMEOUT_S} s")
            if done.returncode != 0:
                pytest.skip(f"cannot install smg=={SMG_VERSION} into {SMG_VENV}: {done.stderr.strip()[-800:]}")
        if not binary.exists():
            pytest.skip(f"smg=={SMG_VERSION} installed no {binary}")
        _STAMP.touch()
    return binary


def _die_with_parent() -> list[str]:
    """A prefix of the gateway's command so that a test process killed outright takes the gateway
    with it (util-linux's setpriv sets the death signal, then execs), or none where setpriv is missing.

    Not a `preexec_fn`: that makes Popen fork() instead of vfork(), and gRPC's fork handlers (this
    process holds channels to the clusters) then restart its poller in the child, whose epoll fd
    `close_fds` closes before exec: the child aborted now and then with "epoll_wait error: Bad file
    descriptor" (grpcio 1.80 onwards, grpc/grpc#43055)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


class SmgGateway:
    """`smg launch` on a free port in front of `worker_urls` (grpc://HOST:PORT), logging to
    `log_path`. `extra_args` are further launch flags (policy, parsers, health checks)."""

    def __init__(self, binary: Path, worker_urls: list[str], log_path: Path, extra_args: tuple[str, ...] = ()):
        self.binary = binary
        self.worker_urls = list(worker_urls)
        self.log_path = log_path
        self.extra_args = tuple(extra_args)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> "SmgGateway":
        """Starts the gateway; returns once /readiness counts every worker healthy. (/health and
        /v1/models answer 200 before the worker's tokenizer is registered, when a chat request
        would still fail; /readiness waits for that too.)"""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*_die_with_parent(), str(self.binary), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *self.worker_urls,
             # Its Prometheus listener defaults to 0.0.0.0:29000, one gateway per machine.
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             # In-flight requests are the test's own: no 180 s drain on teardown.
             "--shutdown-grace-period-secs", "1",
             *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                last = self.readiness()
                if last.get("status") == "ready" and last.get("healthy_workers") == len(self.worker_urls):
                    return self
            except (OSError, ValueError) as exc:
                last = exc
            time.sleep(0.3)
        raise TimeoutError(f"smg is not ready with {len(self.worker_urls)} workers (last: {last!r}):\n"
                           + self.log_tail())

    def readiness(self) -> dict:
        """/readiness: {"status": "ready" | "not ready", "healthy_workers", "total_workers", ...}."""
        try:
            with urllib.request.urlopen(self.base_url + "/readiness", timeout=10) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as err:  # 503 while not ready, with the reason
            return json.load(err)

    def workers(self) -> list[dict]:
        """The gateway's view of its workers (/workers): each with `url`, `is_healthy`, `status`."""
        with urllib.request.urlopen(self.base_url + "/workers", timeout=10) as resp:
            return json.load(resp)["workers"]

    def log_tail(self, num_chars: int = 4000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- smg ---\n{text[-num_chars:]}"

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
