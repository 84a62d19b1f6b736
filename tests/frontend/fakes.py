"""Test doubles for the frontend: a tiny offline tokenizer and a scripted EngineClient."""
from __future__ import annotations

import asyncio
import functools
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from aiohttp.test_utils import TestClient, TestServer

from services.common.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    SchedulerStats,
    TokenLogprobs,
)
from services.frontend.app import create_app
from services.frontend.errors import EngineError
from services.frontend.serving_engine import ServerState, ServingModel

MODEL_NAME = "fake-model"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must start with a system or user message.') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "Hello world. The capital of France is Paris.",
    "日本語のテキストと中文文本。",
    "emoji 😀😀😀 🎉🎉 👍🏽 and café naïve",
] * 20


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> Any:
    """A byte-level BPE trained in milliseconds: multi-byte characters split over several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML_TEMPLATE
    return fast


class FakeEngineClient:
    """Answers every request with `reply` (one token per step), then EOS, honouring max_tokens.

    Knobs: `is_ready`; `refuse` (an EngineError raised before the first output); `fail_after`
    (raise `failure` after that many outputs); `error_after` (emit a FINISH_REASON_ERROR output after
    that many); `step_delay_s`; `num_cached_tokens`. Records `requests` and `aborted` request ids
    (a request counts as aborted when its iterator is closed before its last output). A request
    asking for k logprobs gets `fake_logprobs(token, k)` with each token.
    """

    def __init__(self, tokenizer: Any, reply: str = "Hello world.", *, reply_token_ids: Sequence[int] | None = None,
                 max_model_len: int = 256, step_delay_s: float = 0.0, num_cached_tokens: int = 0):
        self.tokenizer = tokenizer
        self.reply_token_ids = list(reply_token_ids if reply_token_ids is not None
                                    else tokenizer.encode(reply, add_special_tokens=False))
        self.info = EngineInfo(model_name=MODEL_NAME, max_model_len=max_model_len, block_size=16,
                               num_blocks=64, device="cpu", dtype="float32", vocab_size=len(tokenizer),
                               attention_backend="none")
        self.is_ready = True
        self.last_stats = SchedulerStats()
        self.observer = None
        self.on_readiness_change = None  # `is_ready` is a plain knob here: the frontend polls it
        self.refuse: EngineError | None = None
        self.fail_after: int | None = None
        self.failure = EngineError("worker died", "unavailable")
        self.error_after: int | None = None
        self.step_delay_s = step_delay_s
        self.num_cached_tokens = num_cached_tokens
        self.requests: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.final_only: list[bool] = []  # per request: whether merged outputs were asked for
        self.stream_intervals: list[int] = []  # per request: the stream interval asked for
        self.flush_refusals = 0
        self.num_flush_calls = 0
        self.kv_batches: list = []  # KVEventBatch, for subscribe_kv_events

    async def wait_ready(self) -> bool:
        return self.is_ready

    async def generate(self, request: EngineCoreRequest, final_only: bool = False, stream_interval: int = 1
                       ) -> AsyncIterator[EngineCoreOutput]:
        self.requests.append(request)
        self.final_only.append(final_only)
        self.stream_intervals.append(stream_interval)
        if self.refuse is not None:
            raise self.refuse
        eos = request.eos_token_ids[0] if request.eos_token_ids else None
        tokens = self.reply_token_ids + ([eos] if eos is not None else [])
        max_tokens = request.sampling_params.max_tokens
        is_done = False
        try:
            for i, token in enumerate(tokens[:max_tokens]):
                await asyncio.sleep(self.step_delay_s)
                if self.fail_after is not None and i == self.fail_after:
                    raise self.failure
                if self.error_after is not None and i == self.error_after:
                    is_done = True
                    yield EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                           error_message="kernel exploded")
                    return
                if token == eos:
                    reason = FinishReason.STOP
                elif i + 1 == max_tokens:
                    reason = FinishReason.LENGTH
                else:
                    reason = FinishReason.NONE
                is_done = reason != FinishReason.NONE
                k = request.sampling_params.logprobs
                yield EngineCoreOutput(request.request_id, [token], finish_reason=reason,
                                       num_cached_tokens=self.num_cached_tokens,
                                       new_logprobs=[] if k is None else [fake_logprobs(token, k)])
        finally:
            if not is_done:
                self.aborted.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def get_stats(self) -> tuple[SchedulerStats, bool]:
        return SchedulerStats(), self.is_ready

    async def reset_prefix_cache(self) -> bool:
        """Refused while `flush_refusals` > 0 (requests hold blocks), counting down."""
        self.num_flush_calls += 1
        if self.flush_refusals > 0:
            self.flush_refusals -= 1
            return False
        return True

    async def subscribe_kv_events(self):
        """The batches in `kv_batches`, then EngineError (the scheduler went away)."""
        for batch in self.kv_batches:
            yield batch
        raise EngineError("the scheduler's KV event stream ended", "unavailable")


def fake_logprobs(token: int, k: int) -> TokenLogprobs:
    """The sampled token at -0.25 (rank 1), then k - 1 other tokens below it, sorted."""
    top = [(token, -0.25)] + [(token + j, -0.25 - j) for j in range(1, k)]
    return TokenLogprobs(logprob=-0.25, rank=1, top_logprobs=top[:k])


def serving_model(tokenizer: Any, max_model_len: int | None = None) -> ServingModel:
    return ServingModel(name=MODEL_NAME, tokenizer=tokenizer, eos_token_ids=(tokenizer.eos_token_id,),
                        max_model_len=max_model_len)


@asynccontextmanager
async def app_client(engine: FakeEngineClient, state: ServerState | None = None,
                     max_model_len: int | None = None, stream_interval: int = 1) -> AsyncIterator[TestClient]:
    """An aiohttp test client for the frontend app (handlers are cancelled on disconnect)."""
    app = create_app(engine, serving_model(engine.tokenizer, max_model_len), state, stream_interval=stream_interval)
    async with TestClient(TestServer(app)) as client:
        yield client


async def read_sse(response: Any) -> tuple[list[dict], list[bytes]]:
    """All `data:` events of an SSE response: the decoded JSON chunks and the raw lines."""
    import json

    raw = await response.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), events
    assert events[-1] == b"data: [DONE]", events[-1]
    return [json.loads(e[len(b"data: "):]) for e in events[:-1]], events


async def wait_until(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    """Polls `predicate()` until it holds; raises TimeoutError naming `what` after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)
