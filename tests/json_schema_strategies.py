"""Hypothesis strategies for the JSON values a JSON Schema (2020-12) accepts.

    from tests.json_schema_strategies import from_schema
    bodies = from_schema(schema, resolve)   # resolve("#/components/schemas/X") -> that schema

It covers the keywords the OpenAI request schemas use: `type` (one or a list), `enum`, `const`,
`$ref`, `allOf` (merged), `anyOf` / `oneOf` (one branch), `properties` / `required` /
`additionalProperties`, `prefixItems` / `items` / `minItems` / `maxItems`, `minimum` / `maximum` (and the exclusive
forms), `minLength` / `maxLength`; annotations (`description`, `format`, `discriminator`, ...) are
ignored. A value drawn from a `oneOf` branch may match a second branch too, so callers that need
strictly valid values filter with a validator. Sizes are capped (`MAX_ITEMS`, `MAX_TEXT`) so that
bodies stay small enough to send hundreds of.

(hypothesis-jsonschema, the usual choice, no longer runs on current Hypothesis: its object strategy
calls a private `many.more()` that Hypothesis removed.)
"""
from __future__ import annotations

import math
from typing import Any, Callable

from hypothesis import strategies as st

MAX_ITEMS = 4
MAX_TEXT = 24
MAX_EXTRA_PROPERTIES = 2
Resolve = Callable[[str], dict[str, Any]]

# Any JSON value, as an unknown field's value or an item of an untyped array.
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=MAX_TEXT)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def from_schema(schema: Any, resolve: Resolve) -> st.SearchStrategy[Any]:
    """Values `schema` accepts (best effort for `oneOf`, see the module's docstring)."""
    if schema is True or schema == {}:
        return JSON_VALUES
    if schema is False:
        return st.nothing()
    schema = flatten(schema, resolve)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return st.one_of([from_schema(merge(rest, flatten(b, resolve)), resolve) for b in branches])
    types = schema.get("type")
    if types is None:  # untyped: what its keywords say, else anything
        types = "object" if "properties" in schema else "array" if "items" in schema else None
    if types is None:
        return JSON_VALUES
    if isinstance(types, list):
        return st.one_of([from_schema({**schema, "type": t}, resolve) for t in types])
    return _TYPED[types](schema, resolve)


def flatten(schema: dict[str, Any], resolve: Resolve) -> dict[str, Any]:
    """The schema with a top-level `$ref` and `allOf` merged into it (nested ones stay)."""
    while "$ref" in schema or "allOf" in schema:
        if "$ref" in schema:
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = merge(resolve(schema["$ref"]), rest)
        else:
            parts = schema["allOf"]
            schema = {k: v for k, v in schema.items() if k != "allOf"}
            for part in parts:
                schema = merge(schema, flatten(part, resolve))
    return schema


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Both schemas at once, for the object and scalar shapes the request schemas combine."""
    out = dict(a)
    for key, value in b.items():
        if key == "properties" and key in out:  # a property in both must match both
            out[key] = {**out[key], **{k: {"allOf": [out[key][k], v]} if k in out[key] else v
                                       for k, v in value.items()}}
        elif key == "type" and key in out:
            out[key] = _common_types(out[key], value)
        elif key == "required" and key in out:
            out[key] = sorted(set(out[key]) | set(value))
        elif key in ("minimum", "minItems", "minLength") and key in out:
            out[key] = max(out[key], value)
        elif key in ("maximum", "maxItems", "maxLength") and key in out:
            out[key] = min(out[key], value)
        else:
            out[key] = value
    return out


def _common_types(a: str | list[str], b: str | list[str]) -> list[str]:
    a_types, b_types = {a} if isinstance(a, str) else set(a), {b} if isinstance(b, str) else set(b)
    common = a_types & b_types
    # Every integer is a number.
    if ("integer" in a_types and "number" in b_types) or ("number" in a_types and "integer" in b_types):
        common.add("integer")
    return sorted(common)


def _string(schema: dict[str, Any], resolve: Resolve) -> st.SearchStrategy[str]:
    min_size = schema.get("minLength", 0)
    return st.text(min_size=min_size, max_size=max(min_size, min(schema.get("maxLength", MAX_TEXT), MAX_TEXT)))


def _bounds(schema: dict[str, Any]) -> tuple[float | None, bool, float | None, bool]:
    """(low, is low excluded, high, is high excluded)."""
    low, high = schema.get("minimum"), schema.get("maximum")
    low_out = high_out = False
    if "exclusiveMinimum" in schema and (low is None or schema["exclusiveMinimum"] >= low):
        low, low_out = schema["exclusiveMinimum"], True
    if "exclusiveMaximum" in schema and (high is None or schema["exclusiveMaximum"] <= high):
        high, high_out = schema["exclusiveMaximum"], True
    return low, low_out, high, high_out


def _integer(schema: dict[str, Any], resolve: Resolve) -> st.SearchStrategy[int]:
    low, low_out, high, high_out = _bounds(schema)
    low = None if low is None else math.floor(low) + 1 if low_out else math.ceil(low)
    high = None if high is None else math.ceil(high) - 1 if high_out else math.floor(high)
    return st.nothing() if low is not None and high is not None and low > high else st.integers(low, high)


def _number(schema: dict[str, Any], resolve: Resolve) -> st.SearchStrategy[float | int]:
    low, low_out, high, high_out = _bounds(schema)
    floats = st.floats(low, high, allow_nan=False, allow_infinity=False, exclude_min=low_out and low is not None,
                       exclude_max=high_out and high is not None)
    return floats | _integer(schema, resolve)


def _array(schema: dict[str, Any], resolve: Resolve) -> st.SearchStrategy[list]:
    prefix = [from_schema(item, resolve) for item in schema.get("prefixItems", ())]
    items = from_schema(schema.get("items", True), resolve)
    min_size = max(schema.get("minItems", 0) - len(prefix), 0)
    max_size = max(min_size, min(schema.get("maxItems", MAX_ITEMS), MAX_ITEMS) - len(prefix))
    rest = st.lists(items, min_size=min_size, max_size=max_size)
    return st.builds(lambda first, more: [*first, *more], st.tuples(*prefix), rest) if prefix else rest


def _object(schema: dict[str, Any], resolve: Resolve) -> st.SearchStrategy[dict]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = st.fixed_dictionaries(
        {k: from_schema(properties.get(k, True), resolve) for k in sorted(required)},
        optional={k: from_schema(v, resolve) for k, v in properties.items() if k not in required})
    extra = schema.get("additionalProperties", True)
    if extra is False:
        return fixed
    names = st.text(max_size=12).filter(lambda k: k not in properties)
    extras = st.dictionaries(names, from_schema(extra, resolve), max_size=MAX_EXTRA_PROPERTIES)
    return st.builds(lambda known, more: {**more, **known}, fixed, extras)


_TYPED: dict[str, Callable[[dict[str, Any], Resolve], st.SearchStrategy[Any]]] = {
    "string": _string,
    "integer": _integer,
    "number": _number,
    "boolean": lambda schema, resolve: st.booleans(),
    "null": lambda schema, resolve: st.none(),
    "array": _array,
    "object": _object,
}
