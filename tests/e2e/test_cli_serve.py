"""`spindle serve` (what `make run` runs): the three services as children on the ports the SPINDLE_*
variables give, a correct answer, and a stop (Ctrl-C, SIGTERM, or one child dying) that leaves no
process of its session behind."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.e2e.cluster import ROOT, free_ports
from tests.e2e.parity import assert_greedy_match, hf_greedy
from tests.e2e.probes import grpc_serving, wait_until
from tests.e2e.test_tiny_models import build_tiny_model

MAX_TOKENS = 16
START_DEADLINE_S = 300
STOP_DEADLINE_S = 120
# The console script pyproject.toml installs and `make run` starts.
SPINDLE = Path(sysconfig.get_path("scripts")) / "spindle"
STARTED_LINE = re.compile(r"spindle: started worker \(pid (\d+)\), scheduler \(pid (\d+)\), "
                          r"frontend \(pid (\d+)\); HTTP on 127\.0\.0\.1:(\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


class Serve:
    """`spindle serve` in a session of its own, so a Ctrl-C can reach its whole process group."""

    def __init__(self, log_dir: Path, model_dir: Path):
        self.http_port, *ports = free_ports(4)
        self.addrs = {name: f"127.0.0.1:{port}" for name, port in zip(("frontend", "scheduler", "worker"), ports)}
        env = {**os.environ, "SPINDLE_HTTP_HOST": "127.0.0.1", "SPINDLE_HTTP_PORT": str(self.http_port),
               "SPINDLE_FRONTEND_GRPC_ADDR": self.addrs["frontend"], "SPINDLE_SCHEDULER_ADDR": self.addrs["scheduler"],
               "SPINDLE_WORKER_ADDR": self.addrs["worker"], "SPINDLE_NUM_THREADS": "1", "SPINDLE_METRICS_PORT": "0",
               "SPINDLE_SHUTDOWN_TIMEOUT": "5", "SPINDLE_ENGINE_GRPC_PORT": "0", "PYTHONUNBUFFERED": "1"}
        env.pop("SPINDLE_DTYPE", None)  # the flag below must be what sets it
        self.log_path = log_dir / "serve.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(SPINDLE), "serve", "--model", str(model_dir), "--dtype", "float32"],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"spindle serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"spindle serve did not become healthy:\n{self.log()[-4000:]}")

    def children(self) -> dict[str, int]:
        """Service name -> pid, as the started line reports them; checked against /proc."""
        match = STARTED_LINE.search(self.log())
        assert match, self.log()[-4000:]
        assert int(match.group(4)) == self.http_port
        reported = dict(zip(("worker", "scheduler", "frontend"), map(int, match.groups()[:3])))
        actual = {}
        for pid in session_pids(self.proc.pid) - {self.proc.pid}:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert _stat_fields(pid)[1] == self.proc.pid, f"pid {pid} {argv} is not a child of spindle serve"
            actual[argv[argv.index(b"-m") + 1].decode().removeprefix("services.")] = pid
        assert actual == reported, (actual, reported)
        return reported

    def kill(self) -> None:
        """Test clean-up only: whatever is left of the session."""
        for pid in session_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def _stat_fields(pid: int) -> list:
    """(state, ppid, pgrp, session) from /proc/<pid>/stat; the name in parentheses may hold spaces."""
    text = Path(f"/proc/{pid}/stat").read_text()
    state, ppid, pgrp, session = text[text.rindex(")") + 2:].split()[:4]
    return [state, int(ppid), int(pgrp), int(session)]


def session_pids(sid: int) -> set[int]:
    """Live (not zombie) processes of session `sid`."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, _, _, session = _stat_fields(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited while we looked
            if session == sid and state != "Z":
                pids.add(int(entry.name))
    return pids


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.load(resp)


def _assert_stopped(serve: Serve, children: dict[str, int], exit_code: int) -> None:
    try:
        assert serve.proc.wait(STOP_DEADLINE_S) == exit_code, serve.log()[-4000:]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"spindle serve still running {STOP_DEADLINE_S} s after the stop") from None
    assert session_pids(serve.proc.pid) == set(), "processes of spindle serve outlived it"
    for name, pid in children.items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) was left unreaped"


@pytest.fixture()
def serve(tmp_path, model_dir):
    s = Serve(tmp_path, model_dir)
    try:
        yield s
    finally:
        s.kill()


def test_serve_answers_like_transformers_and_ctrl_c_stops_every_child(serve, model_dir):
    serve.wait_healthy()
    children = serve.children()
    for name, addr in serve.addrs.items():
        # The frontend follows engine readiness on a short poll, so it may turn SERVING just after /health.
        wait_until(lambda: grpc_serving(addr), f"{name} gRPC health on {addr} did not turn SERVING", timeout_s=30)
    with urllib.request.urlopen(serve.base_url + "/stats", timeout=10) as resp:
        stats = json.load(resp)
    assert (stats["dtype"], stats["attention_backend"]) == ("float32", "cpu"), stats

    body = _post_json(serve.base_url + "/v1/chat/completions", {
        "model": model_dir.name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True})
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert_greedy_match(body["choices"][0]["token_ids"], hf_greedy(hf, body["prompt_token_ids"], MAX_TOKENS),
                        "spindle serve")

    os.killpg(serve.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _assert_stopped(serve, children, exit_code=0)
    assert "Traceback" not in serve.log(), serve.log()[-4000:]


def test_serve_stops_every_child_on_sigterm(serve):
    serve.wait_healthy()
    children = serve.children()
    serve.proc.send_signal(signal.SIGTERM)  # as `docker stop` or Kubernetes would, to serve alone
    _assert_stopped(serve, children, exit_code=0)
    assert "Traceback" not in serve.log(), serve.log()[-4000:]


def test_serve_stops_the_others_when_one_child_dies(serve):
    serve.wait_healthy()
    children = serve.children()
    os.kill(children["worker"], signal.SIGKILL)
    _assert_stopped(serve, children, exit_code=1)
    assert "spindle: worker exited with status -9; stopping" in serve.log()


def test_help_lists_the_commands_and_flags():
    top = subprocess.run([str(SPINDLE), "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    assert "spindle serve [--model PATH] [--dtype DTYPE]" in top.stdout
    assert "spindle frontend|scheduler|worker [FLAGS]" in top.stdout
    serve_help = subprocess.run([str(SPINDLE), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert serve_help.returncode == 0, serve_help.stderr
    assert serve_help.stdout.startswith("usage: spindle serve [-h] [--model MODEL] [--dtype DTYPE]\n"), \
        serve_help.stdout
    assert subprocess.run([str(SPINDLE)], capture_output=True, timeout=60).returncode == 2


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_runs_spindle_serve():
    # As a user types it: not as a sub-make of `make test` (which would print its directory changes).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    dry_run = subprocess.run(["make", "--no-print-directory", "-n", "run"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=env)
    assert dry_run.returncode == 0, dry_run.stderr
    # Install steps come first when the venv is out of date; the last command is always the server.
    assert dry_run.stdout.splitlines()[-1] == ".venv/bin/spindle serve", dry_run.stdout
