"""Llama 3.1 to 3.3 JSON tool calls ("JSON based tool calling" in Meta's prompt format).

The model writes the call itself as its whole answer: after optional whitespace and an optional
`<|python_tag|>`, a JSON object `{"name": ..., "parameters": {...}}` ("arguments" is accepted too),
and further calls after a `;` (or just whitespace). An output that does not begin that way is plain
content. Text after the calls is content; a trailing `;` is dropped. An object that is not a valid
call is content from the text before it (whitespace, tag or separator) to the end of the output.

Streamed, a call is sent once committed (see `call_object`); if its JSON breaks after that, the call
keeps what was sent and the rest of the output is dropped (there is no closing tag to resume at),
where the non-streamed result would be content from that object on.
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

PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\n\r"
# The start (whitespace, python tag), a call object, what follows one (a separator or the end),
# content to the end, or dropped to the end.
_START, _CALL, _AFTER_CALL, _CONTENT, _DROPPED = range(5)


class Llama3JsonToolCallStreamParser(CallTextStreamParser):
    """Streams one choice in Llama 3's JSON format; `emit_partial_calls` as in Hermes."""

    START_MODE, CALL_MODE, AFTER_CALL_MODE, BAD_MODE, DROPPED_MODE = _START, _CALL, _AFTER_CALL, _CONTENT, _DROPPED

    def __init__(self, emit_partial_calls: bool = True):
        super().__init__(emit_partial_calls)
        self._call_prefix = ""  # the whitespace, tag or separator before the call, for content

    def finish(self) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        if self._mode == _START or self._mode == _CONTENT:
            self._add_content(events, self._text)
        elif self._mode == _CALL and not self._call.is_committed:
            self._add_content(events, self._bad_call_text(self._call))
        # After a call, whitespace and a lone `;` are separators, dropped.
        self._text, self._mode, self._call = "", _CONTENT, None
        return events

    def _advance(self, events: list[DeltaEvent]) -> bool:
        """Reads from the start of `self._text`; False when the rest must wait for more text."""
        text, mode = self._text, self._mode
        if mode == _START:
            rest = text.lstrip(_WHITESPACE)
            if rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG):].lstrip(_WHITESPACE)
            elif PYTHON_TAG.startswith(rest):
                return False  # whitespace only, or maybe the tag
            return self._call_or_content(text, rest)
        if mode == _CALL:
            return self._read_call(events, text)
        if mode == _AFTER_CALL:
            rest = text.lstrip(_WHITESPACE)
            if rest.startswith(";"):
                rest = rest[1:].lstrip(_WHITESPACE)
            return self._call_or_content(text, rest)
        if mode == _CONTENT:
            self._add_content(events, text)
        self._text = ""
        return False

    def _call_or_content(self, text: str, rest: str) -> bool:
        """After the markup a call may follow: `rest`, `text` with it stripped, starts one or is content."""
        if not rest:
            return False
        if rest[0] == "{":
            self._start_call(text, rest)
        else:
            self._mode = _CONTENT
        return True

    def _start_call(self, text: str, rest: str) -> None:
        self._call_prefix = text[:len(text) - len(rest)]
        self._text, self._mode = rest, _CALL
        self._call = CallObjectStream(index=self._num_calls)

    def _bad_call_text(self, call: CallObjectStream) -> str:
        return self._call_prefix + call.raw_text

class Llama3JsonToolParser(ToolParser):
    def create_stream_parser(self) -> Llama3JsonToolCallStreamParser:
        return Llama3JsonToolCallStreamParser()

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        parser = Llama3JsonToolCallStreamParser(emit_partial_calls=False)
        return collect_events(parser.feed(model_output) + parser.finish())
