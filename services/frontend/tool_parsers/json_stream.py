"""Canonical JSON text of a value that is still being written.

Tool-call arguments are sent as `dumps_json(loads_json(text))`, whatever spacing or escapes the
model used, so that streamed and non-streamed calls carry the same text. `JsonStream` reads the
model's JSON a piece at a time, checks it as `json.loads` would, and writes that canonical text as
far as it is already certain: a number is written once it ends (`1` may become `1.5`), a string's
characters as they come (an unfinished escape, or a high surrogate that may pair with the next
escape, waits), closing brackets when they come. A repeated key keeps its first value (as
`loads_json` does), so nothing written has to change.

The work is linear in the text: each character is looked at once, whatever the chunking.
"""
from __future__ import annotations

import json
import math
import re

MAX_JSON_DEPTH = 128  # deeper nesting is refused (json's own recursion would fail near 1000)

_WHITESPACE = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER_RUN = re.compile(r"[0-9eE.+\-]*")
_SURROGATE = re.compile("[\ud800-\udfff]")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}

# Frame states: what an open object or array expects next.
_KEY_OR_END, _KEY, _COLON, _VALUE, _COMMA_OR_END, _ITEM_OR_END, _ITEM = range(7)
# Tokens being read.
_NONE, _STRING, _KEY_STRING, _NUMBER, _LITERAL = range(5)


