"""`spindle`: run one service, or all three as child processes (`spindle serve`)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

SERVICES = ("worker", "scheduler", "frontend")
USAGE = """spindle serve [--model PATH] [--dtype DTYPE] [--tensor-parallel-size N]
                                              start worker(s), scheduler and frontend
spindle frontend|scheduler|worker [FLAGS]     run one service (see `spindle worker --help`)

Every flag also reads SPINDLE_<FLAG> from the environment (e.g. SPINDLE_DTYPE=float32)."""


def run_service(name: str, argv: list[str]) -> int:
    if name == "frontend":
        from services.frontend.__main__ import main
    elif name == "scheduler":
        from services.scheduler.__main__ import main
    else:
        from services.worker.__main__ import main
    return main(argv) or 0


def serve(argv: list[str]) -> int:
    """Starts the three services; Ctrl-C or SIGTERM stops all of them, and so does any one dying."""
    parser = argparse.ArgumentParser(prog="spindle serve")
    parser.add_argument("--model", help="Hugging Face folder or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--tensor-parallel-size", type=int,
                        help="worker ranks splitting the model, one worker process each (default 1)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    if args.model:
        env["SPINDLE_MODEL"] = args.model
    if args.dtype:
        env["SPINDLE_DTYPE"] = args.dtype
    if args.tensor_parallel_size:
        env["SPINDLE_TENSOR_PARALLEL_SIZE"] = str(args.tensor_parallel_size)
    try:
        worker_commands = _worker_commands(env)
    except ValueError as exc:
        print(f"spindle: {exc}", file=sys.stderr)
        return 2
    # Handlers first: a signal while the children start must stop them too, not leave them behind.
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    children: dict[str, subprocess.Popen] = {}
    for name, command in worker_commands.items():
        children[name] = subprocess.Popen(command, env=env)
    for name in SERVICES[1:]:
        children[name] = subprocess.Popen([sys.executable, "-m", f"services.{name}"], env=env)
    print(f"spindle: started {', '.join(f'{n} (pid {p.pid})' for n, p in children.items())}; "
          f"HTTP on {env.get('SPINDLE_HTTP_HOST', '127.0.0.1')}:{env.get('SPINDLE_HTTP_PORT', '8000')}",
          flush=True)

    exit_code = 0
    while not stopping:
        for name, child in children.items():
            if child.poll() is not None:
                print(f"spindle: {name} exited with status {child.returncode}; stopping", file=sys.stderr)
                exit_code = 1
                stopping = True
        time.sleep(0.2)
    # Frontend first so no new requests arrive, then the engine, then the workers.
    for name in reversed(list(children)):
        child = children[name]
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=40)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()  # reaped, so no zombie outlives serve
    return exit_code


def _worker_commands(env: dict[str, str]) -> dict[str, list[str]]:
    """One worker command per tensor-parallel rank: rank r listens where the scheduler expects it
    (services/scheduler/config.py: `--worker-addrs`, else `--worker-addr`'s port + r) and serves
    metrics on the worker metrics port + r (a port of 0 stays off)."""
    from services.scheduler.config import rank_addresses

    size = int(env.get("SPINDLE_TENSOR_PARALLEL_SIZE", "1"))
    command = [sys.executable, "-m", "services.worker"]
    if size == 1:
        return {"worker": command}
    addrs = rank_addresses(env.get("SPINDLE_WORKER_ADDR", "127.0.0.1:50053"), env.get("SPINDLE_WORKER_ADDRS", ""), size)
    metrics_port = int(env.get("SPINDLE_METRICS_PORT", "9093"))
    return {
        f"worker (rank {rank})": [*command, "--worker-addr", addr, "--tensor-parallel-rank", str(rank),
                                  "--metrics-port", str(metrics_port + rank if metrics_port else 0)]
        for rank, addr in enumerate(addrs)
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command in SERVICES:
        return run_service(command, rest)
    print(f"spindle: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
