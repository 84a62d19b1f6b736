"""Engine overhead: what one engine step costs when the model costs nothing.

Two measurements at each number of running requests (1, 64, 256, 1024 by default):

- **served**: frontend + scheduler + a `--fake-model` worker (every step returns a fixed token at
  once) as three processes; N requests held open over HTTP (non-streaming, long `max_tokens`); the
  scheduler's step counter (`/stats`) over a few windows gives steps per second, and /proc gives
  each service's CPU time per step. With a free model, a step's wall time IS the service split's
  overhead: scheduling, protobuf, gRPC round trips, output routing, the frontend's detokenizing.
- **in-process**: the same Scheduler and FakeModelRunner in one process, every message encoded
  to protobuf bytes and decoded again as it would cross a service boundary: the time of scheduling
  and of serialization, without gRPC or asyncio. (Served and in-process times do not subtract: the
  three processes overlap, e.g. the frontend detokenizes one step while the scheduler runs the next.)

    .venv/bin/python -m benchmarks.engine_overhead [--num-running 1,64,256,1024] [--window-s 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

import aiohttp

from services.common import codec, worker_codec
from services.common.messages import EngineCoreRequest, SamplingParams
from services.common.pb import engine_core_pb2, worker_pb2
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.fake_runner import FakeModelRunner, FAKE_HEAD_DIM, FAKE_NUM_KV_HEADS, FAKE_NUM_LAYERS

PROMPT = [1, 9690, 198, 2683, 314, 260, 3575, 30]  # 8 token ids; the content does not matter
MAX_TOKENS = 12000  # long enough that no request ends while measured
MAX_MODEL_LEN = 16384
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- in-process: scheduling and serialization ---------------------------------------------------
def _timed(fn, *args):
    start = time.perf_counter_ns()
    out = fn(*args)
    return out, time.perf_counter_ns() - start


def in_process_step_costs(num_running: int, num_steps: int = 30) -> dict:
    """Median per-step microseconds of each part of a decode step with `num_running` requests."""
    from services.worker.kv_cache import KVCacheLayout
    import torch

    block_size = 16
    num_blocks = num_running * (-(-(len(PROMPT) + num_steps + 4) // block_size)) + 1  # enough for the steps run
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running),
                          num_blocks, block_size, MAX_MODEL_LEN)
    runner = FakeModelRunner(KVCacheLayout(FAKE_NUM_LAYERS, FAKE_NUM_KV_HEADS, FAKE_HEAD_DIM, block_size, torch.float32))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(num_running):
        scheduler.add_request(Request(EngineCoreRequest(f"r{i}", list(PROMPT), params, time.time())))
    parts: dict[str, list[float]] = {k: [] for k in (
        "schedule", "encode_scheduler_output", "decode_scheduler_output", "fake_model", "encode_runner_output",
        "decode_runner_output", "update_from_output", "encode_engine_outputs", "decode_engine_outputs")}
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    outputs_encoder, outputs_decoder = codec.OutputsEncoder(), codec.OutputsDecoder()
    for step in range(num_steps + 3):
        so, t_sched = _timed(scheduler.schedule)
        so_bytes, t_enc_so = _timed(lambda: encoder.encode(so).SerializeToString())
        so_worker, t_dec_so = _timed(lambda: decoder.decode(worker_pb2.SchedulerOutput.FromString(so_bytes)))
        ro, t_fake = _timed(runner.execute_model, so_worker)
        ro_bytes, t_enc_ro = _timed(lambda: decoder.encode_output(ro).SerializeToString())
        ro_sched, t_dec_ro = _timed(lambda: encoder.decode_output(
            worker_pb2.ExecuteModelResponse.FromString(ro_bytes)))
        eco, t_update = _timed(scheduler.update_from_output, so, ro_sched)
        eco.scheduler_stats, eco.timestamp = scheduler.get_stats(), time.time()
        eco_bytes, t_enc_eco = _timed(lambda: outputs_encoder.encode(eco).SerializeToString())
        _, t_dec_eco = _timed(lambda: outputs_decoder.decode(engine_core_pb2.EngineCoreOutputs.FromString(eco_bytes)))
        if step < 3:  # the first steps admit and prefill; measure steady decode
            continue
        for key, ns in zip(parts, (t_sched, t_enc_so, t_dec_so, t_fake, t_enc_ro, t_dec_ro, t_update, t_enc_eco, t_dec_eco)):
            parts[key].append(ns / 1e3)
    costs = {k: statistics.median(v) for k, v in parts.items()}
    costs["scheduling_us"] = costs["schedule"] + costs["update_from_output"]
    costs["serialization_us"] = sum(costs[k] for k in parts if k.startswith(("encode", "decode")))
    costs["total_us"] = sum(costs[k] for k in parts)
    return costs


# --- served: three processes ----------------------------------------------------------------------
def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


async def _hold_requests(base_url: str, model: str, num: int, stop: asyncio.Event) -> None:
    """Keeps `num` non-streaming requests open until `stop`; leaving closes them (the frontend aborts)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def one():
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                await resp.read()

        tasks = [asyncio.create_task(one()) for _ in range(num)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def measure_served(base_url: str, model: str, pids: dict[str, int], num_running: int, *, window_s: float,
                         num_windows: int, admit_timeout_s: float = 120) -> dict:
    stop = asyncio.Event()
    holder = asyncio.create_task(_hold_requests(base_url, model, num_running, stop))
    loop = asyncio.get_running_loop()
    stats = lambda: loop.run_in_executor(None, _get_json, base_url + "/stats")  # noqa: E731
    try:
        deadline = time.monotonic() + admit_timeout_s
        while True:
            s = await stats()
            if s["num_running_reqs"] == num_running and s["num_waiting_reqs"] == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {s['num_running_reqs']} of {num_running} requests running")
            await asyncio.sleep(0.2)
        await asyncio.sleep(min(1.0, window_s))  # past admission and prefill
        windows = []
        for _ in range(num_windows):
            t0, s0, c0 = time.perf_counter(), await stats(), {k: _cpu_s(p) for k, p in pids.items()}
            await asyncio.sleep(window_s)
            t1, s1, c1 = time.perf_counter(), await stats(), {k: _cpu_s(p) for k, p in pids.items()}
            steps = s1["num_steps"] - s0["num_steps"]
            if s1["num_running_reqs"] != num_running or steps <= 0:
                continue
            windows.append({"steps_per_s": steps / (t1 - t0),
                            "cpu_ms_per_step": {k: (c1[k] - c0[k]) * 1e3 / steps for k in pids}})
        if not windows:
            raise RuntimeError("no valid measurement window (requests finished or no steps)")
        steps_per_s = statistics.median(w["steps_per_s"] for w in windows)
        return {
            "num_running": num_running,
            "steps_per_s": steps_per_s,
            "step_ms": 1e3 / steps_per_s,
            "tokens_per_s": steps_per_s * num_running,
            "cpu_ms_per_step": {k: statistics.median(w["cpu_ms_per_step"][k] for w in windows) for k in pids},
            "num_windows": len(windows),
        }
    finally:
        stop.set()
        await holder
        for _ in range(100):  # wait for the aborts to drain
            if (await stats())["num_running_reqs"] == 0:
                break
            await asyncio.sleep(0.2)


def fake_cluster_env(max_num_running: int) -> dict[str, str]:
    return {
        "SPINDLE_FAKE_MODEL": "true",
        # Only reported: the fake worker allocates nothing. Enough that 1,024 requests grow ~5k tokens each
        # before the cache runs out and preemption would spoil the measurement.
        "SPINDLE_KV_CACHE_BYTES": "256GiB",
        "SPINDLE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "SPINDLE_MAX_NUM_SEQS": str(max(256, max_num_running)),
        "SPINDLE_MAX_NUM_BATCHED_TOKENS": str(max(2048, max_num_running)),
    }


def run(levels: list[int], window_s: float = 2.0, num_windows: int = 3) -> dict:
    """Starts the fake-model cluster, measures every level served and in-process; returns rows."""
    from benchmarks.servers import SpindleServer

    server = SpindleServer("spindle-fake-model", env=fake_cluster_env(max(levels)))
    target = server.start()
    pids = {name: proc.pid for name, proc in server.cluster.procs.items()}
    rows = []
    try:
        for n in levels:
            served = asyncio.run(measure_served(target.base_url, target.model, pids, n, window_s=window_s,
                                                num_windows=num_windows))
            local = in_process_step_costs(n)
            served["in_process_us"] = local
            served["scheduling_ms"] = local["scheduling_us"] / 1e3
            served["serialization_ms"] = local["serialization_us"] / 1e3
            rows.append(served)
            print(f"engine overhead, {n:5d} running: {served['steps_per_s']:8.1f} steps/s = {served['step_ms']:7.2f} ms/step "
                  f"(scheduling {served['scheduling_ms']:.2f}, serialization {served['serialization_ms']:.2f} ms; "
                  f"CPU ms/step {', '.join(f'{k} {v:.2f}' for k, v in served['cpu_ms_per_step'].items())})", flush=True)
    finally:
        server.stop()
    return {"rows": rows, "window_s": window_s, "num_windows": num_windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-running", default="1,64,256,1024")
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--num-windows", type=int, default=3)
    args = parser.parse_args()
    out = run([int(x) for x in args.num_running.split(",")], args.window_s, args.num_windows)
    path = Path(__file__).parent / "results" / "engine_overhead.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