def _first_wins(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        obj.setdefault(key, value)
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> object:
    """`json.loads` without NaN, Infinity or overflowing floats; a repeated key keeps its first value.

    Raises ValueError (too deep a nesting included)."""
    try:
        return json.loads(text, object_pairs_hook=_first_wins, parse_constant=_no_constant,
                          parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def dumps_json(value: object) -> str:
    """`json.dumps(value, ensure_ascii=False)`, with lone surrogates escaped so the text is UTF-8."""
    text = json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _SURROGATE.search(text) else text


class _Frame:
    __slots__ = ("is_object", "state", "is_first", "keys")

    def __init__(self, is_object: bool):
        self.is_object = is_object
        self.state = _KEY_OR_END if is_object else _ITEM_OR_END
        self.is_first = True
        self.keys: set[str] = set()


class JsonStream:
    """Reads one JSON value incrementally and writes its canonical text as far as it is certain.

    `feed(text, start)` reads `text[start:]` up to the end of the value and returns where it stopped:
    `len(text)` while the value goes on, the index just past it once `is_done`, or the index of the
    first character `json.loads` would refuse once `has_error`. Leading whitespace is skipped; a
    number ends only at the character after it, which is left unread. `drain()` returns the canonical
    text made certain since the last drain: the drained pieces always join to a prefix of
    `dumps_json(loads_json(raw))`, and to all of it once `is_done`.
    """

    def __init__(self, require_object: bool = False):
        self.is_done = False
        self.has_error = False
        self._require_object = require_object
        self._stack: list[_Frame] = []
        self._parts: list[str] = []
        self._muted_depth: int | None = None  # set while reading the value of a repeated key
        self._token = _NONE
        self._raw: list[str] = []  # the current string's raw text, or the current number's
        self._escape = ""  # an escape sequence not finished yet
        self._ends_high_surrogate = False  # `_raw[-1]` is a \uD800-\uDBFF escape
        self._literal = ""
        self._num_literal_chars = 0

    def drain(self) -> str:
        self._flush_string()
        text = "".join(self._parts)
        self._parts.clear()
        return text

    def feed(self, text: str, start: int = 0) -> int:
        i, n = start, len(text)
        while i < n and not (self.is_done or self.has_error):
            token = self._token
            if token == _STRING or token == _KEY_STRING:
                i = self._read_string(text, i)
            elif token == _NUMBER:
                i = self._read_number(text, i)
            elif token == _LITERAL:
                i = self._read_literal(text, i)
            elif text[i] in _WHITESPACE:
                i += 1
            elif self._read_structure(text[i]):
                i += 1 if self._token != _NUMBER else 0
            else:
                self.has_error = True
        return i

    def _write(self, text: str) -> None:
        if self._muted_depth is None:
            self._parts.append(text)

    def _read_structure(self, c: str) -> bool:
        """Reads one character outside tokens; False if it is not allowed here."""
        if not self._stack:
            return self._start_value(c)
        frame = self._stack[-1]
        state = frame.state
        if state == _VALUE or state == _ITEM:
            return self._start_value(c)
        if state == _ITEM_OR_END:
            return self._close() if c == "]" else self._start_value(c)
        if state == _KEY_OR_END or state == _KEY:
            if c == '"':
                self._token = _KEY_STRING
                return True
            return state == _KEY_OR_END and c == "}" and self._close()
        if state == _COLON:
            frame.state = _VALUE
            return c == ":"
        # _COMMA_OR_END
        if c == ",":
            if frame.is_object:
                frame.state = _KEY
            else:
                frame.state = _ITEM
                self._write(", ")
            return True
        return c == ("}" if frame.is_object else "]") and self._close()

    def _start_value(self, c: str) -> bool:
        if self._require_object and not self._stack and c != "{":
            return False
        if c == "{" or c == "[":
            if len(self._stack) >= MAX_JSON_DEPTH:
                return False
            self._write(c)
            self._stack.append(_Frame(is_object=c == "{"))
        elif c == '"':
            self._write('"')
            self._token = _STRING
        elif c == "-" or "0" <= c <= "9":
            self._token = _NUMBER
        elif c in _LITERALS:
            self._token, self._literal, self._num_literal_chars = _LITERAL, _LITERALS[c], 1
        else:
            return False
        return True

    def _close(self) -> bool:
        self._write("}" if self._stack.pop().is_object else "]")
        self._end_value()
        return True

    def _end_value(self) -> None:
        if self._muted_depth == len(self._stack):
            self._muted_depth = None
        if self._stack:
            self._stack[-1].state = _COMMA_OR_END
        else:
            self.is_done = True

    def _read_string(self, text: str, i: int) -> int:
        n = len(text)
        while i < n:
            if self._escape:
                if not self._read_escape(text[i]):
                    self.has_error = True
                    return i
                i += 1
                continue
            run = _STRING_RUN.match(text, i)
            if run:
                self._raw.append(run.group())
                self._ends_high_surrogate = False
                i = run.end()
                continue
            c = text[i]
            if c == '"':
                self._end_string()
                return i + 1
            if c != "\\":  # a raw control character
                self.has_error = True
                return i
            self._escape = "\\"
            i += 1
        return i

    def _read_escape(self, c: str) -> bool:
        if len(self._escape) == 1:
            if c == "u":
                self._escape = "\\u"
                return True
            if c not in '"\\/bfnrt':
                return False
            self._raw.append("\\" + c)
            self._escape, self._ends_high_surrogate = "", False
            return True
        if c not in _HEX_DIGITS:
            return False
        self._escape += c
        if len(self._escape) == 6:
            self._raw.append(self._escape)
            self._ends_high_surrogate = 0xD800 <= int(self._escape[2:], 16) <= 0xDBFF
            self._escape = ""
        return True

    def _end_string(self) -> None:
        raw = "".join(self._raw)
        self._raw.clear()
        self._ends_high_surrogate = False
        if self._token == _KEY_STRING:
            self._token = _NONE
            self._end_key(loads_json(f'"{raw}"'))
            return
        self._token = _NONE
        if raw and self._muted_depth is None:
            self._write(dumps_json(loads_json(f'"{raw}"'))[1:-1])
        self._write('"')
        self._end_value()

    def _end_key(self, key: str) -> None:
        frame = self._stack[-1]
        frame.state = _COLON
        if self._muted_depth is not None:
            return
        if key in frame.keys:
            self._muted_depth = len(self._stack)
            return
        frame.keys.add(key)
        self._write(("" if frame.is_first else ", ") + dumps_json(key) + ": ")
        frame.is_first = False

    def _flush_string(self) -> None:
        """Writes the string characters read so far, but for a high surrogate that may pair up."""
        if self._token != _STRING or not self._raw or self._muted_depth is not None:
            return
        held = self._raw.pop() if self._ends_high_surrogate else None
        raw = "".join(self._raw)
        self._raw.clear()
        if held is not None:
            self._raw.append(held)
        if raw:
            self._write(dumps_json(loads_json(f'"{raw}"'))[1:-1])

    def _read_number(self, text: str, i: int) -> int:
        end = _NUMBER_RUN.match(text, i).end()
        self._raw.append(text[i:end])
        if end == len(text):
            return end
        number = "".join(self._raw)
        self._raw.clear()
        self._token = _NONE
        try:
            value = loads_json(number)
        except ValueError:
            self.has_error = True
            return end
        self._write(dumps_json(value))
        self._end_value()
        return end

    def _read_literal(self, text: str, i: int) -> int:
        literal, n = self._literal, len(text)
        while i < n and self._num_literal_chars < len(literal):
            if text[i] != literal[self._num_literal_chars]:
                self.has_error = True
                return i
            self._num_literal_chars += 1
            i += 1
        if self._num_literal_chars == len(literal):
            self._token = _NONE
            self._write(literal)
            self._end_value()
        return i
