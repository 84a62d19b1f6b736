"""The engine client hands over from a draining engine to a ready one: unready at once, the
draining engine's requests finish on the old stream, new requests wait for the new engine, and a
request the draining engine refused at the door is sent again there, with no error.

Two in-process schedulers stand behind a TCP proxy that plays a Kubernetes Service
(tests/service_proxy.py)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common import codec
from services.common.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    SamplingParams,
    SchedulerStats,
)
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.frontend.engine_client import EngineClient
from services.frontend.errors import EngineError
from tests.service_proxy import ServiceProxy
from tests.step_outputs import outputs_from

INFO = EngineInfo(model_name="m", max_model_len=64, block_size=16, num_blocks=8, device="cpu", dtype="float32",
                  vocab_size=100, attention_backend="none")
DEADLINE_S = 20.0


class FakeScheduler(engine_core_pb2_grpc.EngineCoreServiceServicer):
    """Answers a request at once with one finished token (`auto_reply`), or when the test emits."""

    def __init__(self, name: str, auto_reply: bool):
        self.name, self.auto_reply = name, auto_reply
        self.is_draining = False
        self.received: list[str] = []  # requests it took
        self.refused: list[str] = []  # requests it refused because it drains
        self._streams: list[asyncio.Queue] = []
        self._stream_of: dict[str, asyncio.Queue] = {}
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = grpc.aio.server()
        engine_core_pb2_grpc.add_EngineCoreServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    def drain(self, notify: bool) -> None:
        self.is_draining = True
        if notify:
            for stream in self._streams:
                stream.put_nowait(engine_core_pb2.ConnectResponse(draining=True))

    def emit(self, request_id: str, token_ids: list[int], finish: FinishReason = FinishReason.NONE) -> None:
        self._send(self._stream_of[request_id], EngineCoreOutput(request_id, token_ids, finish_reason=finish))

    def _send(self, stream: asyncio.Queue, output: EngineCoreOutput) -> None:
        stream.put_nowait(outputs_from([output]))

    async def GetEngineInfo(self, request, context):
        if self.is_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is draining")
        return codec.engine_info_to_pb(INFO)

    async def GetStats(self, request, context):
        return engine_core_pb2.GetStatsResponse(scheduler_stats=codec.scheduler_stats_to_pb(SchedulerStats()),
                                                is_worker_alive=True, is_draining=self.is_draining)

    async def Connect(self, request_iterator, context):
        stream: asyncio.Queue = asyncio.Queue()
        self._streams.append(stream)
        encoder = codec.OutputsEncoder()

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("kind") != "add_request":
                    continue
                request_id = message.add_request.request_id
                if self.is_draining:
                    self.refused.append(request_id)
                    self._send(stream, EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR,
                                                        error_message="the engine is draining",
                                                        error_code="draining"))
                    continue
                self.received.append(request_id)
                self._stream_of[request_id] = stream
                if self.auto_reply:
                    self._send(stream, EngineCoreOutput(request_id, [7], finish_reason=FinishReason.LENGTH))

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await stream.get()
                if isinstance(item, engine_core_pb2.ConnectResponse):
                    yield item
                else:
                    yield engine_core_pb2.ConnectResponse(outputs=encoder.encode(item))
        finally:
            reader.cancel()


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2), 0.0)


async def _until(condition, what: str) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            await asyncio.sleep(0.01)


async def _collect(client: EngineClient, request_id: str, first: asyncio.Event | None = None) -> list[list[int]]:
    outputs = []
    async for output in client.generate(_request(request_id)):
        outputs.append(output.new_token_ids)
        if first is not None:
            first.set()
    return outputs


def _scenario(body):
    async def run():
        engine_a, engine_b = FakeScheduler("a", auto_reply=False), FakeScheduler("b", auto_reply=True)
        await engine_a.start()
        await engine_b.start()
        proxy = ServiceProxy(engine_a.port).start()
        client = EngineClient(proxy.address, max_wait_s=DEADLINE_S)
        await client.start()
        try:
            await _until(lambda: client.is_ready, "the client never connected")
            await body(client, engine_a, engine_b, proxy)
        finally:
            await client.close()
            proxy.close()
            await engine_a.server.stop(0)
            await engine_b.server.stop(0)

    asyncio.run(run())


def test_a_draining_engine_finishes_its_requests_while_new_ones_go_to_the_next_engine():
    async def body(client, engine_a, engine_b, proxy):
        turns: list[bool] = []  # what the readiness hook saw (the frontend's gRPC health follows it)
        client.on_readiness_change = lambda: turns.append(client.is_ready)
        first = asyncio.Event()
        running = asyncio.create_task(_collect(client, "running", first))
        await _until(lambda: "running" in engine_a.received, "engine a never got the request")
        engine_a.emit("running", [5])
        await asyncio.wait_for(first.wait(), DEADLINE_S)

        engine_a.drain(notify=True)
        await _until(lambda: not client.is_ready, "the client stayed ready on a draining engine")
        # Sent while the client has no ready engine: it waits, it is not refused.
        waiting = asyncio.create_task(_collect(client, "new"))
        await asyncio.sleep(0)
        assert not waiting.done()
        proxy.backend_port = engine_b.port  # the draining engine left the Service's endpoints
        assert await asyncio.wait_for(waiting, DEADLINE_S) == [[7]]
        assert client.is_ready and engine_b.received == ["new"] and engine_a.refused == []
        assert turns == [False, True]

        # The draining engine's request ends on its old stream, with every token and no error.
        assert not running.done()
        engine_a.emit("running", [6], FinishReason.LENGTH)
        assert await asyncio.wait_for(running, DEADLINE_S) == [[5], [6]]
        assert engine_a.received == ["running"]

    _scenario(body)


def test_a_request_refused_at_the_door_by_a_draining_engine_is_sent_to_the_next_one():
    async def body(client, engine_a, engine_b, proxy):
        # The refusal comes before any drain notice: the client learns of the drain from it.
        engine_a.drain(notify=False)
        proxy.backend_port = engine_b.port
        assert await asyncio.wait_for(_collect(client, "raced"), DEADLINE_S) == [[7]]
        assert engine_a.refused == ["raced"] and engine_b.received == ["raced"]

    _scenario(body)


def test_with_no_engine_to_hand_over_to_a_request_fails_unavailable_after_the_wait():
    async def body(client, engine_a, engine_b, proxy):
        client.max_wait_s = 0.5
        engine_a.drain(notify=True)
        await _until(lambda: not client.is_ready, "the client stayed ready on a draining engine")
        with pytest.raises(EngineError) as refused:
            await asyncio.wait_for(_collect(client, "late"), DEADLINE_S)
        assert (refused.value.code, str(refused.value)) == ("unavailable", "the engine is not ready")
        assert engine_a.received == [] and engine_b.received == []

    _scenario(body)
