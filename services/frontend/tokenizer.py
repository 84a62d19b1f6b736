"""Loads the tokenizer and the facts about it the frontend needs (chat template), and runs its work
on large inputs off the event loop (`AsyncTokenizer`)."""
from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from services.frontend.chat_template import ChatTemplate
from services.frontend.errors import invalid_request

T = TypeVar("T")

# Work this small stays on the event loop: on SmolLM2's tokenizer, encoding 4,096 characters takes
# about 1.4 ms and a detokenizer update of 256 tokens about 2.6 ms, a few thread hops (0.3 ms each);
# a thread would add more latency than it saves. Bigger inputs go to a thread.
MAX_INLINE_CHARS = 4096
MAX_INLINE_TOKENS = 256
# Each thread keeps one core busy; beyond a few, large requests queue rather than starve the rest.
MAX_TOKENIZER_THREADS = 4


def load_tokenizer(model_path: str | Path) -> Any:
    """A Hugging Face fast tokenizer from a model folder (never touches the network)."""
    from transformers import AutoTokenizer  # heavy import, kept out of module import time

    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


def render_chat_prompt(tokenizer: Any, chat_template: ChatTemplate, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Applies the chat template (with `tools` if given) with the assistant's turn opened, then
    tokenizes. A template's refusal (roles out of order, arguments that are not JSON) is a 400."""
    try:
        text = chat_template.render(tokenizer, messages, tools)
    except ValueError as exc:
        raise invalid_request(str(exc), param="messages") from None
    # The template already wrote any BOS token it wants.
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenizes a raw completion prompt, with the special tokens the model expects (e.g. BOS)
    unless told otherwise (`/tokenize`)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class AsyncTokenizer:
    """The tokenizer work of the request path, run on a thread when its input is large.

    Threads truly keep the loop answering: the fast tokenizer's batch encode, through which
    transformers' `encode` goes, runs in Rust with the GIL released (measured on a 4.5 M-character
    prompt: the loop's longest pause was 0.2 s in 8 s of encoding, against 4.3 s with the
    GIL-holding `tokenizers.Tokenizer.encode`), and chat templates and decoding are Python or short
    GIL-held calls that a thread interleaves with the loop every 5 ms (the interpreter's switch
    interval). The tokenizer is only read, never reconfigured, so threads can share it.
    """

    def __init__(self, tokenizer: Any, chat_template: ChatTemplate, max_threads: int = MAX_TOKENIZER_THREADS):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # Threads start only when a large input comes.
        self._executor = ThreadPoolExecutor(max_workers=max(1, min(max_threads, os.cpu_count() or 1)),
                                            thread_name_prefix="tokenizer")

    async def run(self, is_large: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, inline when small, on a tokenizer thread when `is_large`."""
        if not is_large:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(len(text) > MAX_INLINE_CHARS, encode_prompt, self.tokenizer, text, add_special_tokens)

    async def render_chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                                 ) -> list[int]:
        num_chars = sum(len(m["content"]) + 200 * len(m.get("tool_calls", ())) for m in messages)
        is_large = num_chars > MAX_INLINE_CHARS or bool(tools)  # tools render as JSON: a few ms
        return await self.run(is_large, render_chat_prompt, self.tokenizer, self.chat_template, messages, tools)

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return await self.run(len(token_ids) > MAX_INLINE_TOKENS, self.tokenizer.decode, token_ids,
                              skip_special_tokens=skip_special_tokens)

    async def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return await self.run(len(token_ids) > MAX_INLINE_TOKENS, self.tokenizer.convert_ids_to_tokens,
                              list(token_ids))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
