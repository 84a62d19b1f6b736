"""A step that runs past --worker-step-timeout-s turns the worker's own health NOT_SERVING (so the
liveness probe restarts a worker whose model thread hangs while its event loop still answers), and
SERVING again when the step ends after all."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import worker_codec
from services.common.messages import NewRequestData, SamplingParams, SchedulerOutput
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig, config_from_args
from services.worker.step_watchdog import StepWatchdog
from tests.worker.test_server import InProcessServer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _Health:
    def __init__(self, is_ready: bool = True):
        self.calls: list[bool] = []
        self.is_ready = is_ready

    async def set_serving(self, is_serving: bool) -> None:
        self.calls.append(is_serving)


def test_an_overdue_step_flips_health_once_and_back_when_it_ends():
    health = _Health()
    watchdog = StepWatchdog(0.05, health.set_serving, lambda: health.is_ready)

    async def scenario():
        await watchdog.check()
        assert health.calls == []  # no step: nothing to say
        watchdog.step_started(7)
        await watchdog.check()
        assert health.calls == []  # running, not yet overdue
        deadline = time.monotonic() + 5
        while not watchdog.is_overdue and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            await watchdog.check()
        assert health.calls == [False] and watchdog.is_overdue
        await watchdog.check()
        assert health.calls == [False]  # said once
        watchdog.step_ended()
        await watchdog.check()
        assert health.calls == [False, True] and not watchdog.is_overdue

    asyncio.run(scenario())


def test_health_stays_down_when_the_worker_is_no_longer_ready():
    health = _Health(is_ready=False)  # e.g. draining when the overdue step ends
    watchdog = StepWatchdog(0.0, health.set_serving, lambda: health.is_ready)

    async def scenario():
        watchdog.step_started(1)
        await asyncio.sleep(0.01)
        await watchdog.check()
        watchdog.step_ended()
        await watchdog.check()

    asyncio.run(scenario())
    assert health.calls == [False]


def test_the_flag_is_shared_with_the_scheduler(monkeypatch):
    monkeypatch.setenv("SPINDLE_WORKER_STEP_TIMEOUT_S", "12.5")
    assert config_from_args([]).step_timeout_s == 12.5
    from services.scheduler.config import config_from_args as scheduler_config_from_args

    assert scheduler_config_from_args([]).worker_step_timeout_s == 12.5


@pytest.fixture
def blocking_server():
    config = WorkerConfig(worker_addr="127.0.0.1:0", fake_model=True, kv_cache_bytes=2**30, max_model_len=256,
                          step_timeout_s=0.5)
    srv = InProcessServer(config)
    srv.server.watchdog.check_interval_s = 0.1
    release = threading.Event()
    execute = srv.server.worker.execute_model

    def blocked(scheduler_output):
        release.wait(30)
        return execute(scheduler_output)

    srv.server.worker.execute_model = blocked
    yield srv.server, release
    release.set()
    srv.close()


def _status(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _wait_for(channel, status: int, timeout_s: float) -> float:
    start = time.monotonic()
    while _status(channel) != status:
        assert time.monotonic() - start < timeout_s, f"health never became {status}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_hung_step_turns_health_not_serving_over_grpc(blocking_server):
    server, release = blocking_server
    with grpc.insecure_channel(server.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        stub.InitializeKVCache(worker_pb2.InitializeKVCacheRequest(num_blocks=8))
        assert _status(channel) == SERVING
        step = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("r", [1, 2, 3], SamplingParams(max_tokens=4), [0], 0)],
            num_scheduled_tokens={"r": 3}, total_num_scheduled_tokens=3, step_id=0)
        encoder = worker_codec.StepEncoder()
        requests = iter([worker_pb2.ExecuteModelRequest(scheduler_output=encoder.encode(step))])
        call = stub.ExecuteModel(requests)
        _wait_for(channel, NOT_SERVING, timeout_s=10)  # 0.5 s timeout + 0.1 s checks, generously
        release.set()
        output = encoder.decode_output(next(call))
        assert output.req_ids == ["r"] and len(output.sampled_token_ids[0]) == 1
        _wait_for(channel, SERVING, timeout_s=10)
        call.cancel()
