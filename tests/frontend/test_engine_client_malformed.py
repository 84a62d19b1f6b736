"""A malformed message from the scheduler (one the outputs decoder refuses) ends the frontend's
in-flight requests with a clear error and the client reconnects; it must not leave them waiting."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.messages import EngineCoreRequest, SamplingParams
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.frontend.engine_client import EngineClient
from services.frontend.errors import EngineError


class MalformedScheduler(engine_core_pb2_grpc.EngineCoreServiceServicer):
    """Answers the first stream's first request with outputs whose columns do not match; later
    streams are served properly."""

    def __init__(self):
        self.num_connects = 0

    async def GetEngineInfo(self, request, context):
        return engine_core_pb2.GetEngineInfoResponse(model_name="m", max_model_len=64, block_size=16,
                                                     num_blocks=8, vocab_size=100)

    async def GetStats(self, request, context):
        return engine_core_pb2.GetStatsResponse(is_worker_alive=True)

    async def Connect(self, request_iterator, context):
        self.num_connects += 1
        async for message in request_iterator:
            if message.WhichOneof("kind") != "add_request":
                continue
            request_id = message.add_request.request_id
            if self.num_connects == 1:  # an id and no token list for it
                yield engine_core_pb2.ConnectResponse(outputs=engine_core_pb2.EngineCoreOutputs(
                    request_ids=[request_id], num_new_token_ids=[2], new_token_ids=[5]))
            else:
                yield engine_core_pb2.ConnectResponse(outputs=engine_core_pb2.EngineCoreOutputs(
                    outputs=[engine_core_pb2.EngineCoreOutput(request_id=request_id, new_token_ids=[7],
                                                              finish_reason=engine_core_pb2.FINISH_REASON_LENGTH)]))


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1), 0.0)


async def _wait_ready(client: EngineClient, timeout_s: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not client.is_ready:
        assert asyncio.get_running_loop().time() < deadline, "the client never connected"
        await asyncio.sleep(0.02)


def test_a_malformed_message_fails_the_requests_and_the_client_reconnects():
    async def scenario():
        servicer = MalformedScheduler()
        server = grpc.aio.server()
        engine_core_pb2_grpc.add_EngineCoreServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = EngineClient(f"127.0.0.1:{port}")
        await client.start()
        try:
            await _wait_ready(client)
            with pytest.raises(EngineError) as failed:
                async with asyncio.timeout(20):  # before the fix: waits for ever
                    async for _ in client.generate(_request("a")):
                        pass
            assert failed.value.code == "unavailable"
            assert "lost the scheduler" in str(failed.value) and "does not split" in str(failed.value)
            await _wait_ready(client)
            async with asyncio.timeout(20):
                outputs = [o async for o in client.generate(_request("b"))]
            assert [o.new_token_ids for o in outputs] == [[7]] and servicer.num_connects == 2
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(scenario())
