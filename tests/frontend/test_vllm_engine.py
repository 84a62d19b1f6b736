"""vLLM's engine protocol (VllmEngine) over a real grpc.aio server, backed by the fake engine, called
with a client built from the smg-grpc-proto stubs only."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import zipfile
from contextlib import asynccontextmanager
from datetime import datetime

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from services.common.grpc_server import GrpcServer
from services.common.messages import SchedulerStats
from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.api_keys import ApiKeyInterceptor, ApiKeys
from services.frontend.app import spindle_version
from services.frontend.config import FrontendConfig
from services.frontend.errors import EngineError
from services.frontend.public_edge import EdgeConfig
from services.frontend.serving_engine import OpenAIServing, ServerState
from services.frontend.server import FrontendServer
from services.frontend.vllm_engine.codec import SamplingDefaults, generate_request_from_pb
from services.frontend.vllm_engine.servicer import SERVER_TYPE, SERVICE_NAME, VllmEngineServicer
from services.frontend.vllm_engine.tokenizer_bundle import CHUNK_BYTES, TokenizerZip
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model, wait_until

KEY, OTHER_KEY = "sk-engine-1", "sk-engine-2"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@asynccontextmanager
async def engine_stub(engine: FakeEngineClient, keys: tuple[str, ...] = (), model_dir=None, state=None):
    api_keys = ApiKeys(keys)
    server = GrpcServer("127.0.0.1:0", [SERVICE_NAME], [ApiKeyInterceptor(api_keys)])
    serving = OpenAIServing(engine, serving_model(engine.tokenizer), state or ServerState())
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(serving, api_keys, model_dir),
                                                          server.server)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield vllm_engine_pb2_grpc.VllmEngineStub(channel)
    finally:
        await server.stop(0)


def _request(text=None, input_ids=None, stream=False, **params) -> pb.GenerateRequest:
    fields = {"text": text} if text is not None else {"tokenized": pb.TokenizedInput(input_ids=input_ids or [5, 6])}
    return pb.GenerateRequest(request_id="r1", stream=stream, sampling_params=pb.SamplingParams(**params), **fields)


def _generate(engine: FakeEngineClient, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async def scenario():
        async with engine_stub(engine) as stub:
            return [r async for r in stub.Generate(request)]

    return asyncio.run(scenario())


def _split(responses):
    kinds = [r.WhichOneof("response") for r in responses]
    return [r.chunk for r in responses if r.HasField("chunk")], [r.complete for r in responses
                                                                  if r.HasField("complete")], kinds


# --- Generate ------------------------------------------------------------------------------------
def test_streamed_tokens_then_one_complete_ended_by_eos():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.", num_cached_tokens=1)
    eos = make_tokenizer().eos_token_id
    chunks, completes, kinds = _split(_generate(engine, _request(input_ids=[5, 6, 7], stream=True, max_tokens=50)))
    expected = engine.reply_token_ids + [eos]
    assert kinds == ["chunk"] * len(expected) + ["complete"]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert [c.completion_tokens for c in chunks] == list(range(1, len(expected) + 1))  # so far
    assert {(c.prompt_tokens, c.cached_tokens, c.index) for c in chunks} == {(3, 1, 0)}
    (done,) = completes
    assert list(done.output_ids) == expected and done.completion_tokens == len(expected)
    assert (done.finish_reason, done.prompt_tokens, done.cached_tokens) == ("stop", 3, 1)
    assert done.WhichOneof("matched_stop") == "matched_token_id" and done.matched_token_id == eos
    assert not done.HasField("output_logprobs")
    assert engine.requests[0].prompt_token_ids == [5, 6, 7] and engine.requests[0].request_id != "r1"


def test_text_prompt_is_tokenized_as_completions_are_and_unstreamed_gets_only_completes():
    tokenizer = make_tokenizer()
    engine = FakeEngineClient(tokenizer, "Hello world.")
    chunks, completes, _ = _split(_generate(engine, _request(text="Say hello")))
    assert engine.requests[0].prompt_token_ids == tokenizer.encode("Say hello")
    assert not chunks and len(completes) == 1
    assert list(completes[0].output_ids) == engine.reply_token_ids + [tokenizer.eos_token_id]


@pytest.mark.parametrize("stream", [True, False])
def test_n_choices_each_complete_with_its_index(stream):
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    chunks, completes, _ = _split(_generate(engine, _request(stream=stream, n=2, seed=7)))
    assert sorted(c.index for c in completes) == [0, 1]
    for c in completes:
        assert list(c.output_ids) == engine.reply_token_ids + [make_tokenizer().eos_token_id]
        if stream:
            assert [t for k in chunks if k.index == c.index for t in k.token_ids] == list(c.output_ids)
    assert sorted(r.sampling_params.seed for r in engine.requests) == [7, 8]


def test_stop_string_is_matched_stop_str_and_aborts_the_engine_request():
    engine = FakeEngineClient(make_tokenizer(), "Hello world. The capital")
    _, (done,), _ = _split(_generate(engine, _request(stream=True, stop=["."])))
    assert (done.finish_reason, done.WhichOneof("matched_stop"), done.matched_stop_str) == ("stop", "matched_stop_str",
                                                                                          ".")
    assert make_tokenizer().decode(list(done.output_ids)).startswith("Hello world.")
    assert engine.aborted == [engine.requests[0].request_id]


def test_max_tokens_finishes_with_length_and_no_matched_stop():
    engine = FakeEngineClient(make_tokenizer(), "Hello world. The capital")
    _, (done,), _ = _split(_generate(engine, _request(max_tokens=3)))
    assert (done.finish_reason, len(done.output_ids), done.WhichOneof("matched_stop")) == ("length", 3, None)


@pytest.mark.parametrize("skip_special_tokens, finish", [(False, "matched_stop_str"), (True, "matched_token_id")])
def test_skip_special_tokens_is_taken_as_given(skip_special_tokens, finish):
    tokenizer = make_tokenizer()
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    reply = tokenizer.encode("Hello", add_special_tokens=False) + [im_start] + tokenizer.encode(" world")
    engine = FakeEngineClient(tokenizer, reply_token_ids=reply)
    _, (done,), _ = _split(_generate(engine, _request(stop=["<|im_start|>"], skip_special_tokens=skip_special_tokens)))
    assert done.WhichOneof("matched_stop") == finish  # the special token's text is searched only when kept


def test_logprobs_per_chunk_and_all_of_them_on_the_complete():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    chunks, (done,), _ = _split(_generate(engine, _request(stream=True, logprobs=2)))
    pairs = [(c.output_logprobs, list(c.token_ids)) for c in chunks] + [(done.output_logprobs, list(done.output_ids))]
    for lp, ids in pairs:
        assert list(lp.token_ids) == ids and list(lp.token_logprobs) == [-0.25] * len(ids)
        for top, t in zip(lp.top_logprobs, ids):  # the fake's: t at -0.25 (rank 1), then t + 1
            assert (list(top.token_ids), list(top.values)) == ([t, t + 1], [-0.25, -1.25])
    _, (plain,), _ = _split(_generate(FakeEngineClient(make_tokenizer()), _request(logprobs=0)))
    assert len(plain.output_logprobs.token_logprobs) == len(plain.output_ids) and not plain.output_logprobs.top_logprobs


def test_sampling_params_mapping_and_defaults():
    engine = FakeEngineClient(make_tokenizer(), "Hi", max_model_len=64)
    _generate(engine, _request(input_ids=[5, 6, 7]))
    _generate(engine, _request(temperature=0.0, top_p=0.5, top_k=4, min_p=0.1, repetition_penalty=1.2, seed=3,
                               presence_penalty=0.5, frequency_penalty=-0.5, max_tokens=9, min_tokens=1,
                               stop_token_ids=[9], ignore_eos=True, logit_bias={7: 2.0}))
    unset, given = (r.sampling_params for r in engine.requests)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty, unset.n) == (1.0, 1.0, 0, 1.0, 1)
    assert unset.max_tokens == 64 - 3 and unset.seed is None and unset.logprobs is None  # the rest of the context
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty, given.seed) == (0.0, 0.5, 4,
                                                                                                 pytest.approx(1.2), 3)
    assert (given.max_tokens, given.min_tokens, given.stop_token_ids, given.ignore_eos) == (9, 1, (9,), True)
    assert given.logit_bias == {7: 2.0} and given.presence_penalty == 0.5


def test_model_sampling_defaults_fill_what_the_proto_can_tell_is_unset():
    defaults = SamplingDefaults({"temperature": 0.2, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1})
    unset = _options_from(_request(), defaults).sampling_params
    given = _options_from(_request(temperature=0.0, top_p=0.5, repetition_penalty=1.3), defaults).sampling_params
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.2, 0.9, 0, 1.1)  # top_k 0: off
    assert (given.temperature, given.top_p, given.repetition_penalty) == (0.0, 0.5, pytest.approx(1.3))
    assert json.loads(defaults.to_json()) == {"temperature": 0.2, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}


def _options_from(request: pb.GenerateRequest, defaults: SamplingDefaults):
    return generate_request_from_pb(request, defaults).options


@pytest.mark.parametrize("constraint, expected", [
    ({"regex": "[0-9]+"}, StructuredOutputsParams("regex", "[0-9]+")),
    ({"choice": pb.ChoiceConstraint(choices=["yes", "no"])}, StructuredOutputsParams("choice", '["yes", "no"]')),
    ({"json_object": True}, StructuredOutputsParams("json_object")),
    ({"json_schema": '{"type": "object"}'}, StructuredOutputsParams("json", '{"type": "object"}')),
])
def test_constraint_reaches_the_engine_request(constraint, expected):
    engine = FakeEngineClient(make_tokenizer(), "1")
    _generate(engine, _request(**constraint))
    assert engine.requests[0].sampling_params.structured_outputs == expected


@pytest.mark.parametrize("request_, field", [
    (_request(prompt_logprobs=1), "sampling_params.prompt_logprobs"),
    (_request(truncate_prompt_tokens=4), "sampling_params.truncate_prompt_tokens"),
    (_request(logprobs=-1), "sampling_params.logprobs"),
    (_request(logprobs=21), "sampling_params.logprobs"),
    (_request(temperature=3.0), "sampling_params.temperature"),
    (_request(max_tokens=0), "sampling_params.max_tokens"),
    (_request(max_tokens=1000), "sampling_params.max_tokens"),  # past the context
    (_request(stop=[""]), "sampling_params.stop"),
    (_request(regex="("), "sampling_params.regex"),  # does not compile
    (_request(choice=pb.ChoiceConstraint()), "sampling_params.choice"),
    (_request(input_ids=[10_000]), "tokenized.input_ids"),
    (_request(text=""), "text"),
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text="x", mm_inputs=pb.MultimodalInputs()), "mm_inputs"),
    (pb.GenerateRequest(text="x", extra_mm_inputs=[pb.MultimodalInputs()]), "extra_mm_inputs"),
    (pb.GenerateRequest(text="x", media_refs=pb.MediaRefs()), "media_refs"),
    (pb.GenerateRequest(text="x", kv_transfer_params=pb.KvTransferParams()), "kv_transfer_params"),
    (pb.GenerateRequest(text="x", kv_transfer_params_json="{}"), "kv_transfer_params_json"),
    (pb.GenerateRequest(text="x", data_parallel_rank=1), "data_parallel_rank"),
])
def test_refusals_are_invalid_argument_naming_the_field(request_, field):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _generate(FakeEngineClient(make_tokenizer()), request_)
    assert info.value.code() == INVALID and f"(param: {field})" in info.value.details()


@pytest.mark.parametrize("configure, code", [
    (lambda e: setattr(e, "is_ready", False), grpc.StatusCode.UNAVAILABLE),
    (lambda e: setattr(e, "refuse", EngineError("full", "resource_exhausted")), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (lambda e: setattr(e, "error_after", 2), grpc.StatusCode.INTERNAL),
])
def test_engine_states_map_to_status_codes(configure, code):
    engine = FakeEngineClient(make_tokenizer())
    configure(engine)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _generate(engine, _request(stream=True))
    assert info.value.code() == code


def test_harmless_fields_are_accepted():
    request = _request(spaces_between_special_tokens=True, grammar_from_first_token=True)
    request.data_parallel_rank = 0
    _, completes, _ = _split(_generate(FakeEngineClient(make_tokenizer()), request))
    assert completes[0].finish_reason == "stop"


def test_client_cancel_aborts_the_engine_request():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.01)
        async with engine_stub(engine) as stub:
            call = stub.Generate(_request(stream=True))
            await call.read()
            call.cancel()
            await wait_until(lambda: engine.aborted, "the request aborted")
            return engine

    engine = asyncio.run(scenario())
    assert engine.aborted == [engine.requests[0].request_id]


def test_abort_ends_only_the_callers_own_request():
    async def read_rest(call):
        rest = []
        while (response := await call.read()) is not grpc.aio.EOF:
            rest.append(response)
        return rest

    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.005)
        mine, theirs = [("authorization", f"Bearer {KEY}")], [("authorization", f"Bearer {OTHER_KEY}")]
        async with engine_stub(engine, keys=(KEY, OTHER_KEY)) as stub:
            call = stub.Generate(_request(stream=True, n=2, max_tokens=150), metadata=mine)
            await call.read()
            await stub.Abort(pb.AbortRequest(request_ids=["r1", "unknown"]), metadata=theirs)
            untouched = await read_rest(call)
            num_untouched = len(engine.requests)
            call = stub.Generate(_request(stream=True, n=2), metadata=mine)  # the id is free again
            await call.read()
            await stub.Abort(pb.AbortRequest(request_ids=["r1"]), metadata=mine)
            aborted = await read_rest(call)
            return engine, num_untouched, untouched, aborted, await call.code()

    engine, num_untouched, untouched, aborted, code = asyncio.run(scenario())
    reasons = [{r.complete.index: r.complete.finish_reason for r in rs if r.HasField("complete")}
               for rs in (untouched, aborted)]
    assert reasons == [{0: "length", 1: "length"}, {0: "abort", 1: "abort"}] and code == grpc.StatusCode.OK
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests[num_untouched:])


# --- the other calls -----------------------------------------------------------------------------
def test_api_key_required_when_keys_are_set():
    async def scenario():
        async with engine_stub(FakeEngineClient(make_tokenizer()), keys=(KEY,)) as stub:
            codes = []
            for metadata in ((), [("authorization", "Bearer sk-wrong")]):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.HealthCheck(pb.HealthCheckRequest(), metadata=metadata)
                codes.append(info.value.code())
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in stub.Generate(_request(), metadata=metadata)]
                codes.append(info.value.code())
            served = await stub.HealthCheck(pb.HealthCheckRequest(), metadata=[("authorization", f"Bearer {KEY}")])
            return codes, served.healthy

    codes, healthy = asyncio.run(scenario())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4 and healthy


def test_health_check_follows_readiness():
    async def scenario():
        engine, state = FakeEngineClient(make_tokenizer()), ServerState()
        async with engine_stub(engine, state=state) as stub:
            replies = [await stub.HealthCheck(pb.HealthCheckRequest())]
            engine.is_ready = False
            replies.append(await stub.HealthCheck(pb.HealthCheckRequest()))
            engine.is_ready, state.is_draining = True, True
            replies.append(await stub.HealthCheck(pb.HealthCheckRequest()))
            return [(r.healthy, r.message) for r in replies]

    ready, not_ready, draining = asyncio.run(scenario())
    assert ready[0] and not not_ready[0] and not draining[0]
    assert "not ready" in not_ready[1] and "shutting down" in draining[1]


def _model_dir(tmp_path):
    make_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"weights never travel")
    return tmp_path


def test_model_server_info_and_loads(tmp_path):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 50, step_delay_s=0.01)
        engine.last_stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                                           prefix_cache_queries=10, prefix_cache_hits=4, num_free_blocks=48,
                                           num_total_blocks=64)
        async with engine_stub(engine, model_dir=_model_dir(tmp_path)) as stub:
            model = await stub.GetModelInfo(pb.GetModelInfoRequest())
            idle = await stub.GetServerInfo(pb.GetServerInfoRequest())
            call = stub.Generate(_request(stream=True))
            await call.read()
            busy = await stub.GetServerInfo(pb.GetServerInfoRequest())
            call.cancel()
            loads = await stub.GetLoads(pb.GetLoadsRequest())
            engine.info = None
            with pytest.raises(grpc.aio.AioRpcError) as no_engine:
                await stub.GetModelInfo(pb.GetModelInfoRequest())
            return model, idle, busy, loads, no_engine.value.code()

    model, idle, busy, loads, no_engine = asyncio.run(scenario())
    tokenizer = make_tokenizer()
    assert (model.served_model_name, model.model_path, model.tokenizer_path) == ("fake-model", str(tmp_path), "")
    assert (model.max_context_length, model.max_req_input_len, model.vocab_size) == (256, 255, len(tokenizer))
    assert (model.model_type, list(model.architectures), model.is_generation) == ("llama", ["LlamaForCausalLM"], True)
    assert list(model.eos_token_ids) == [tokenizer.eos_token_id] and model.pad_token_id == tokenizer.pad_token_id
    assert json.loads(model.default_sampling_params_json) == {}
    assert (idle.server_type, idle.data_parallel_size, idle.block_size) == (SERVER_TYPE, 1, 16)
    assert (idle.model_dtype, idle.attention_backend, idle.is_paused) == ("float32", "none", False)
    assert idle.active_requests == 0 and idle.last_receive_timestamp == 0 and idle.uptime_seconds >= 0
    assert busy.active_requests == 1 and busy.last_receive_timestamp > 0
    (load,) = loads.loads
    assert (load.dp_rank, load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (0, 2, 1, 3)
    assert (load.num_used_tokens, load.max_total_num_tokens) == (16 * 16, 64 * 16)
    assert (load.token_usage, load.cache_hit_rate) == (0.25, pytest.approx(0.4))
    assert (loads.version, loads.dp_rank_count) == (spindle_version(), 1)
    assert datetime.fromisoformat(loads.timestamp).tzinfo is not None
    assert no_engine == grpc.StatusCode.UNAVAILABLE


def test_get_tokenizer_bundle_unzips_and_loads(tmp_path):
    from transformers import AutoTokenizer

    async def scenario(model_dir):
        async with engine_stub(FakeEngineClient(make_tokenizer()), model_dir=model_dir) as stub:
            first = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
            again = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
            return first, again

    chunks, again = asyncio.run(scenario(_model_dir(tmp_path / "model")))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    assert b"".join(c.data for c in again) == data  # built once
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "bundle")
    assert "tokenizer.json" in names and "config.json" in names and "model.safetensors" not in names
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "bundle"), local_files_only=True)
    text = "Hello world. café 😀"
    assert loaded.encode(text) == make_tokenizer().encode(text)
    assert loaded.eos_token_id == make_tokenizer().eos_token_id


def test_tokenizer_zip_chunks_carry_the_digest_on_the_last_only():
    data = bytes(range(256)) * 1000  # 256,000 bytes: 4 chunks, the last one short
    chunks = list(TokenizerZip(data, hashlib.sha256(data).hexdigest(), ()).chunks())
    assert [len(c) for c, _ in chunks] == [CHUNK_BYTES] * 3 + [len(data) - 3 * CHUNK_BYTES]
    assert [bool(s) for _, s in chunks] == [False, False, False, True] and b"".join(c for c, _ in chunks) == data


UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("call, code, words", [
    (lambda stub: stub.Embed(pb.EmbedRequest()), UNIMPLEMENTED, "Embed"),
    (lambda stub: stub.StartProfile(common_pb2.StartProfileRequest()), UNIMPLEMENTED, "Profiling"),
    (lambda stub: stub.StopProfile(common_pb2.StopProfileRequest()), UNIMPLEMENTED, "Profiling"),
    (lambda stub: stub.GetTokenizer(common_pb2.GetTokenizerRequest()).read(), grpc.StatusCode.FAILED_PRECONDITION,
     "model folder"),  # a frontend handed a tokenizer without its folder
])
def test_calls_not_served_say_so(call, code, words):
    async def scenario():
        async with engine_stub(FakeEngineClient(make_tokenizer())) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(stub)
            return info.value.code(), info.value.details()

    got, details = asyncio.run(scenario())
    assert got == code and words in details


def test_flush_cache_waits_for_idle_blocks_up_to_its_timeout():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with engine_stub(engine) as stub:
            engine.flush_refusals = 1
            now = await stub.FlushCache(common_pb2.FlushCacheRequest())  # 0: now or not at all
            engine.flush_refusals = 2
            waited = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30))
            return now, waited, engine.num_flush_calls

    now, waited, num_calls = asyncio.run(scenario())
    assert not now.success and "hold KV blocks" in now.message
    assert waited.success and num_calls == 4


def test_kv_events_stream_in_the_protocols_shape():
    from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        engine.kv_batches = [KVEventBatch(1, 10.0, [AllBlocksCleared()]),
                             KVEventBatch(2, 11.0, [BlockStored([-7, 9], 3, [1, 2, 3, 4], 2), BlockRemoved([5])])]
        async with engine_stub(engine) as stub:
            call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            batches = [await call.read(), await call.read()]
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            return batches, ended.value.code()

    (first, second), code = asyncio.run(scenario())
    assert first.sequence_number == 1 and first.events[0].HasField("cleared") and first.events[0].event_id == 1
    stored, removed = second.events
    assert (second.sequence_number, second.timestamp, stored.event_id, removed.event_id) == (2, 11.0, 2, 3)
    assert [(b.block_hash, list(b.token_ids), b.block_size) for b in stored.stored.blocks] == [
        (-7, [1, 2], 2), (9, [3, 4], 2)]
    assert stored.stored.parent_block_hash == 3 and list(removed.removed.block_hashes) == [5]
    assert code == grpc.StatusCode.UNAVAILABLE  # the engine's stream ended: the subscriber resubscribes


# --- the frontend wires it -----------------------------------------------------------------------
def test_flag_environment_and_range(monkeypatch):
    assert FrontendConfig.from_args([]).engine_grpc_port == 50055
    monkeypatch.setenv("SPINDLE_ENGINE_GRPC_PORT", "-1")
    assert FrontendConfig.from_args([]).engine_grpc_port == -1
    with pytest.raises(ValueError):
        FrontendConfig(engine_grpc_port=-2)


def test_frontend_server_serves_it_behind_the_keys_or_not_at_all():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        config = FrontendConfig(http_port=0, grpc_addr="127.0.0.1:0", shutdown_timeout_s=1,
                                edge=EdgeConfig(api_keys=(KEY,)))
        model = dataclasses.replace(serving_model(engine.tokenizer), generation_defaults={"temperature": 0.2})
        server = FrontendServer(config, engine, model)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.engine_grpc_port}") as channel:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.GetServerInfo(pb.GetServerInfoRequest())
                keyed = [("authorization", f"Bearer {KEY}")]
                info = await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=keyed)
                model_info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=keyed)
                [r async for r in stub.Generate(_request(), metadata=keyed)]
        finally:
            await server.stop()
        off = FrontendServer(FrontendConfig(http_port=0, grpc_addr="127.0.0.1:0", engine_grpc_port=-1), engine,
                             serving_model(engine.tokenizer))
        await off.start()
        await off.stop()
        return (refused.value.code(), info.server_type, model_info.default_sampling_params_json,
                engine.requests[0].sampling_params.temperature, server.engine_grpc_port, off.engine_grpc_port)

    refused, server_type, defaults_json, temperature, port, off_port = asyncio.run(scenario())
    assert refused == grpc.StatusCode.UNAUTHENTICATED and server_type == SERVER_TYPE
    assert json.loads(defaults_json) == {"temperature": 0.2} and temperature == 0.2  # the model's defaults
    assert port > 0 and off_port == 0
