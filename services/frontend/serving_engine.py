"""What chat, completions and the gRPC GenerateService share.

`OpenAIServing` checks the model name and readiness, turns a validated request plus prompt token
ids into `EngineCoreRequest`s (context-length checks, default max_tokens; `n` choices are n engine
requests), and runs them: engine outputs go through the detokenizer and come out as `TextDelta`s.
Leaving the delta iterator early (client gone, stop string) closes the engine's iterator, which
aborts the request in the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Mapping

from services.common.messages import EngineCoreRequest, FinishReason, TokenLogprobs
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_protocol import EngineClientProtocol
from services.frontend.errors import EngineError, invalid_request, model_not_found, service_unavailable
from services.frontend.fanout import merge_streams
from services.frontend.logprobs import TokenStrings
from services.frontend.observability import FrontendObserver
from services.frontend.protocol import GenerationOptions
from services.frontend.structured_outputs import ConstraintChecker
from services.frontend.chat_template import ChatTemplate
from services.frontend.tokenizer import MAX_INLINE_CHARS, MAX_INLINE_TOKENS, AsyncTokenizer
from services.frontend.tool_parsers import get_tool_parser

_INT64 = 2**64


@dataclass(frozen=True)
class ServingModel:
    """The model as the frontend serves it."""

    name: str  # the only value clients may put in `model`
    tokenizer: Any
    eos_token_ids: tuple[int, ...] = ()
    # Lowers the engine's context length; None keeps the engine's.
    max_model_len: int | None = None
    # The operator's chat template file (`--chat-template`); None: the model's own.
    chat_template_path: str | None = None
    # Parses tool calls out of `tool_choice: auto` output (`--tool-call-parser`).
    tool_call_parser: str = "hermes"
    # Sampling values for the fields a request leaves unset (generation_defaults.py).
    generation_defaults: Mapping[str, float] = dataclasses.field(default_factory=dict)
    chat_template: ChatTemplate = dataclasses.field(init=False, repr=False, compare=False)
    # The tokenizer's work on the request path, off the event loop for large inputs; one for both faces.
    async_tokenizer: AsyncTokenizer = dataclasses.field(init=False, repr=False, compare=False)
    # Output constraints, each distinct one parsed once.
    constraint_checker: ConstraintChecker = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        chat_template = ChatTemplate.build(self.tokenizer, self.chat_template_path)
        object.__setattr__(self, "chat_template", chat_template)
        object.__setattr__(self, "async_tokenizer", AsyncTokenizer(self.tokenizer, chat_template))
        object.__setattr__(self, "constraint_checker", ConstraintChecker())


class ServerState:
    """Draining flag and in-flight count, shared by the HTTP and gRPC faces for graceful shutdown."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.num_inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_inflight -= 1
            if self.num_inflight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True if every in-flight request finished within the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


