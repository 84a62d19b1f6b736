"""GenerateService over a real grpc.aio server, backed by the fake engine."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest

from services.common.grpc_server import GrpcServer
from services.common.pb import generate_pb2, generate_pb2_grpc
from services.frontend.errors import EngineError
from services.frontend.grpc_service import SERVICE_NAME, GenerateServicer
from services.frontend.serving_engine import OpenAIServing, ServerState
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model, wait_until

STOP = generate_pb2.GenerateResponse.FINISH_REASON_STOP
UNSPECIFIED = generate_pb2.GenerateResponse.FINISH_REASON_UNSPECIFIED


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
    return generate_pb2.GenerateRequest(sampling_params=generate_pb2.GenerateRequest.SamplingParams(**params), **fields)


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
    assert responses[-1].finish_reason == STOP
    assert all(r.finish_reason == UNSPECIFIED for r in responses[:-1])
    assert responses[-1].num_completion_tokens == len(engine.reply_token_ids) + 1
    assert [t for r in responses for t in r.token_ids] == engine.reply_token_ids + [make_tokenizer().eos_token_id]
    assert engine.requests[0].request_id != "mine"  # the engine's id is always the frontend's own


def test_token_ids_input_and_default_max_tokens():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.", max_model_len=64)
    token_ids = generate_pb2.GenerateRequest.TokenIds(token_ids=[5, 6, 7])
    responses = _call(engine, generate_pb2.GenerateRequest(token_ids=token_ids))
    assert engine.requests[0].prompt_token_ids == [5, 6, 7]
    assert engine.requests[0].sampling_params.max_tokens == 64 - 3
    assert responses[-1].num_prompt_tokens == 3


def test_stop_string_finishes_with_stop_and_aborts():
    engine = FakeEngineClient(make_tokenizer(), "Hello world. The capital")
    responses = _call(engine, _request(text="x", stop=["."]))
    assert "".join(r.text for r in responses) == "Hello world"
    assert responses[-1].finish_reason == STOP
    assert engine.aborted == [engine.requests[0].request_id]


def _status_of(engine: FakeEngineClient, request: generate_pb2.GenerateRequest) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _call(engine, request)
    return info.value.code()


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
            await wait_until(lambda: engine.aborted, "the request aborted")
            return engine, list(engine.aborted)

    engine, aborted = asyncio.run(scenario())
    assert aborted == [engine.requests[0].request_id]


def test_n_choices_are_indexed_and_logprobs_travel_as_ids():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    responses = _call(engine, _request(text="x", params={"n": 2, "logprobs": 2, "max_tokens": 50}))
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert "".join(r.text for r in mine) == "Hello world."
        assert mine[-1].finish_reason == STOP
        for r in mine:
            assert len(r.logprobs) == len(r.token_ids)
            for lp, t in zip(r.logprobs, r.token_ids):  # the fake's: t at -0.25 (rank 1), then t + 1
                assert (lp.logprob, lp.rank) == (-0.25, 1)
                assert [(x.token_id, x.logprob) for x in lp.top_logprobs] == [(t, -0.25), (t + 1, -1.25)]
    assert len({r.request_id for r in responses}) == 1


def test_tokenize_and_model_info():
    tokenizer = make_tokenizer()

    async def scenario():
        engine = FakeEngineClient(tokenizer)
        async with grpc_stub(engine) as stub:
            tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello world."))
            raw = await stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello world.", add_special_tokens=False))
            info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
            engine.is_ready = False
            with pytest.raises(grpc.aio.AioRpcError) as not_ready:
                await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
            return tokens, raw, info, not_ready.value.code()

    tokens, raw, info, not_ready = asyncio.run(scenario())
    assert list(tokens.token_ids) == tokenizer.encode("Hello world.")
    assert list(raw.token_ids) == tokenizer.encode("Hello world.", add_special_tokens=False)
    assert list(tokens.tokens) == tokenizer.convert_ids_to_tokens(list(tokens.token_ids))
    assert tokens.max_model_len == 256
    assert (info.model_name, info.max_model_len, info.vocab_size) == ("fake-model", 256, len(tokenizer))
    assert (info.block_size, info.device, info.dtype) == (16, "cpu", "float32")
    assert list(info.eos_token_ids) == [tokenizer.eos_token_id]
    assert not_ready == grpc.StatusCode.UNAVAILABLE


def test_abort_cancels_the_call_and_aborts_every_choice():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.01)
        async with grpc_stub(engine) as stub:
            call = stub.Generate(_request(request_id="job-1", text="x", params={"n": 2}))
            first = await call.read()
            await stub.Abort(generate_pb2.AbortRequest(request_id="job-1"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while True:
                    if await call.read() is grpc.aio.EOF:
                        break
            with pytest.raises(grpc.aio.AioRpcError) as again:  # the id is free once the call ended
                await stub.Abort(generate_pb2.AbortRequest(request_id="job-1"))
            return engine, first, info.value.code(), again.value.code()

    engine, first, code, again = asyncio.run(scenario())
    assert first.request_id == "job-1"
    assert code == grpc.StatusCode.CANCELLED and again == grpc.StatusCode.NOT_FOUND
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests) and len(engine.requests) == 2


def test_duplicate_running_request_id_is_refused():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.01)
        async with grpc_stub(engine) as stub:
            call = stub.Generate(_request(request_id="same", text="x"))
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(_request(request_id="same", text="y"))]
            call.cancel()
            return info.value.code()

    assert asyncio.run(scenario()) == grpc.StatusCode.INVALID_ARGUMENT
