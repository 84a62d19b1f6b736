"""Hermes-style tool calls (Qwen 2.5 and 3, Hermes 2 Pro and 3, the shipped ChatML tools template).

The model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with any
text before, between or after the calls. The closing tag may be missing (a model that stops right
after the object). A block whose JSON is not a valid call object stays content, tags included, up
to and including its closing tag.

Streamed, a block's call is sent as soon as it is committed (see `call_object`); if its JSON breaks
after that, the call keeps what was sent and the rest of the block is dropped, where the non-streamed
result would keep the whole block as content. Likewise a committed call cut off by the end of the
output keeps the arguments sent so far, where non-streamed it is content.
"""
from __future__ import annotations

from services.frontend.tool_parsers.abstract_tool_parser import (
    DeltaEvent,
    ExtractedToolCalls,
    ToolCallStreamParser,
    ToolParser,
    collect_events,
)
from services.frontend.tool_parsers.call_object import CALL_BAD, CALL_DONE, CALL_PENDING, CallObjectStream, read_call

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"
_WHITESPACE = " \t\n\r"
# What the text being read is: content, a call object, what follows one (whitespace, then the
# closing tag, if any), or a broken block up to its closing tag, kept as content or dropped.
_TEXT, _CALL, _AFTER_CALL, _BAD_BLOCK, _DROPPED_BLOCK = range(5)


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class HermesToolCallStreamParser(ToolCallStreamParser):
    """Streams one choice in the Hermes format. With `emit_partial_calls=False` calls are sent only
    when their object is complete, which is how the non-streamed parser reads a whole output."""

    def __init__(self, emit_partial_calls: bool = True):
        super().__init__()
        self._emit_partial_calls = emit_partial_calls
        self._mode = _TEXT
        self._text = ""  # text received and not yet decided
        self._call: CallObjectStream | None = None
        self._num_calls = 0

    def feed(self, delta_text: str) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        self._text += delta_text
        while self._text and self._advance(events):
            pass
        if self._emit_partial_calls and self._mode == _CALL:
            events.extend(self._call.progress())
        return events

    def finish(self) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        if self._mode == _TEXT or self._mode == _BAD_BLOCK:
            self._add_content(events, self._text)
        elif self._mode == _CALL and not self._call.is_committed:
            self._add_content(events, START_TAG + self._call.raw_text)
        # After a call, whitespace and a partial closing tag are markup, dropped.
        self._text, self._mode, self._call = "", _TEXT, None
        return events

    def _advance(self, events: list[DeltaEvent]) -> bool:
        """Reads from the start of `self._text`; False when the rest must wait for more text."""
        text, mode = self._text, self._mode
        if mode == _TEXT:
            start = text.find(START_TAG)
            if start < 0:
                keep = _partial_tag_length(text, START_TAG)
                self._add_content(events, text[:len(text) - keep])
                self._text = text[len(text) - keep:]
                return False
            self._add_content(events, text[:start])
            self._text, self._mode = text[start + len(START_TAG):], _CALL
            self._call = CallObjectStream(index=self._num_calls)
            return True
        if mode == _CALL:
            return self._read_call(events, text)
        if mode == _AFTER_CALL:
            rest = text.lstrip(_WHITESPACE)
            if rest.startswith(END_TAG):
                self._text, self._mode = rest[len(END_TAG):], _TEXT
                return True
            if not rest or END_TAG.startswith(rest):
                return False
            self._mode = _TEXT  # no closing tag: what follows is content again
            return True
        end = text.find(END_TAG)
        done = end >= 0
        cut = end + len(END_TAG) if done else len(text) - _partial_tag_length(text, END_TAG)
        if mode == _BAD_BLOCK:
            self._add_content(events, text[:cut])
        self._text = text[cut:]
        if done:
            self._mode = _TEXT
        return done

    def _read_call(self, events: list[DeltaEvent], text: str) -> bool:
        call = self._call
        end, outcome = read_call(call, events, text)
        self._text = text[end:]
        if outcome == CALL_PENDING:
            return False
        if outcome == CALL_BAD:
            self._add_content(events, START_TAG + call.raw_text)
            self._mode, self._call = _BAD_BLOCK, None
            return True
        self._num_calls += 1
        if outcome == CALL_DONE:
            self._mode = _AFTER_CALL
        else:
            self._mode, self._call = _DROPPED_BLOCK, None
        return True


class HermesToolParser(ToolParser):
    def create_stream_parser(self) -> HermesToolCallStreamParser:
        return HermesToolCallStreamParser()

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        parser = HermesToolCallStreamParser(emit_partial_calls=False)
        return collect_events(parser.feed(model_output) + parser.finish())
