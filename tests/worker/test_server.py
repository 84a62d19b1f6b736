"""The WorkerService over real gRPC: in-process for the RPCs, as a subprocess for start-up and SIGTERM."""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import worker_codec
from services.common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig, resolve_dtype
from services.worker.server import WorkerServer
from tests.worker.harness import hf_greedy

REPO_ROOT = Path(__file__).resolve().parents[2]


class InProcessServer:
    """A WorkerServer on its own event loop in a background thread."""

    def __init__(self, config: WorkerConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: WorkerServer = self._call(self._start(config))

    async def _start(self, config: WorkerConfig) -> WorkerServer:
        server = WorkerServer(config)
        await server.start()
        await server.load()
        return server

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self._call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = WorkerConfig(worker_addr="127.0.0.1:0", model=str(tiny_llama_dir), served_model_name="tiny",
                          dtype="float32", kv_cache_bytes=2**20, block_size=4, max_num_seqs=8)
    srv = InProcessServer(config)
    yield srv.server
    srv.close()


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel), channel


def test_describe_and_initialize(stub):
    stub, channel = stub
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    spec = worker_codec.kv_cache_spec_from_pb(stub.DescribeKVCache(worker_pb2.DescribeKVCacheRequest()))
    assert (spec.model_name, spec.block_size, spec.dtype, spec.device) == ("tiny", 4, "float32", "cpu")
    assert spec.max_model_len == 256 and spec.vocab_size == 512
    assert spec.attention_backend == "cpu"  # the compiled decode kernel, not the PyTorch fallback
    assert spec.num_blocks == 2**20 // spec.block_bytes
    response = stub.InitializeKVCache(worker_pb2.InitializeKVCacheRequest(num_blocks=100))
    assert response.num_blocks == 100 and response.kv_cache_bytes == 100 * spec.block_bytes


def _recording(monkeypatch, server):
    """Records the SchedulerOutput each step hands the runner (what the worker's end decoded)."""
    seen, execute = [], server.worker.execute_model

    def record(so):
        seen.append(so)
        return execute(so)

    monkeypatch.setattr(server.worker, "execute_model", record)
    return seen


def test_execute_model_stream(stub, server, tiny_llama_dir, monkeypatch):
    stub, _ = stub
    stub.InitializeKVCache(worker_pb2.InitializeKVCacheRequest(num_blocks=64))
    seen = _recording(monkeypatch, server)
    prompt = [11, 22, 33, 44, 55, 66, 77]
    expected = hf_greedy(tiny_llama_dir, prompt, 3)
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    steps = [
        SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", prompt, greedy, [3, 4], 0)],
                        num_scheduled_tokens={"a": 7}, total_num_scheduled_tokens=7, step_id=1),
        # a step the worker cannot run: it answers with an error and the stream goes on
        SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["ghost"], [False], [[]], [1], [[]]),
                        num_scheduled_tokens={"ghost": 1}, total_num_scheduled_tokens=1, step_id=2),
        SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [False], [[9]], [7], [[]]),
                        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, step_id=3),
        # the last step's requests again, each count the last plus what it was scheduled: sent without
        # ids or counts, and the runner still gets the scheduler's count
        SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [8], [[]]),
                        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, step_id=4),
    ]
    encoder = worker_codec.StepEncoder()
    messages = [encoder.encode(s) for s in steps]
    assert messages[3].scheduled_cached_reqs.req_ids_as_last_step
    assert not messages[3].scheduled_cached_reqs.req_ids and not messages[3].scheduled_cached_reqs.num_computed_tokens
    requests = (worker_pb2.ExecuteModelRequest(scheduler_output=m) for m in messages)
    responses = list(stub.ExecuteModel(requests, timeout=60))
    assert len(responses) == 4
    first, failed, third, fourth = responses
    assert not first.error_message and failed.error_message and "ghost" in failed.error_message
    assert not third.error_message and not fourth.error_message, fourth.error_message
    assert failed.model_runner_output.step_id == 2
    assert first.model_runner_output.req_ids_as_scheduled and not first.model_runner_output.req_ids
    assert [so.step_id for so in seen] == [1, 2, 3, 4]
    assert seen[3].scheduled_cached_reqs.req_ids == ["a"] and seen[3].scheduled_cached_reqs.num_computed_tokens == [8]
    out1 = encoder.decode_output(first)
    with pytest.raises(worker_codec.StepFailed, match="ghost"):
        encoder.decode_output(failed)
    out3, out4 = encoder.decode_output(third), encoder.decode_output(fourth)
    assert out1.req_ids == ["a"] and out1.step_id == 1
    assert out3.req_ids == ["a"] and out4.req_ids == ["a"] and out4.step_id == 4
    assert [out1.sampled_token_ids[0][0], out3.sampled_token_ids[0][0], out4.sampled_token_ids[0][0]] == expected
    assert out1.logprobs[0].rank == 1 and len(out1.logprobs[0].top_logprobs) == 2


