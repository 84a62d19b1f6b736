"""GenerateService over a real grpc.aio server, backed by the fake engine."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest

from services.common.grpc_server import GrpcServer
from services.common.messages import FinishReason
from services.common.pb import engine_core_pb2, generate_pb2, generate_pb2_grpc
from services.frontend.errors import EngineError
from services.frontend.grpc_service import SERVICE_NAME, GenerateServicer
from services.frontend.serving_engine import OpenAIServing, ServerState
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model


@asynccontextmanager
async def grpc_stub(engine: FakeEngineClient):
    server = GrpcServer("127.0.0.1:0", [SERVICE_NAME])
    serving = OpenAIServing(engine, serving_model(engine.tokenizer), ServerState())
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(serving), server.server)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield generate_pb2_grpc.GenerateServiceStub(channel)
    finally:
        await server.stop(0)


def _request(**fields) -> generate_pb2.GenerateRequest:
    params = fields.pop("params", {})
    return generate_pb2.GenerateRequest(sampling_params=engine_core_pb2.SamplingParams(**params), **fields)


def _call(engine: FakeEngineClient, request: generate_pb2.GenerateRequest):
    async def scenario():
        async with grpc_stub(engine) as stub:
            return [r async for r in stub.Generate(request)]

    return asyncio.run(scenario())


@pytest.mark.parametrize("reply", ["Hello world.", "日本語 😀😀 café"])
def test_text_input_streams_text_and_finishes(reply):
    engine = FakeEngineClient(make_tokenizer(), reply)
    responses = _call(engine, _request(request_id="mine", text="Say hello", stop=["zzz"], params={"max_tokens": 50}))
    assert "".join(r.text for r in responses) == reply
    assert all(r.request_id == "mine" for r in responses)
    assert responses[-1].finish_reason == FinishReason.STOP
    assert all(r.finish_reason == 0 for r in responses[:-1])
    assert responses[-1].num_completion_tokens == len(engine.reply_token_ids) + 1
    assert [t for r in responses for t in r.token_ids] == engine.reply_token_ids + [make_tokenizer().eos_token_id]
    assert engine.requests[0].request_id != "mine"  # the engine's id is always the frontend's own


def test_token_ids_input_and_default_max_tokens():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.", max_model_len=64)
    responses = _call(engine, generate_pb2.GenerateRequest(token_ids=engine_core_pb2.TokenIds(token_ids=[5, 6, 7])))
    assert engine.requests[0].prompt_token_ids == [5, 6, 7]
    assert engine.requests[0].sampling_params.max_tokens == 64 - 3
    assert responses[-1].num_prompt_tokens == 3


def test_stop_string_finishes_with_stop_and_aborts():
    engine = FakeEngineClient(make_tokenizer(), "Hello world. The capital")
    responses = _call(engine, _request(text="x", stop=["."]))
    assert "".join(r.text for r in responses) == "Hello world"
    assert responses[-1].finish_reason == FinishReason.STOP
    assert engine.aborted == [engine.requests[0].request_id]


def _status_of(engine: FakeEngineClient, request: generate_pb2.GenerateRequest) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _call(engine, request)
    return info.value.code()


@pytest.mark.parametrize("request_, code", [
    (generate_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(text=""), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(text="x", params={"temperature": 3.0}), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(text="x", params={"max_tokens": -1}), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(text="x", params={"max_tokens": 10_000}), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(text="x", params={"n": 2}), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(text="x", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(token_ids=engine_core_pb2.TokenIds(token_ids=[10**6])), grpc.StatusCode.INVALID_ARGUMENT),
    (_request(text="x", model="other"), grpc.StatusCode.NOT_FOUND),
])
def test_bad_requests(request_, code):
    assert _status_of(FakeEngineClient(make_tokenizer()), request_) == code


@pytest.mark.parametrize("configure, code", [
    (lambda e: setattr(e, "is_ready", False), grpc.StatusCode.UNAVAILABLE),
    (lambda e: setattr(e, "refuse", EngineError("full", "resource_exhausted")), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (lambda e: setattr(e, "refuse", EngineError("gone", "unavailable")), grpc.StatusCode.UNAVAILABLE),
    (lambda e: setattr(e, "error_after", 2), grpc.StatusCode.INTERNAL),
])
def test_engine_states_map_to_status_codes(configure, code):
    engine = FakeEngineClient(make_tokenizer())
    configure(engine)
    assert _status_of(engine, _request(text="x")) == code


def test_client_cancel_aborts_the_request():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.01)
        async with grpc_stub(engine) as stub:
            call = stub.Generate(_request(text="x"))
            await call.read()
            call.cancel()
            for _ in range(200):
                if engine.aborted:
                    break
                await asyncio.sleep(0.01)
            return engine, list(engine.aborted)

    engine, aborted = asyncio.run(scenario())
    assert aborted == [engine.requests[0].request_id]
