"""Tool calls that `tool_choice` forces, where structured outputs constrain the model's text.

- A named function (`{"type": "function", "function": {"name": ...}}`): the text is the arguments
  object itself, and there is exactly one call, whose name is known before any text.
- `required`: the text is a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`
  ("arguments" is accepted too); an item that is not a valid call is skipped.

The grammar rules out malformed text, but not text cut off by `max_tokens`. Non-streamed, such text
is refused (ValueError), so that the caller keeps it as content. Streamed, the calls have gone out
already: a call cut off (or broken) keeps the arguments that were certain at that point, which are
then not complete JSON, and reading stops there; an item that is not a call is skipped.
"""
from __future__ import annotations

from services.frontend.tool_parsers.abstract_tool_parser import (
    DeltaEvent,
    DeltaToolCall,
    ToolCall,
    ToolCallStreamParser,
    make_tool_call_id,
)
from services.frontend.tool_parsers.call_object import CallObjectStream, call_from_object
from services.frontend.tool_parsers.json_stream import JsonStream, dumps_json, loads_json

_WHITESPACE = " \t\n\r"
# For `required`: before the array, before an item or its end, before an item, in one, after one.
_START, _ITEM_OR_END, _ITEM, _CALL, _AFTER_ITEM, _STOPPED = range(6)


class ForcedToolCallStreamParser(ToolCallStreamParser):
    """Streams the tool calls of one choice whose `tool_choice` is a named function (its name) or
    `required` (None). Only `DeltaToolCall` events come out; text outside the JSON is ignored."""

    def __init__(self, named_function: str | None):
        super().__init__()
        self._named_function = named_function
        self._num_calls = 0
        self._is_stopped = False
        # A named function: the arguments object.
        self._id = make_tool_call_id()
        self._arguments = JsonStream(require_object=True)
        self._raw_arguments: list[str] = []
        self._sent_arguments: list[str] = []
        # `required`: the array of call objects.
        self._state = _START
        self._call: CallObjectStream | None = None

    def feed(self, delta_text: str) -> list[DeltaEvent]:
        if self._named_function is not None:
            return self._feed_named(delta_text)
        events: list[DeltaEvent] = []
        i = 0
        while i < len(delta_text) and self._state != _STOPPED:
            i = self._read_array(events, delta_text, i)
        if self._state == _CALL:
            events.extend(self._call.progress())
        return events

    def finish(self) -> list[DeltaEvent]:
        if self._named_function is not None:
            return self._feed_named("")
        events: list[DeltaEvent] = []
        if self._state == _CALL:  # cut off: keep what is certain
            events.extend(self._call.progress())
        self._state = _STOPPED
        return events

    def _feed_named(self, delta_text: str) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        if self._num_calls == 0:
            self._num_calls = 1
            events.append(DeltaToolCall(index=0, id=self._id, name=self._named_function, arguments=""))
        if self._is_stopped:
            return events
        stream = self._arguments
        end = stream.feed(delta_text)
        self._raw_arguments.append(delta_text[:end])
        fragment = stream.drain()
        if stream.is_done:  # the final text, as the other parsers derive it
            self._is_stopped = True
            sent = "".join(self._sent_arguments)
            final = dumps_json(loads_json("".join(self._raw_arguments)))
            fragment = final[len(sent):] if final.startswith(sent) else ""
        elif stream.has_error:
            self._is_stopped = True
        if fragment:
            self._sent_arguments.append(fragment)
            events.append(DeltaToolCall(index=0, id=None, name=None, arguments=fragment))
        return events

    def _read_array(self, events: list[DeltaEvent], text: str, i: int) -> int:
        """Reads from `text[i]` on; returns where it stopped."""
        state = self._state
        if state == _CALL:
            return self._read_call(events, text, i)
        c = text[i]
        if c in _WHITESPACE:
            return i + 1
        if state == _START:
            self._state = _ITEM_OR_END if c == "[" else _STOPPED
        elif state == _AFTER_ITEM and c == ",":
            self._state = _ITEM
        elif c == "{" and state != _AFTER_ITEM:
            self._state, self._call = _CALL, CallObjectStream(index=self._num_calls)
            return i
        else:  # the array's end, or something the grammar rules out
            self._state = _STOPPED
        return i + 1

    def _read_call(self, events: list[DeltaEvent], text: str, i: int) -> int:
        call = self._call
        end = call.feed(text, i)
        if call.is_done:
            pieces = call.complete()
            if pieces is None and not call.is_committed:
                self._state = _AFTER_ITEM  # not a call: skipped
                return end
            events.extend(pieces or ())
            self._state = _AFTER_ITEM if pieces is not None else _STOPPED
        elif call.has_error:
            events.extend(call.progress())
            self._state = _STOPPED
        else:
            return end
        if call.is_committed:
            self._num_calls += 1
        self._call = None
        return end


def parse_forced_tool_calls(text: str, named_function: str | None) -> list[ToolCall]:
    """The calls in the whole text of a choice whose `tool_choice` is `named_function` (its name) or
    `required` (None): the same calls `ForcedToolCallStreamParser` streams for that text. ValueError
    if the text is not that JSON in full (cut off by `max_tokens`, say)."""
    value = loads_json(text)
    if named_function is not None:
        if not isinstance(value, dict):
            raise ValueError("the arguments of a named function must be a JSON object")
        return [ToolCall(id=make_tool_call_id(), name=named_function, arguments=dumps_json(value))]
    if not isinstance(value, list):
        raise ValueError("tool_choice 'required' expects a JSON array of calls")
    calls = [call_from_object(item) for item in value]
    if None in calls:
        raise ValueError('each call must be {"name": "...", "parameters": {...}}')
    return [ToolCall(id=make_tool_call_id(), name=name, arguments=arguments) for name, arguments in calls]
