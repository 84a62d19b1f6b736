"""What the Hermes and Llama 3 JSON stream parsers share: text buffered in `_text` and read by the
format's `_advance` until a call object starts, then the object read by `_read_call`; `feed` runs
both and, with `emit_partial_calls`, sends the pieces of the call being read as they become certain.

A format names its modes with the class attributes below (its start mode differs: Hermes starts in
free text, Llama 3 JSON at a possible call) and says which text a broken call returns as content.
"""
from __future__ import annotations

import abc

from services.frontend.tool_parsers.abstract_tool_parser import DeltaEvent, ToolCallStreamParser
from services.frontend.tool_parsers.call_object import CALL_BAD, CALL_DONE, CALL_PENDING, CallObjectStream, read_call


class CallTextStreamParser(ToolCallStreamParser):
    START_MODE: int
    CALL_MODE: int  # reading a call object
    AFTER_CALL_MODE: int  # what follows a call (whitespace, a closing tag or separator)
    BAD_MODE: int  # after a call that broke before its first piece: its text is content
    DROPPED_MODE: int  # after a call that broke once sent: the rest of it is dropped

    def __init__(self, emit_partial_calls: bool = True):
        """With `emit_partial_calls=False` calls are sent only when their object is complete,
        which is how the non-streamed parser reads a whole output."""
        super().__init__()
        self._emit_partial_calls = emit_partial_calls
        self._mode = self.START_MODE
        self._text = ""  # text received and not yet decided
        self._call: CallObjectStream | None = None
        self._num_calls = 0

    def feed(self, delta_text: str) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        self._text += delta_text
        while self._text and self._advance(events):
            pass
        if self._emit_partial_calls and self._mode == self.CALL_MODE:
            events.extend(self._call.progress())
        return events

    @abc.abstractmethod
    def _advance(self, events: list[DeltaEvent]) -> bool:
        """Reads from the start of `self._text`; False when the rest must wait for more text."""

    @abc.abstractmethod
    def _bad_call_text(self, call: CallObjectStream) -> str:
        """The content a call that broke before its first piece stands for (its markup included)."""

    def _read_call(self, events: list[DeltaEvent], text: str) -> bool:
        call = self._call
        end, outcome = read_call(call, events, text)
        self._text = text[end:]
        if outcome == CALL_PENDING:
            return False
        if outcome == CALL_BAD:
            self._add_content(events, self._bad_call_text(call))
            self._mode, self._call = self.BAD_MODE, None
            return True
        self._num_calls += 1
        if outcome == CALL_DONE:
            self._mode = self.AFTER_CALL_MODE
        else:
            self._mode, self._call = self.DROPPED_MODE, None
        return True
