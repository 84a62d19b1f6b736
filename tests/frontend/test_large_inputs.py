"""A large prompt is tokenized off the event loop: while the frontend tokenizes 5 MiB of text (the
embedded model's real tokenizer, several seconds of work), another request's stream keeps getting
tokens with no pause over a second, and /health (gRPC health on the gRPC face) answers within one.
The scripted engine serves the stream; the server and the client share one event loop, so a
stalled loop would show as a gap in both. And which work leaves the loop: small prompts and replies
are tokenized and detokenized inline, large ones on the tokenizer threads."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.messages import EngineCoreOutput, FinishReason
from services.common.model_files import eos_token_ids, resolve_model
from services.common.pb import generate_pb2
from services.frontend.serving_engine import ServingModel
from services.frontend.tokenizer import MAX_INLINE_CHARS, MAX_INLINE_TOKENS, load_tokenizer
from tests.frontend.edge_fakes import edge_client, edge_grpc, stub_at
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model

MAX_PAUSE_S = 1.0  # the bound the requirement states
LARGE_PROMPT_CHARS = 5 * 2**20
WORDS = ["hello", "world", "the", "capital", "of", "France", "is", "Paris", "日本語", "😀", "naïve"]


@pytest.fixture(scope="module")
def model() -> ServingModel:
    resolved = resolve_model(None, None)
    tokenizer = load_tokenizer(resolved.path)
    return ServingModel(resolved.name, tokenizer, eos_token_ids(resolved.path, tokenizer.eos_token_id))


def large_prompt() -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(LARGE_PROMPT_CHARS // 5))[:LARGE_PROMPT_CHARS]


def long_engine(model: ServingModel) -> FakeEngineClient:
    """A stream far longer than the tokenization takes: 4,000 tokens, one each 20 ms."""
    return FakeEngineClient(model.tokenizer, "word " * 4000, step_delay_s=0.02, max_model_len=8192)


async def _while_running(stream_arrivals: list[float], large: asyncio.Task, probe) -> tuple[float, float, list[float]]:
    """Probes health every 50 ms until `large` is done; returns its window and the probes' latencies."""
    start = time.perf_counter()
    latencies = []
    while not large.done():
        t = time.perf_counter()
        await asyncio.wait_for(probe(), timeout=30)
        latencies.append(time.perf_counter() - t)
        await asyncio.sleep(0.05)
    return start, time.perf_counter(), latencies


def _assert_loop_kept_answering(arrivals: list[float], start: float, end: float, latencies: list[float]) -> None:
    in_window = [t for t in arrivals if start <= t <= end]
    # The gaps the stream saw from just before the large request came to just after it was answered.
    around = [t for t in arrivals if t < start][-1:] + in_window + [t for t in arrivals if t > end][:1]
    gaps = [b - a for a, b in zip(around, around[1:])]
    assert max(gaps) < MAX_PAUSE_S, f"the stream paused {max(gaps):.2f} s"
    assert max(latencies) < MAX_PAUSE_S, f"health took {max(latencies):.2f} s"
    assert len(in_window) >= 10 and len(latencies) >= 5, (len(in_window), len(latencies))  # truly concurrent


def test_a_large_chat_prompt_does_not_stall_other_streams_or_health(model):
    assert LARGE_PROMPT_CHARS > MAX_INLINE_CHARS

    async def scenario():
        engine = long_engine(model)
        async with edge_client(engine, model=model) as client:
            stream = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4000, "stream": True})
            arrivals: list[float] = []

            async def read_stream():
                async for _ in stream.content:
                    arrivals.append(time.perf_counter())

            reader = asyncio.create_task(read_stream())
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            body = {"messages": [{"role": "user", "content": large_prompt()}]}
            large = asyncio.create_task(client.post("/v1/chat/completions", json=body))

            async def health():
                assert (await client.get("/health")).status == 200

            start, end, latencies = await _while_running(arrivals, large, health)
            response = await large
            reader.cancel()
            stream.close()
            return response.status, await response.json(), arrivals, start, end, latencies

    status, payload, arrivals, start, end, latencies = asyncio.run(scenario())
    # Refused for its length, so it was tokenized to the end.
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    _assert_loop_kept_answering(arrivals, start, end, latencies)


