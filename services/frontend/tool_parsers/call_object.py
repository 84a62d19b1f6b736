"""One tool call written as a JSON object: `{"name": "...", "arguments": {...}}`.

Hermes, Llama 3 and the forced (`tool_choice` required) format all write calls this way, and differ
only in what surrounds the objects. `CallObjectStream` reads one such object incrementally, with a
`JsonStream` for each member value, and turns it into `DeltaToolCall` pieces.

A call is committed, and its first piece sent, once its name is complete and its arguments have
begun with `{` (or the object has ended): a name alone could still belong to an object that turns
out not to be a call. After that the arguments stream as their canonical text becomes certain. The
object is valid when `loads_json` reads it, `name` is a non-empty string, and `arguments` (or
`parameters`; the first of them present) is an object or absent (no arguments: `{}`). Other members
are ignored; a repeated member keeps its first value.
"""
from __future__ import annotations

import logging

from services.frontend.tool_parsers.abstract_tool_parser import DeltaToolCall, make_tool_call_id
from services.frontend.tool_parsers.json_stream import JsonStream, dumps_json, loads_json

logger = logging.getLogger(__name__)

ARGUMENTS_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"
_START, _KEY_OR_END, _KEY, _COLON, _VALUE, _COMMA_OR_END = range(6)
_KEY_ROLE, _NAME_ROLE, _ARGUMENTS_ROLE, _OTHER_ROLE = range(4)


def call_from_object(obj: object) -> tuple[str, str] | None:
    """(name, arguments text) of a parsed call object, or None if it is not a valid call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    key = next((k for k in obj if k in ARGUMENTS_KEYS), None)
    arguments = obj[key] if key is not None else {}
    if not (isinstance(name, str) and name and isinstance(arguments, dict)):
        return None
    return name, dumps_json(arguments)


# What became of a call object after a feed (`read_call`).
CALL_PENDING, CALL_DONE, CALL_DROPPED, CALL_BAD = range(4)


def read_call(call: "CallObjectStream", events: list, text: str) -> tuple[int, int]:
    """Feeds `text` to `call`; returns where it stopped and the outcome: CALL_PENDING (it needs more
    text), CALL_DONE (a valid call: its last pieces are in `events`), CALL_DROPPED (broken after its
    first piece went out: it keeps what was sent) or CALL_BAD (broken before: its text is content)."""
    end = call.feed(text)
    if call.is_done:
        pieces = call.complete()
        if pieces is not None:
            events.extend(pieces)
            return end, CALL_DONE
    elif not call.has_error:
        return end, CALL_PENDING
    return end, CALL_DROPPED if call.is_committed else CALL_BAD


class CallObjectStream:
    """Reads one call object; `feed` as `JsonStream.feed`: returns where it stopped, which is just
    past the closing `}` once `is_done`, or at the first offending character once `has_error`.

    `progress()` commits the call when it can and returns the pieces that became certain (streaming
    only); `complete()`, once `is_done`, validates the whole object and returns the remaining pieces,
    or None if the object is not a valid call.
    """

    def __init__(self, index: int):
        self.index = index
        self.is_done = False
        self.has_error = False
        self.is_committed = False
        self._id = make_tool_call_id()
        self._raw: list[str] = []
        self._state = _START
        self._child: JsonStream | None = None
        self._child_role = _KEY_ROLE
        self._keys: set[str] = set()
        self._key = ""
        self._name: str | None = None
        self._arguments: JsonStream | None = None
        self._sent_arguments: list[str] = []

    @property
    def raw_text(self) -> str:
        """The text read so far, for a caller that gives up on the call and keeps it as content."""
        return "".join(self._raw)

    def feed(self, text: str, start: int = 0) -> int:
        i, n = start, len(text)
        while i < n and not (self.is_done or self.has_error):
            child = self._child
            if child is not None:
                i = child.feed(text, i)
                if child.has_error:
                    self.has_error = True
                elif child.is_done:
                    self._end_child(child)
                continue
            c = text[i]
            if c in _WHITESPACE:
                i += 1
                continue
            if not self._read_structure(c):
                self.has_error = True
                break
            if self._child is None:
                i += 1
        self._raw.append(text[start:i])
        return i

    def _read_structure(self, c: str) -> bool:
        """Reads one character between members, or starts a child stream that will read it."""
        state = self._state
        if state == _START:
            self._state = _KEY_OR_END
            return c == "{"
        if state == _KEY_OR_END or state == _KEY:
            if c == '"':
                self._child, self._child_role = JsonStream(), _KEY_ROLE
                return True
            if state == _KEY_OR_END and c == "}":
                self.is_done = True
                return True
            return False
        if state == _COLON:
            self._state = _VALUE
            return c == ":"
        if state == _VALUE:
            return self._start_value(c)
        if c == ",":
            self._state = _KEY
            return True
        self.is_done = c == "}"
        return self.is_done

    def _start_value(self, c: str) -> bool:
        key, is_repeated = self._key, self._key in self._keys
        self._keys.add(key)
        if not is_repeated and key == "name":
            self._child, self._child_role = JsonStream(), _NAME_ROLE
        elif not is_repeated and key in ARGUMENTS_KEYS and self._arguments is None:
            if c != "{":
                return False  # arguments must be an object
            self._arguments = JsonStream()
            self._child, self._child_role = self._arguments, _ARGUMENTS_ROLE
        else:
            self._child, self._child_role = JsonStream(), _OTHER_ROLE
        return True

    def _end_child(self, child: JsonStream) -> None:
        self._child = None
        role = self._child_role
        if role == _KEY_ROLE:
            self._key = loads_json(child.drain())
            self._state = _COLON
            return
        self._state = _COMMA_OR_END
        if role == _NAME_ROLE:
            name = loads_json(child.drain())
            if isinstance(name, str) and name:
                self._name = name
            else:
                self.has_error = True

    def _first_piece(self) -> DeltaToolCall:
        self.is_committed = True
        return DeltaToolCall(index=self.index, id=self._id, name=self._name, arguments="")

    def progress(self) -> list[DeltaToolCall]:
        pieces: list[DeltaToolCall] = []
        if not self.is_committed:
            if self._name is None or self._arguments is None:
                return pieces
            pieces.append(self._first_piece())
        fragment = self._arguments.drain() if self._arguments is not None else ""
        if fragment:
            self._sent_arguments.append(fragment)
            pieces.append(DeltaToolCall(index=self.index, id=None, name=None, arguments=fragment))
        return pieces

    def complete(self) -> list[DeltaToolCall] | None:
        try:
            call = call_from_object(loads_json(self.raw_text))
        except ValueError:
            return None
        if call is None:
            return None
        text = call[1]
        pieces = [] if self.is_committed else [self._first_piece()]
        sent = "".join(self._sent_arguments)
        if not text.startswith(sent):  # cannot happen while JsonStream agrees with json.dumps
            logger.error("streamed arguments %r are not a prefix of %r", sent[:200], text[:200])
            return pieces
        if len(text) > len(sent):
            pieces.append(DeltaToolCall(index=self.index, id=None, name=None, arguments=text[len(sent):]))
        return pieces