@dataclass
class TextDelta:
    """New text of one request since the last delta; `finish_reason` is set on the last one."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" or "length"
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # one per token id, if asked


@dataclass
class Choice:
    """One choice of a request: its engine request, detokenizer and what arrived so far."""

    engine_request: EngineCoreRequest
    detokenizer: IncrementalDetokenizer
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.detokenizer.output_token_ids)


class OpenAIServing:
    def __init__(self, engine_client: EngineClientProtocol, model: ServingModel, state: ServerState,
                 observer: FrontendObserver | None = None, stream_interval: int = 1):
        self.engine_client = engine_client
        # Streamed outputs reach a request every this many tokens (--stream-interval).
        self.stream_interval = stream_interval
        self.model = model
        self.state = state
        self.observer = observer
        self.async_tokenizer = model.async_tokenizer
        self.token_strings = TokenStrings(model.tokenizer)

    @property
    def is_ready(self) -> bool:
        return self.engine_client.is_ready and not self.state.is_draining

    @property
    def max_model_len(self) -> int:
        engine_len = self.engine_client.info.max_model_len
        if self.model.max_model_len is None:
            return engine_len
        return min(engine_len, self.model.max_model_len)

    def check_model(self, model: str | None) -> None:
        """An omitted model means the served one; any other name is unknown."""
        if model is not None and model != self.model.name:
            raise model_not_found(model)

    def check_ready(self) -> None:
        if self.state.is_draining:
            raise service_unavailable("The server is shutting down.")
        if not self.engine_client.is_ready:
            raise service_unavailable("The engine is not ready; try again shortly.")

    async def wait_ready(self) -> None:
        """`check_ready`, after waiting for the engine client's handover to a ready engine, if any."""
        if not self.state.is_draining:
            await self.engine_client.wait_ready()
        self.check_ready()

    async def check_constraint(self, options: GenerationOptions) -> None:
        """A 400 naming the field if the request's output constraint does not parse (large ones
        are parsed on a tokenizer thread)."""
        params = options.sampling_params.structured_outputs
        if params is not None:
            await self.async_tokenizer.run(len(params.spec) > MAX_INLINE_CHARS, self.model.constraint_checker.check,
                                           params, options.constraint_param)

    def make_engine_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        options: GenerationOptions,
        prompt_param: str,
        default_max_tokens: int | None = None,
    ) -> EngineCoreRequest:
        """Checks the prompt and max_tokens against the context length and the vocabulary."""
        num_prompt_tokens = len(prompt_token_ids)
        max_model_len = self.max_model_len
        if num_prompt_tokens == 0:
            raise invalid_request("The prompt is empty after tokenization.", param=prompt_param)
        if num_prompt_tokens >= max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, leaving no room for the completion.",
                param=prompt_param, code="context_length_exceeded")
        room = max_model_len - num_prompt_tokens
        if options.max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif options.max_tokens > room:
            raise invalid_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt_tokens} tokens, so '{options.max_tokens_param}' can be at most {room}, "
                f"got {options.max_tokens}.",
                param=options.max_tokens_param, code="context_length_exceeded")
        else:
            max_tokens = options.max_tokens
        params = options.sampling_params
        if params.min_tokens > max_tokens:
            raise invalid_request(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens}).",
                                  param="min_tokens")
        self._check_token_ids(prompt_token_ids, prompt_param)
        self._check_token_ids(params.logit_bias, "logit_bias")
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=dataclasses.replace(params, max_tokens=max_tokens),
            arrival_time=time.time(),
            priority=options.priority,
            eos_token_ids=self.model.eos_token_ids,
        )

    def make_choices(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        options: GenerationOptions,
        prompt_param: str,
        default_max_tokens: int | None = None,
    ) -> list[Choice]:
        """One engine request per choice: ids `<id>-<i>` when n > 1, and seed + i so seeded choices differ."""
        first = self.make_engine_request(request_id, prompt_token_ids, options, prompt_param, default_max_tokens)
        n = options.n
        first.sampling_params = dataclasses.replace(first.sampling_params, n=1)  # the engine sees single choices
        requests = [first]
        if n > 1:
            seed = first.sampling_params.seed
            requests = [
                dataclasses.replace(
                    first, request_id=f"{request_id}-{i}",
                    sampling_params=dataclasses.replace(
                        first.sampling_params, seed=None if seed is None else _wrap_int64(seed + i)))
                for i in range(n)
            ]
        return [Choice(r, self.make_detokenizer(prompt_token_ids, options)) for r in requests]

    async def generate_choices(self, choices: list[Choice], final_only: bool = False
                               ) -> AsyncIterator[tuple[int, TextDelta]]:
        """Runs every choice at once; yields (choice index, delta) and records finish reasons and cache hits.

        The first failing choice fails them all; leaving early aborts every unfinished one.
        `final_only` (a full, non-streamed response) lets a choice without stop strings get its
        tokens in one delta at the end instead of one per engine step; a streamed one gets them
        every `stream_interval` tokens (a choice with stop strings every step, so that a stop
        string aborts its request at once).
        """
        # Observability hook: GenAI span and request metrics (services/frontend/observability.py).
        observation = self.observer.begin(choices) if self.observer is not None else None
        if observation is not None:  # the engine requests are children of the request's span
            for choice in choices:
                choice.engine_request.traceparent, choice.engine_request.tracestate = observation.trace_context
        streams = []
        for c in choices:
            has_stop_strings = c.detokenizer.has_stop_strings
            streams.append(self.generate(c.engine_request, c.detokenizer,
                                         final_only=final_only and not has_stop_strings,
                                         stream_interval=1 if has_stop_strings else self.stream_interval))
        error: BaseException | None = None
        try:
            async with aclosing(merge_streams(streams)) as deltas:
                async for index, delta in deltas:
                    choice = choices[index]
                    choice.num_cached_tokens = delta.num_cached_tokens
                    choice.finish_reason = delta.finish_reason or choice.finish_reason
                    yield index, delta
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the consumer left: unfinished choices count as aborted
        except BaseException as exc:
            error = exc
            raise
        finally:
            if observation is not None:
                observation.end(error)

    def make_detokenizer(self, prompt_token_ids: list[int], options: GenerationOptions) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.model.tokenizer,
            prompt_token_ids,
            stop=options.stop,
            include_stop_str_in_output=options.include_stop_str_in_output,
            skip_special_tokens=options.skip_special_tokens,
        )

    async def generate(
        self, request: EngineCoreRequest, detokenizer: IncrementalDetokenizer, final_only: bool = False,
        stream_interval: int = 1,
    ) -> AsyncIterator[TextDelta]:
        """Runs one request; yields text deltas, the last one with its finish reason.

        Raises EngineError if the engine refuses or fails the request. Use it under
        `contextlib.aclosing` so that leaving early aborts the request in the engine.
        """
        outputs = self.engine_client.generate(request, final_only=final_only, stream_interval=stream_interval)
        wants_logprobs = request.sampling_params.logprobs is not None
        num_cached_tokens = 0
        is_finished = False
        try:
            async for output in outputs:
                if output.finish_reason == FinishReason.ERROR:
                    raise EngineError(output.error_message or "The engine failed the request.",
                                      getattr(output, "error_code", "") or "internal")
                if output.finish_reason == FinishReason.ABORT:
                    raise EngineError("The engine aborted the request.", "unavailable")
                num_cached_tokens = max(num_cached_tokens, output.num_cached_tokens)
                # A full response's tokens can arrive all at once: thousands to detokenize.
                is_large = len(output.new_token_ids) > MAX_INLINE_TOKENS
                text = await self.async_tokenizer.run(is_large, detokenizer.update, output.new_token_ids,
                                                      is_finished=output.finished)
                logprobs = list(output.new_logprobs) if wants_logprobs else []
                if detokenizer.is_stopped:
                    await _close(outputs)  # abort now rather than after the client reads the last delta
                    yield TextDelta(text, output.new_token_ids, "stop", num_cached_tokens, logprobs)
                    return
                if output.finished:
                    # Keep iterating: the engine's iterator ends by itself after its last output.
                    is_finished = True
                    yield TextDelta(text, output.new_token_ids, output.finish_reason.to_openai(), num_cached_tokens,
                                    logprobs)
                elif text or output.new_token_ids:
                    yield TextDelta(text, output.new_token_ids, None, num_cached_tokens, logprobs)
            if not is_finished:
                raise EngineError("The engine ended the request without finishing it.", "internal")
        finally:
            await _close(outputs)

    def _check_token_ids(self, token_ids: Any, param: str) -> None:
        vocab_size = self.engine_client.info.vocab_size
        if vocab_size > 0:
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise invalid_request(f"Token id {bad[0]} is outside the vocabulary [0, {vocab_size}).", param=param)


def _wrap_int64(value: int) -> int:
    """seed + i wraps around inside int64, as the seed field is one."""
    return (value + 2**63) % _INT64 - 2**63


async def _close(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; with n choices the prompt counts once and the completions add up."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def choices_usage(choices: list[Choice]) -> dict[str, Any]:
    """Usage of a whole request; a cache hit counts only as far as every choice had it."""
    return usage_dict(len(choices[0].engine_request.prompt_token_ids), sum(c.num_output_tokens for c in choices),
                      min(c.num_cached_tokens for c in choices))


def add_token_ids(response: dict[str, Any], choices: list[Choice]) -> None:
    """vLLM's `return_token_ids`: the prompt's and each choice's token ids beside the text."""
    response["prompt_token_ids"] = list(choices[0].engine_request.prompt_token_ids)
    for out, choice in zip(response["choices"], choices):
        out["token_ids"] = list(choice.detokenizer.output_token_ids)
