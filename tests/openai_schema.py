"""Validates JSON instances against the component schemas of the official OpenAI API description.

    from tests.openai_schema import validate
    validate(response_json, "CreateChatCompletionResponse")   # raises jsonschema.ValidationError

The description (/work/shared/specs/openai-openapi.yaml, about 3 MB) is parsed once per process.
It is OpenAPI 3.1, whose schemas are JSON Schema 2020-12, except that some still carry OpenAPI
3.0's `nullable: true`; those are rewritten to `anyOf: [<schema>, {"type": "null"}]` first.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(os.environ.get("SPINDLE_OPENAI_SPEC", "/work/shared/specs/openai-openapi.yaml"))
_SPEC_URI = "urn:spindle:openai-openapi"


def _convert_nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_convert_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _convert_nullable(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is True:
        # Wrapping covers every form: a plain type, an enum, a $ref, or a oneOf/anyOf.
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.lru_cache(maxsize=1)
def load_spec(path: str = str(SPEC_PATH)) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, "rb") as f:
        return _convert_nullable(yaml.load(f, Loader=loader))


@functools.lru_cache(maxsize=1)
def _registry() -> Registry:
    resource = Resource(contents=load_spec(), specification=DRAFT202012)
    return Registry().with_resource(_SPEC_URI, resource)


@functools.lru_cache(maxsize=None)
def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for `#/components/schemas/<name>`."""
    if name not in load_spec()["components"]["schemas"]:
        raise KeyError(f"no component schema named {name!r} in {SPEC_PATH}")
    schema = {"$ref": f"{_SPEC_URI}#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def validate(instance: Any, name: str) -> None:
    """Raises jsonschema.ValidationError (the most relevant one) if `instance` does not match."""
    error = jsonschema.exceptions.best_match(validator(name).iter_errors(instance))
    if error is not None:
        raise error
