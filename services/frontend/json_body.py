"""Parses a request's JSON body, refusing with a 400 what the rest of the server could not take.

Beyond malformed JSON that is: a body that is not UTF-8 (RFC 8259 asks for UTF-8; Python's parser
would otherwise let UTF-8-encoded surrogates through), a lone UTF-16 surrogate written as an escape
(`"\\ud800"`: valid JSON, but no Unicode text, so the tokenizer and the response encoder would fail
on it), and nesting deeper than MAX_JSON_DEPTH. The checks past parsing cost almost nothing on
ordinary bodies: they run only when a cheap scan of the raw text says they could fail.
"""
from __future__ import annotations

import json
import re
from typing import Any

from services.frontend.errors import APIError, invalid_request

# Far above what real requests nest (a JSON schema in response_format adds two levels per nested
# object), far below where Python's parser gives up (about 1,000 levels, less the stack in use).
MAX_JSON_DEPTH = 128

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; a 400 naming the problem otherwise."""
    try:
        text = raw.decode(json.detect_encoding(raw))  # strict: no surrogates smuggled in as bytes
    except UnicodeDecodeError as exc:
        raise _unparsable(f"the body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _unparsable(str(exc)) from None
    except RecursionError:
        raise too_deep() from None
    except ValueError as exc:  # an integer literal past Python's digit limit (4,300 digits)
        raise _unparsable(f"a number in the body is too long: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    # Nesting needs as many brackets: fewer in all, and the body cannot be too deep.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        _check_depth(body)
    # Only an escape can make a surrogate once the text decoded strictly (paired ones make a character).
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(body)
    return body


def too_deep() -> APIError:
    return _unparsable(f"it nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")


def _unparsable(why: str, param: str | None = None) -> APIError:
    return invalid_request(f"We could not parse the JSON body of your request: {why}.", param=param)


def _check_depth(body: Any) -> None:
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _check_strings(body: Any) -> None:
    """Refuses the first string (key or value) holding a lone surrogate, naming where it is."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, f"'{path}'", path)
        elif isinstance(value, dict):
            for key, child in value.items():
                _check_text(key, f"a key of '{path}'" if path else "a top-level key", path or None)
                stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(value, list):  # scalars other than strings are skipped without building paths
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(value)
                         if isinstance(child, (str, dict, list)))


def _check_text(text: str, where: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code_point = ord(text[exc.start])
        raise _unparsable(f"{where} holds a lone UTF-16 surrogate (\\u{code_point:04x}), which is not text",
                          param=param) from None
