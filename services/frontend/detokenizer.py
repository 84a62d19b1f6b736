"""Incremental detokenization with stop strings.

Tokens arrive a few at a time; the text they decode to must be emitted as soon as it is final and
never as broken UTF-8. A byte-level tokenizer can split one character over several tokens, and a
SentencePiece tokenizer decodes a token differently at the start of a text than after another token,
so each step decodes a short window of tokens twice:

    prefix_text = decode(token_ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(token_ids[prefix_offset:])              # emitted + candidate

and emits `new_text[len(prefix_text):]` unless it ends in U+FFFD (an incomplete character), in
which case the tokens wait for the next step. Once the request finishes, whatever is left is emitted.

Stop strings are the frontend's job: the text is searched for them as it grows, cut before the first
match, and the request ends with reason "stop". While running, the last `len(longest stop) - 1`
characters are held back, so a stop string split over two steps is never half streamed.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context of the first output token (SentencePiece spacing).
NUM_PROMPT_CONTEXT_TOKENS = 5


# decode(token_ids, skip_special_tokens) -> text
DecodeFn = Callable[[Sequence[int], bool], str]


@functools.lru_cache(maxsize=8)
def decode_fn(tokenizer: Any) -> DecodeFn:
    """The tokenizer's `decode`, straight from its Rust tokenizer where transformers would add nothing.

    Each streamed token decodes two short windows; transformers' `decode` spends about 3 of its 4 us
    (SmolLM2's tokenizer) converting and checking its arguments before the same Rust call. A fast
    tokenizer's text is that call's, cleaned of spaces before punctuation only where
    `clean_up_tokenization_spaces` is set, so such tokenizers keep the slow path.
    """
    from transformers import PreTrainedTokenizerFast

    # Both take (token_ids, skip_special_tokens) positionally: the bound methods, no wrapper call.
    if isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces:
        return tokenizer.backend_tokenizer.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas; stops at the first stop string."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self._decode_fn = decode_fn(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop_str = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # Held back while running, so a stop string spanning two steps is never partly emitted.
        self._stop_buffer_len = 0 if include_stop_str_in_output else max(self._max_stop_len - 1, 0)

        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # a prompt ending mid-character would garble the first output character
        self._token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._num_emitted_chars = 0
        # The stop string that ended the request, None while none has matched.
        self.stop_str: str | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    def update(self, new_token_ids: Sequence[int], is_finished: bool = False) -> str:
        """Adds one step's tokens; returns the text that became final (possibly "").

        After a stop string matched, further calls return "" and ignore their tokens.
        """
        if self.is_stopped:
            return ""
        num_chars_before = len(self.output_text)
        # Token by token, so complete characters before an incomplete one are not held back.
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._token_ids.append(token_id)
            self.output_text += self._decode_pending(flush=False)
        if is_finished:
            self.output_text += self._decode_pending(flush=True)
        if self._stop and self._find_stop(num_chars_before):
            is_finished = True
        return self._take_emittable(is_finished)

    def _decode_pending(self, flush: bool) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) and not flush:
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not flush:
            return ""  # an incomplete character: wait for the tokens that finish it
        # Keep a short window of already-emitted tokens as context for the next step.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text):]

    def _find_stop(self, num_chars_before: int) -> bool:
        """Cuts `output_text` at the earliest stop string ending in the new text."""
        start = max(0, num_chars_before - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.output_text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.stop_str = stop
        self.output_text = self.output_text[: index + len(stop) if self._include_stop_str else index]
        return True

    def _take_emittable(self, is_finished: bool) -> str:
        end = len(self.output_text) if is_finished else len(self.output_text) - self._stop_buffer_len
        if end <= self._num_emitted_chars:
            return ""
        delta = self.output_text[self._num_emitted_chars:end]
        self._num_emitted_chars = end
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self._decode_fn(token_ids, self._skip_special_tokens)
