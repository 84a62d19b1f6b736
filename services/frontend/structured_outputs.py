"""Reads a request's output constraint: OpenAI's `response_format` and vLLM's `structured_outputs`.

- `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- `structured_outputs` (vLLM's extension; the openai client sends it through `extra_body`): exactly
  one of `json` (a schema, object or JSON text), `regex`, `choice` (strings), `grammar` (EBNF in
  xgrammar's dialect), `structural_tag` (object or JSON text) or `json_object: true`; plus
  `disable_any_whitespace` (default true here: JSON in its compact form, so a small model cannot
  loop on whitespace; false allows any whitespace, vLLM's default).

Two constraints at once (both fields, or two kinds in one) are refused. Every constraint is parsed
here (`check_constraint`) so one that does not parse gets a 400 naming its field before it reaches
the engine; results are remembered per distinct constraint, so a hundred requests with one schema
parse it once.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from services.common.grammars import GrammarError, build_grammar
from services.common.structured_outputs import MAX_SPEC_CHARS, StructuredOutputsParams
from services.frontend.errors import invalid_request

_SO_KINDS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")
_SO_OPTIONS = {"disable_any_whitespace", "disable_fallback", "disable_additional_properties", "whitespace_pattern"}
MAX_NUM_CHECKED = 1024


def parse_constraint(body: dict[str, Any]) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field it came from (for error messages), or None."""
    from_format = _from_response_format(body.get("response_format"))
    from_so = _from_structured_outputs(body.get("structured_outputs"))
    if from_format is not None and from_so is not None:
        raise invalid_request("Give one output constraint: 'response_format' or 'structured_outputs', not both.",
                              param="structured_outputs")
    found = from_format or from_so
    if found is not None and len(found[0].spec) > MAX_SPEC_CHARS:
        raise invalid_request(f"The constraint has {len(found[0].spec)} characters; at most {MAX_SPEC_CHARS}.",
                              param=found[1])
    return found


def _from_response_format(response_format: Any) -> tuple[StructuredOutputsParams, str] | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise invalid_request("'response_format' must be an object.", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams("json_object"), "response_format"
    if kind != "json_schema":
        raise invalid_request(f"response_format.type must be 'text', 'json_object' or 'json_schema' (got {kind!r}).",
                              param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_request("response_format.json_schema must be an object with 'name' and 'schema'.",
                              param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise invalid_request("response_format.json_schema.name must be a string of 1 to 64 characters.",
                              param="response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_request("response_format.json_schema.strict must be a boolean.",
                              param="response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: the schema is optional
    param = "response_format.json_schema.schema"
    return StructuredOutputsParams("json", _schema_text(schema, param)), param


def _from_structured_outputs(so: Any) -> tuple[StructuredOutputsParams, str] | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise invalid_request("'structured_outputs' must be an object.", param="structured_outputs")
    unknown = sorted(set(so) - set(_SO_KINDS) - _SO_OPTIONS)
    if unknown:
        raise invalid_request(f"Unknown field structured_outputs.{unknown[0]}.", param=f"structured_outputs.{unknown[0]}")
    for option in ("disable_fallback", "disable_additional_properties"):
        if so.get(option) not in (None, False, True):
            raise invalid_request(f"structured_outputs.{option} must be a boolean.", param=f"structured_outputs.{option}")
    if so.get("whitespace_pattern") is not None:
        raise invalid_request("structured_outputs.whitespace_pattern is not supported.",
                              param="structured_outputs.whitespace_pattern")
    compact = so.get("disable_any_whitespace", True)
    if not isinstance(compact, bool):
        raise invalid_request("structured_outputs.disable_any_whitespace must be a boolean.",
                              param="structured_outputs.disable_any_whitespace")
    kinds = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise invalid_request(f"Give exactly one of structured_outputs.{', '.join(_SO_KINDS)} (got {', '.join(kinds)}).",
                              param="structured_outputs")
    kind = kinds[0]
    value, param = so[kind], f"structured_outputs.{kind}"
    if kind == "json":
        return StructuredOutputsParams("json", _schema_text(value, param), any_whitespace=not compact), param
    if kind == "json_object":
        if value is not True:
            raise invalid_request(f"{param} must be true.", param=param)
        return StructuredOutputsParams("json_object", any_whitespace=not compact), param
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid_request(f"{param} must be a non-empty array of non-empty strings.", param=param)
        return StructuredOutputsParams("choice", json.dumps(value, ensure_ascii=False)), param
    if kind == "structural_tag":
        if isinstance(value, dict):
            value = json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str):
            raise invalid_request(f"{param} must be an object or its JSON text.", param=param)
        return StructuredOutputsParams("structural_tag", value), param
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{param} must be a non-empty string.", param=param)
    return StructuredOutputsParams(kind, value), param


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid_request(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise invalid_request(f"{param} must be a JSON schema object.", param=param)
    _check_meta_schema(schema, param)
    return json.dumps(schema, ensure_ascii=False, sort_keys=False)


def _check_meta_schema(schema: dict, param: str) -> None:
    """A schema that breaks JSON Schema's own rules (e.g. `"type": 3`), with jsonschema's reason."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise invalid_request(f"{param} is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else ""),
                              param=param) from None


class ConstraintChecker:
    """Parses each distinct constraint once with the grammar engine; remembers the outcome."""

    def __init__(self, max_num_checked: int = MAX_NUM_CHECKED):
        self.max_num_checked = max_num_checked
        self._outcomes: OrderedDict[str, str | None] = OrderedDict()  # key -> error message or None
        self._lock = threading.Lock()  # large constraints are checked on tokenizer threads

    def check(self, params: StructuredOutputsParams, param: str) -> None:
        """Raises a 400 naming `param` if the constraint does not parse."""
        key = params.key
        with self._lock:
            is_known = key in self._outcomes
            if is_known:
                self._outcomes.move_to_end(key)
                error = self._outcomes[key]
        if not is_known:
            try:
                build_grammar(params)
                error = None
            except GrammarError as exc:
                error = str(exc)
            with self._lock:
                self._outcomes[key] = error
                if len(self._outcomes) > self.max_num_checked:
                    self._outcomes.popitem(last=False)
        if error is not None:
            raise invalid_request(f"{param} does not compile: {error}", param=param)
