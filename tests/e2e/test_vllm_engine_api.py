"""vLLM's engine gRPC protocol (`vllm.grpc.engine.VllmEngine`) end to end on the embedded default
model, with a client built from the `smg-grpc-proto` stubs alone, as a gateway would build one.

Generate gives the HTTP API's greedy tokens, streamed or not; n, stop strings, EOS and max_tokens
end choices as the protocol describes; a cancelled call and an Abort both free every KV block;
GetTokenizer's ZIP rebuilds the served tokenizer; SubscribeKvEvents reports a prompt's full blocks
with their tokens, chained, and FlushCache clears them; the info calls describe the model and the
engine; fields this engine cannot honour are refused naming the field.
"""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc
from transformers import AutoTokenizer

from services.common.model_files import resolve_model
from tests.e2e.cluster import module_cluster
from tests.e2e.openai_calls import EOS, get_json, post_json
from tests.e2e.test_default_model import MAX_TOKENS, PROMPTS
from tests.frontend.bad_inputs import param_of_grpc_details

MODEL = "SmolLM2-135M-Instruct"
LONG = dict(max_tokens=1000, ignore_eos=True)  # runs until cancelled or aborted
# About 300 tokens of text no other test sends, so its blocks start out uncached.
KV_EVENTS_TEXT = " ".join(f"Lighthouse {i} keeps watch over the quiet harbour of Ardmore." for i in range(30))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.engine_grpc_addr) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(None, None).path)


@pytest.fixture(scope="module")
def block_size(stub) -> int:
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).block_size


def generate_request(input_ids: list[int], stream: bool = False, request_id: str = "", **params) -> pb.GenerateRequest:
    """Greedy unless `params` say otherwise: the model's defaults (temperature 0.2) would sample."""
    params.setdefault("temperature", 0.0)
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=input_ids),
                              sampling_params=pb.SamplingParams(**params), stream=stream)


def generate(stub, input_ids: list[int], stream: bool = False, **params) -> list[pb.GenerateResponse]:
    return list(stub.Generate(generate_request(input_ids, stream, **params), timeout=120))


def split(responses: list[pb.GenerateResponse]) -> tuple[list[pb.GenerateStreamChunk], list[pb.GenerateComplete]]:
    """The chunks, then the completes; every complete comes after every chunk of its choice."""
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert len(chunks) + len(completes) == len(responses)
    return chunks, completes


def only_complete(responses: list[pb.GenerateResponse]) -> pb.GenerateComplete:
    chunks, completes = split(responses)
    assert chunks == [] and len(completes) == 1 and completes[0].index == 0, responses
    return completes[0]


