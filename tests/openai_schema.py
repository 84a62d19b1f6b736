"""Validates JSON instances against the component schemas of the official OpenAI API description.

    from tests.openai_schema import validate, validate_body, validate_sse
    validate(response_json, "CreateChatCompletionResponse")   # raises jsonschema.ValidationError
    body = validate_body(raw_bytes, "CreateCompletionResponse")  # the body as sent, parsed
    chunks = validate_sse(lines, "CreateChatCompletionStreamResponse")  # every `data:` event as sent
    resp = create(client.chat.completions, "CreateChatCompletionResponse", model=..., messages=...)

Tests validate what went over the wire, never an object a client library rebuilt (that can drop a
missing field or fill in a default). The description (/work/shared/specs/openai-openapi.yaml, about
3 MB) is parsed once per process. It is OpenAPI 3.1, whose schemas are JSON Schema 2020-12, except
that some still carry OpenAPI 3.0's `nullable: true`; those are rewritten to
`anyOf: [<schema>, {"type": "null"}]` first.
"""
from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(os.environ.get("SPINDLE_OPENAI_SPEC", "/work/shared/specs/openai-openapi.yaml"))
_SPEC_URI = "urn:spindle:openai-openapi"

# The one departure from the description. It has no schema for a streamed completion chunk:
# #/components/schemas/CreateCompletionResponse says "both the streamed and non-streamed response
# objects share the same shape", yet its
# #/components/schemas/CreateCompletionResponse/properties/choices/items/properties/finish_reason
# is a required, non-nullable string, while OpenAI's API (and every client) sends `null` there in
# each chunk but a choice's last. This schema is that one with only that field made nullable;
# chat chunks need nothing of the kind (CreateChatCompletionStreamResponse marks it nullable).
COMPLETION_CHUNK = "CreateCompletionResponse.streamed"


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


def _completion_chunk_schema(schemas: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(schemas["CreateCompletionResponse"])
    choice = schema["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    return schema


@functools.lru_cache(maxsize=1)
def load_spec(path: str = str(SPEC_PATH)) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, "rb") as f:
        spec = _convert_nullable(yaml.load(f, Loader=loader))
    schemas = spec["components"]["schemas"]
    schemas[COMPLETION_CHUNK] = _completion_chunk_schema(schemas)
    return spec


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


def validate_body(body: str | bytes, name: str) -> Any:
    """Parses a response body exactly as it was sent, validates it and returns the parsed JSON."""
    instance = json.loads(body)
    validate(instance, name)
    return instance


def validate_sse(lines: Iterable[str | bytes], name: str) -> list[dict[str, Any]]:
    """Validates each `data:` event of a server-sent event stream, as sent, against `name`.

    `lines` are the stream's lines without their line ends (blank lines separate events). The
    stream must end with `data: [DONE]`; an `error` object (a failure mid-stream) is checked as an
    ErrorResponse. Returns the parsed chunks, without the [DONE].
    """
    chunks: list[dict[str, Any]] = []
    is_done = False
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if not line:
            continue
        assert not is_done, f"event after data: [DONE]: {line!r}"
        assert line.startswith("data: "), f"not a data line: {line!r}"
        payload = line[len("data: "):]
        if payload == "[DONE]":
            is_done = True
            continue
        chunk = json.loads(payload)
        validate(chunk, "ErrorResponse" if "error" in chunk else name)
        chunks.append(chunk)
    assert is_done, "the stream did not end with data: [DONE]"
    return chunks


# --- through the official openai client, validating the bytes it received ------------------------
def create(endpoint: Any, schema: str, **kwargs: Any) -> Any:
    """`endpoint.create(**kwargs)` (e.g. `client.chat.completions`), its JSON body validated as sent;
    returns the client's parsed object."""
    raw = endpoint.with_raw_response.create(**kwargs)
    validate_body(raw.content, schema)
    return raw.parse()


async def acreate(endpoint: Any, schema: str, **kwargs: Any) -> Any:
    """`create` for an AsyncOpenAI client's endpoint."""
    raw = await endpoint.with_raw_response.create(**kwargs)
    validate_body(raw.content, schema)
    return raw.parse()


def stream(endpoint: Any, schema: str, **kwargs: Any) -> list[dict[str, Any]]:
    """A streamed `endpoint.create(**kwargs)`: every SSE event validated as sent; the parsed chunks."""
    with endpoint.with_streaming_response.create(stream=True, **kwargs) as response:
        return validate_sse(response.iter_lines(), schema)


async def astream(endpoint: Any, schema: str, **kwargs: Any) -> list[dict[str, Any]]:
    """`stream` for an AsyncOpenAI client's endpoint."""
    async with endpoint.with_streaming_response.create(stream=True, **kwargs) as response:
        return validate_sse([line async for line in response.iter_lines()], schema)