def test_a_step_sent_against_a_failed_step_is_refused_not_run(stub, server, monkeypatch):
    stub, _ = stub
    stub.InitializeKVCache(worker_pb2.InitializeKVCacheRequest(num_blocks=64))
    ran, execute = [], server.worker.execute_model

    def run_or_fail(so):
        ran.append(so.step_id)
        if so.step_id == 2:
            raise RuntimeError("injected failure")
        return execute(so)

    monkeypatch.setattr(server.worker, "execute_model", run_or_fail)
    greedy = SamplingParams(temperature=0.0)
    decode = lambda step_id, num_computed: SchedulerOutput(  # noqa: E731
        scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [num_computed], [[]]),
        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, step_id=step_id)
    # The scheduler's end, as async scheduling drives it: step 3 goes out before step 2's answer is read.
    encoder = worker_codec.StepEncoder()
    outgoing: queue.Queue = queue.Queue()
    messages = [encoder.encode(SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", [5, 6, 7], greedy, [3], 0)],
                                               num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3, step_id=1)),
                encoder.encode(decode(2, 3)),  # fails on the worker
                encoder.encode(decode(3, 4))]  # already on its way, sent against step 2
    for m in messages:
        outgoing.put(m)

    def requests():
        for _ in range(4):
            yield worker_pb2.ExecuteModelRequest(scheduler_output=outgoing.get(timeout=60))

    responses = stub.ExecuteModel(requests(), timeout=60)
    out1 = encoder.decode_output(next(responses))
    assert out1.req_ids == ["a"] and len(out1.sampled_token_ids[0]) == 1
    with pytest.raises(worker_codec.StepFailed, match="injected failure"):
        encoder.decode_output(next(responses))
    with pytest.raises(worker_codec.StepFailed, match="last step"):
        encoder.decode_output(next(responses))
    # Told of the failure, the scheduler's end sends the next step in full: its count sets the worker's again.
    messages.append(encoder.encode(decode(4, 3)))
    outgoing.put(messages[-1])
    out4 = encoder.decode_output(next(responses))
    assert [m.scheduled_cached_reqs.req_ids_as_last_step for m in messages] == [False, True, True, False]
    assert out4.req_ids == ["a"] and len(out4.sampled_token_ids[0]) == 1 and out4.step_id == 4
    assert ran == [1, 2, 4]  # step 3 never reached the runner
    assert list(responses) == []


def test_worker_process_starts_serves_and_stops_on_sigterm(tiny_llama_dir, tmp_path):
    env = dict(os.environ, SPINDLE_WORKER_ADDR="127.0.0.1:0", SPINDLE_KV_CACHE_BYTES="1MiB",
               SPINDLE_BLOCK_SIZE="4", SPINDLE_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "services.worker", "--model", str(tiny_llama_dir)],
                            cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "worker ready on" in line:
                break
        ready = [l for l in lines if "worker ready on" in l]
        assert ready, "".join(lines)
        # --dtype auto: bfloat16 where the CPU multiplies it natively, else float32.
        expected_dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
        assert f"dtype {expected_dtype}" in ready[0] and "KV blocks" in ready[0]
        address = ready[0].split("worker ready on ")[1].split()[0]
        with grpc.insecure_channel(address) as channel:
            spec = worker_pb2_grpc.WorkerServiceStub(channel).DescribeKVCache(worker_pb2.DescribeKVCacheRequest())
            assert spec.model_name == tiny_llama_dir.name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_cuda_device_is_refused_clearly_without_a_gpu(capsys):
    import torch

    from services.worker.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_consecutive_failed_steps_break_the_worker_until_it_restarts(tiny_llama_dir):
    """A sticky fault fails every step: after --worker-max-consecutive-failed-steps in a row the
    stream ends UNAVAILABLE, health turns NOT_SERVING and every new call is refused; a success in
    between resets the count, and a step refused for being sent against a failed one does not count."""
    config = WorkerConfig(worker_addr="127.0.0.1:0", model=str(tiny_llama_dir), served_model_name="tiny",
                          dtype="float32", kv_cache_bytes=2**20, block_size=4, max_num_seqs=8,
                          max_consecutive_failed_steps=2)
    srv = InProcessServer(config)
    server = srv.server
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            stub.InitializeKVCache(worker_pb2.InitializeKVCacheRequest(num_blocks=64))
            fail_steps = {1, 3, 4}
            execute = server.worker.execute_model

            def run_or_fail(so):
                if so.step_id in fail_steps:
                    raise RuntimeError("device fault")
                return execute(so)

            server.worker.execute_model = run_or_fail
            greedy = SamplingParams(temperature=0.0)
            steps = [SchedulerOutput(scheduled_new_reqs=[NewRequestData(f"r{i}", [5, 6, 7], greedy, [3 + i], 0)],
                                     num_scheduled_tokens={f"r{i}": 3}, total_num_scheduled_tokens=3, step_id=i)
                     for i in range(1, 6)]
            outgoing: queue.Queue = queue.Queue()

            def requests():
                while True:
                    item = outgoing.get(timeout=60)
                    if item is None:
                        return
                    yield worker_pb2.ExecuteModelRequest(scheduler_output=item)

            responses = stub.ExecuteModel(requests(), timeout=60)
            answers = []
            for step in steps[:4]:  # fails, runs, fails, fails: the second failure in a row breaks it
                outgoing.put(worker_codec.scheduler_output_to_pb(step))
                answers.append(next(responses).error_message)
            assert [bool(a) for a in answers] == [True, False, True, True]
            with pytest.raises(grpc.RpcError) as ended:
                next(responses)
            outgoing.put(None)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "2 steps failed in a row" in ended.value.details()
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                stub.DescribeKVCache(worker_pb2.DescribeKVCacheRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "needs a restart" in refused.value.details()
    finally:
        srv.close()