def chat_prompt_ids(cluster, text: str) -> list[int]:
    status, body = post_json(cluster, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": text}]})
    assert status == 200, body
    return body["tokens"]


def http_token_ids(cluster, prompt_ids: list[int], **fields) -> dict:
    status, body = post_json(cluster, "/v1/completions", {"model": MODEL, "prompt": prompt_ids, "temperature": 0,
                                                         "return_token_ids": True, **fields})
    assert status == 200, body
    return body["choices"][0]


def assert_all_blocks_free(cluster) -> None:
    idle = cluster.wait_for_idle(timeout_s=60)
    assert idle["num_free_blocks"] == idle["num_total_blocks"], idle


# --- Generate --------------------------------------------------------------------------------------
def test_greedy_tokens_match_the_http_api_streamed_or_not(cluster, stub):
    prompts = [chat_prompt_ids(cluster, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(prompts) * 3) as pool:  # all at once, so the engine batches them
        http = [pool.submit(http_token_ids, cluster, ids, max_tokens=MAX_TOKENS) for ids in prompts]
        unstreamed = [pool.submit(generate, stub, ids, max_tokens=MAX_TOKENS) for ids in prompts]
        streamed = [pool.submit(generate, stub, ids, True, max_tokens=MAX_TOKENS) for ids in prompts]
    for prompt, ids, h, u, s in zip(PROMPTS, prompts, http, unstreamed, streamed):
        expected = h.result()
        complete = only_complete(u.result())
        assert list(complete.output_ids) == expected["token_ids"], prompt
        assert complete.finish_reason == expected["finish_reason"], prompt
        assert (complete.prompt_tokens, complete.completion_tokens) == (len(ids), len(complete.output_ids))

        chunks, completes = split(s.result())
        assert len(completes) == 1 and completes[0].index == 0
        assert [c.index for c in chunks] == [0] * len(chunks)
        joined = [t for c in chunks for t in c.token_ids]
        assert joined == list(completes[0].output_ids) == expected["token_ids"], prompt
        # Each chunk counts the choice's tokens so far.
        assert [c.completion_tokens for c in chunks] == [sum(len(x.token_ids) for x in chunks[:i + 1])
                                                         for i in range(len(chunks))]
        assert {c.prompt_tokens for c in chunks} == {len(ids)}
        assert completes[0].finish_reason == expected["finish_reason"]


def test_n_with_a_seed_gives_a_complete_per_choice_streamed_or_not(cluster, stub):
    ids = chat_prompt_ids(cluster, "Write a short poem about rain.")
    sampling = dict(n=2, seed=1234, temperature=1.0, max_tokens=12)
    chunks, completes = split(generate(stub, ids, **sampling))
    assert chunks == [] and sorted(c.index for c in completes) == [0, 1]
    outputs = {c.index: list(c.output_ids) for c in completes}
    assert outputs[0] != outputs[1]  # each choice samples on its own

    chunks, completes = split(generate(stub, ids, True, **sampling))
    assert sorted(c.index for c in completes) == [0, 1]
    for complete in completes:
        assert [t for c in chunks if c.index == complete.index for t in c.token_ids] == list(complete.output_ids)
        assert list(complete.output_ids) == outputs[complete.index]  # the seed decides the tokens
        assert complete.finish_reason in ("stop", "length") and complete.completion_tokens <= 12


def test_stop_string_eos_and_max_tokens_end_choices(cluster, stub, tokenizer):
    ids = chat_prompt_ids(cluster, PROMPTS[1])
    free = only_complete(generate(stub, ids, max_tokens=16))
    assert free.finish_reason == "length" and len(free.output_ids) == 16
    assert free.WhichOneof("matched_stop") is None

    text = tokenizer.decode(free.output_ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = only_complete(generate(stub, ids, max_tokens=16, stop=[stop]))
    assert stopped.finish_reason == "stop" and stopped.matched_stop_str == stop
    expected = http_token_ids(cluster, ids, max_tokens=16, stop=[stop])
    assert expected["text"] == text[:text.index(stop)]
    assert list(stopped.output_ids) == expected["token_ids"]

    ended = only_complete(generate(stub, chat_prompt_ids(cluster, "Say hello."), max_tokens=200))
    assert ended.finish_reason == "stop" and ended.WhichOneof("matched_stop") == "matched_token_id"
    assert ended.matched_token_id == EOS and ended.output_ids[-1] == EOS


def test_cancelled_and_aborted_calls_free_every_block(cluster, stub):
    ids = chat_prompt_ids(cluster, PROMPTS[0])
    cancelled = stub.Generate(generate_request(ids, True, request_id="vllm-e2e-cancel", **LONG), timeout=300)
    aborted = stub.Generate(generate_request(ids, True, request_id="vllm-e2e-abort", **LONG), timeout=300)
    # A chunk from each: both requests run in the engine.
    assert next(cancelled).WhichOneof("response") == "chunk"
    assert next(aborted).WhichOneof("response") == "chunk"
    running = get_json(cluster, "/stats")
    assert running["num_free_blocks"] < running["num_total_blocks"], running

    cancelled.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(cancelled)
    assert info.value.code() == grpc.StatusCode.CANCELLED

    stub.Abort(pb.AbortRequest(request_ids=["vllm-e2e-abort"]), timeout=10)
    chunks, completes = split(list(aborted))  # the call ends OK, with the choice's complete
    assert len(completes) == 1 and completes[0].finish_reason == "abort"
    assert completes[0].WhichOneof("matched_stop") is None
    assert 0 < len(completes[0].output_ids) < LONG["max_tokens"]
    assert_all_blocks_free(cluster)


# --- tokenizer, model and engine -------------------------------------------------------------------
def test_get_tokenizer_zip_rebuilds_the_served_tokenizer(stub, tokenizer, tmp_path):
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(c.sha256 == "" for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path)
    assert "tokenizer.json" in names and not any(n.endswith((".safetensors", ".bin", ".gguf")) for n in names)
    rebuilt = AutoTokenizer.from_pretrained(tmp_path)
    sentence = "The lighthouse keeper counted 12 ships — and one café — before dawn."
    assert rebuilt.encode(sentence) == tokenizer.encode(sentence)
    messages = [{"role": "user", "content": sentence}]
    assert (rebuilt.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_health_model_server_info_and_loads(cluster, stub, tokenizer, block_size):
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
    assert health.healthy, health.message

    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.served_model_name, info.max_context_length, info.vocab_size) == (MODEL, 2048, 49152)
    assert list(info.eos_token_ids) == [EOS] and info.is_generation and not info.supports_vision
    assert info.model_path == str(resolve_model(None, None).path)
    assert info.max_req_input_len == 2047 and info.model_type == "llama"
    assert json.loads(info.default_sampling_params_json) == {"temperature": 0.2, "top_p": 0.9}

    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert block_size == 16 and server.data_parallel_size == 1 and server.max_num_seqs == 256
    assert server.model_dtype == "float32" and server.attention_backend == cluster.attention_backend

    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1
    load = loads.loads[0]
    stats = get_json(cluster, "/stats")
    assert load.dp_rank == 0 and load.max_total_num_tokens == stats["num_total_blocks"] * block_size
    assert load.max_running_requests == 256  # the scheduler's --max-num-seqs


# --- prefix-cache events ---------------------------------------------------------------------------
def test_kv_events_report_a_prompts_blocks_and_flush_clears_them(stub, tokenizer, block_size):
    prompt = tokenizer.encode(KV_EVENTS_TEXT)[:300]
    assert len(prompt) == 300
    num_full_blocks = len(prompt) // block_size
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=120)
    try:
        first = next(events)
        assert [e.WhichOneof("data") for e in first.events] == ["cleared"]

        sent = only_complete(generate(stub, prompt, max_tokens=1))
        assert sent.cached_tokens == 0
        stored: list[common_pb2.KvBlocksStored] = []
        while sum(len(s.blocks) for s in stored) < num_full_blocks:
            batch = next(events)
            assert batch.sequence_number > first.sequence_number
            stored += [e.stored for e in batch.events if e.WhichOneof("data") == "stored"]
        blocks = [b for s in stored for b in s.blocks]
        assert len(blocks) == num_full_blocks  # the prompt's last, partial block is not cached
        assert [t for b in blocks for t in b.token_ids] == prompt[:num_full_blocks * block_size]
        assert {b.block_size for b in blocks} == {block_size}
        assert not stored[0].HasField("parent_block_hash")  # the prompt's first block
        for before, after in zip(stored, stored[1:]):
            assert after.parent_block_hash == before.blocks[-1].block_hash
        assert len({b.block_hash for b in blocks}) == num_full_blocks

        again = only_complete(generate(stub, prompt, max_tokens=1))
        assert again.cached_tokens == num_full_blocks * block_size

        flushed = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30), timeout=60)
        assert flushed.success, flushed.message
        while not any(e.WhichOneof("data") == "cleared" for e in next(events).events):
            pass
        after_flush = only_complete(generate(stub, prompt, max_tokens=1))
        assert after_flush.cached_tokens == 0
    finally:
        events.cancel()


# --- refusals and constraints ----------------------------------------------------------------------
REFUSED = {
    "mm_inputs": lambda r: r.mm_inputs.SetInParent(),
    "sampling_params.prompt_logprobs": lambda r: setattr(r.sampling_params, "prompt_logprobs", 1),
    "data_parallel_rank": lambda r: setattr(r, "data_parallel_rank", 1),
    "sampling_params.regex": lambda r: setattr(r.sampling_params, "regex", "(unclosed"),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refusals_are_invalid_argument_naming_the_field(stub, field):
    request = generate_request([1, 2, 3], max_tokens=4)
    REFUSED[field](request)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert param_of_grpc_details(info.value.details()) == field, info.value.details()


def test_json_schema_constraint_returns_a_matching_object(cluster, stub, tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    ids = chat_prompt_ids(cluster, "Is Paris a capital? Answer as JSON.")
    complete = only_complete(generate(stub, ids, max_tokens=60, json_schema=json.dumps(schema)))
    assert complete.finish_reason == "stop", complete
    value = json.loads(tokenizer.decode(complete.output_ids, skip_special_tokens=True))
    jsonschema.validate(value, schema)
