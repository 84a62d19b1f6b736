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
    ToolParser,
    collect_events,
)
from services.frontend.tool_parsers.call_object import CallObjectStream
from services.frontend.tool_parsers.call_stream import CallTextStreamParser

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


class HermesToolCallStreamParser(CallTextStreamParser):
    """Streams one choice in the Hermes format. With `emit_partial_calls=False` calls are sent only
    when their object is complete, which is how the non-streamed parser reads a whole output."""

    START_MODE, CALL_MODE, AFTER_CALL_MODE, BAD_MODE, DROPPED_MODE = _TEXT, _CALL, _AFTER_CALL, _BAD_BLOCK, _DROPPED_BLOCK

    def finish(self) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        if self._mode == _TEXT or self._mode == _BAD_BLOCK:
            self._add_content(events, self._text)
        elif self._mode == _CALL and not self._call.is_committed:
            self._add_content(events, self._bad_call_text(self._call))
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

    def _bad_call_text(self, call: CallObjectStream) -> str:
        return START_TAG + call.raw_text

class HermesToolParser(ToolParser):
    def create_stream_parser(self) -> HermesToolCallStreamParser:
        return HermesToolCallStreamParser()

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        parser = HermesToolCallStreamParser(emit_partial_calls=False)
        return collect_events(parser.feed(model_output) + parser.finish())