def test_a_large_grpc_prompt_does_not_stall_other_streams_or_health(model):
    async def scenario():
        engine = long_engine(model)
        async with edge_grpc(engine, model=model) as address, stub_at(address) as stub:
            params = generate_pb2.GenerateRequest.SamplingParams(max_tokens=4000)
            call = stub.Generate(generate_pb2.GenerateRequest(text="Hi", sampling_params=params))
            arrivals: list[float] = []

            async def read_stream():
                while await call.read() is not grpc.aio.EOF:
                    arrivals.append(time.perf_counter())

            reader = asyncio.create_task(read_stream())
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            large = asyncio.create_task(stub.Generate(generate_pb2.GenerateRequest(text=large_prompt())).read())
            health_stub = health_pb2_grpc.HealthStub(stub_channel := grpc.aio.insecure_channel(address))

            async def health():
                await health_stub.Check(health_pb2.HealthCheckRequest())

            start, end, latencies = await _while_running(arrivals, large, health)
            await stub_channel.close()
            try:
                await large
                code = None
            except grpc.aio.AioRpcError as err:
                code = err.code(), err.details()
            reader.cancel()
            call.cancel()
            return code, arrivals, start, end, latencies

    code, arrivals, start, end, latencies = asyncio.run(scenario())
    assert code[0] == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length" in code[1], code
    _assert_loop_kept_answering(arrivals, start, end, latencies)


# --- which work leaves the loop ------------------------------------------------------------------
class ThreadRecordingTokenizer:
    """The fake tokenizer, noting on which thread each encode and decode ran."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.threads: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(("encode", threading.current_thread().name))
        return self._inner.encode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(("decode", threading.current_thread().name))
        return self._inner.decode(*args, **kwargs)


class OneShotEngine(FakeEngineClient):
    """Sends a request's whole reply in one output, as the engine client does for a full response."""

    async def generate(self, request: Any, final_only: bool = False, stream_interval: int = 1
                       ) -> AsyncIterator[EngineCoreOutput]:
        self.requests.append(request)
        tokens = self.reply_token_ids[: request.sampling_params.max_tokens - 1] + [request.eos_token_ids[0]]
        yield EngineCoreOutput(request.request_id, tokens, finish_reason=FinishReason.STOP)


@pytest.mark.parametrize("prompt_chars, reply_words, on_loop", [(100, 20, True), (MAX_INLINE_CHARS + 1, 600, False)])
def test_small_work_stays_on_the_loop_and_large_work_goes_to_a_thread(prompt_chars, reply_words, on_loop):
    tokenizer = ThreadRecordingTokenizer(make_tokenizer())
    reply = "Hello world. " * reply_words

    async def scenario():
        engine = OneShotEngine(tokenizer, reply, max_model_len=1_000_000)
        async with edge_client(engine, model=serving_model(tokenizer)) as client:
            tokenizer.threads.clear()  # the fake engine's own encode of its reply
            response = await client.post("/v1/completions", json={"prompt": "x" * prompt_chars, "max_tokens": 5000})
            return await response.json()

    payload = asyncio.run(scenario())
    assert payload["choices"][0]["text"] == reply
    assert (len(make_tokenizer().encode(reply)) > MAX_INLINE_TOKENS) != on_loop
    loop_thread = threading.main_thread().name
    encodes = [name for kind, name in tokenizer.threads if kind == "encode"]
    decodes = [name for kind, name in tokenizer.threads if kind == "decode"]
    if on_loop:
        assert set(encodes) == set(decodes) == {loop_thread}
    else:
        assert len(encodes) == 1 and encodes[0].startswith("tokenizer")
        # All but the detokenizer's first look at the prompt's last few tokens, made on the loop.
        assert decodes[0] == loop_thread and all(name.startswith("tokenizer") for name in decodes[1:])
        assert len(decodes) > MAX_INLINE_TOKENS
