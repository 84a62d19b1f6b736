"""Limits met before work, and JSON the parser cannot take (the scripted engine).

A body over --max-request-body-bytes is 413 at once: by its Content-Length before a byte of it is
read, or, chunked, as soon as it passes the limit, never read to its end. A lone UTF-16 surrogate,
nesting past MAX_JSON_DEPTH or a body that is not UTF-8 is a 400 naming the problem on every JSON
route; ordinary escapes (an emoji as a surrogate pair, a literal backslash) still pass. A public
gRPC message over --max-grpc-message-bytes is RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.common.pb import generate_pb2
from services.frontend.json_body import MAX_JSON_DEPTH
from services.frontend.public_edge import EdgeConfig
from tests.frontend.edge_fakes import edge_client, edge_grpc, read_response, stub_at
from tests.frontend.fakes import FakeEngineClient, make_tokenizer
from tests.openai_schema import validate

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
MiB = 2**20
# How long a refusal may take: generous, and far below what reading 20 MiB from a client that never
# sends it would take (forever).
REFUSAL_TIMEOUT_S = 10.0


def _headers(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{extra}\r\n").encode()


def _raw_exchange(edge: EdgeConfig, send):
    """Runs `send(writer)` against the app over a raw connection; returns the response and the engine."""
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with edge_client(engine, edge) as client:
            reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
            try:
                await send(writer)
                response = await asyncio.wait_for(read_response(reader), REFUSAL_TIMEOUT_S)
            finally:
                writer.close()
            return response, engine

    return asyncio.run(scenario())


def _assert_413(response, limit: int) -> None:
    status, headers, payload = response
    assert status == 413
    validate(payload, "ErrorResponse")
    assert payload["error"]["code"] == "request_too_large" and str(limit) in payload["error"]["message"]
    assert headers["connection"] == "close"


def test_content_length_over_the_limit_is_413_before_the_body_is_read():
    limit = 16 * MiB

    async def send(writer):
        # 20 MiB announced, 1 KiB sent, then nothing: only a server that did not wait for the body answers.
        writer.write(_headers(CHAT, f"Content-Length: {20 * MiB}\r\n") + b'{"messages": [' + b" " * 1024)
        await writer.drain()

    response, engine = _raw_exchange(EdgeConfig(max_request_body_bytes=limit), send)
    _assert_413(response, limit)
    assert engine.requests == []


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    limit = 1 * MiB

    async def send(writer):
        writer.write(_headers(COMPLETIONS, "Transfer-Encoding: chunked\r\n"))
        chunk = b"x" * (64 * 1024)
        for _ in range(24):  # 1.5 MiB, and never the last chunk: the body has no end
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()

    response, engine = _raw_exchange(EdgeConfig(max_request_body_bytes=limit), send)
    _assert_413(response, limit)
    assert engine.requests == []


def test_a_body_within_the_limit_is_read():
    body = json.dumps({"prompt": "Hello " + "x" * (MiB - 100), "max_tokens": 1}).encode()

    async def send(writer):
        writer.write(_headers(TOKENIZE, f"Content-Length: {len(body)}\r\n") + body)
        await writer.drain()

    (status, _, payload), _ = _raw_exchange(EdgeConfig(max_request_body_bytes=len(body)), send)
    assert status == 200 and payload["count"] > 0


# --- JSON the parser cannot take ------------------------------------------------------------------
ROUTE_BODIES = {  # each route's body, with PLACE where the bad string goes
    CHAT: '{"messages": [{"role": "user", "content": PLACE}]}',
    COMPLETIONS: '{"prompt": PLACE, "max_tokens": 2}',
    TOKENIZE: '{"prompt": PLACE}',
    DETOKENIZE: '{"tokens": [1, 2], "user": PLACE}',
}
PARAM_OF = {CHAT: "messages[0].content", COMPLETIONS: "prompt", TOKENIZE: "prompt", DETOKENIZE: "user"}


def _nested(depth: int) -> str:
    """A JSON value that is `depth` levels deep on its own (inside the body: one more)."""
    return "[" * depth + "]" * depth


BAD_BODIES = {
    "lone-high-surrogate": (lambda path: ROUTE_BODIES[path].replace("PLACE", r'"Hi \ud800 there"'),
                            "lone UTF-16 surrogate (\\ud800)"),
    "lone-low-surrogate": (lambda path: ROUTE_BODIES[path].replace("PLACE", r'"\udc00"'),
                           "lone UTF-16 surrogate (\\udc00)"),
    "surrogate-in-a-key": (lambda path: ROUTE_BODIES[path].replace("PLACE", '"Hi"').replace("{", r'{"\ud800": 1, ', 1),
                           "a top-level key holds a lone UTF-16 surrogate"),
    "nested-10000-arrays": (lambda path: ROUTE_BODIES[path].replace("PLACE", '"Hi"')[:-1] + ', "x": '
                            + _nested(10_000) + "}", f"more than {MAX_JSON_DEPTH} levels deep"),
    "nested-10000-objects": (lambda path: '{"a": ' * 10_000 + "1" + "}" * 10_000,
                             f"more than {MAX_JSON_DEPTH} levels deep"),
    # json.loads refuses integer literals past 4,300 digits with a plain ValueError.
    "integer-of-5000-digits": (lambda path: ROUTE_BODIES[path].replace("PLACE", '"Hi"')[:-1] + ', "x": '
                               + "9" * 5000 + "}", "a number in the body is too long"),
    "nested-just-past-the-limit": (lambda path: ROUTE_BODIES[path].replace("PLACE", '"Hi"')[:-1] + ', "x": '
                                   + _nested(MAX_JSON_DEPTH) + "}", f"more than {MAX_JSON_DEPTH} levels deep"),
}


def _post_raw(path: str, body: bytes):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with edge_client(engine) as client:
            response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
            return response.status, await response.json(), engine

    return asyncio.run(scenario())


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
@pytest.mark.parametrize("path", sorted(ROUTE_BODIES))
def test_unparsable_json_is_400_naming_the_problem(path, case):
    make_body, problem = BAD_BODIES[case]
    status, payload, engine = _post_raw(path, make_body(path).encode())
    assert status == 400, payload
    validate(payload, "ErrorResponse")
    assert payload["error"]["type"] == "invalid_request_error"
    assert problem in payload["error"]["message"]
    if case.startswith("lone"):
        assert payload["error"]["param"] == PARAM_OF[path]
    assert engine.requests == []


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_number_past_the_float_range_is_400_naming_the_field(path, field):
    body = ROUTE_BODIES[path].replace("PLACE", '"Hi"')[:-1] + f', "{field}": 1{"0" * 400}}}'
    status, payload, engine = _post_raw(path, body.encode())
    assert status == 400, payload
    validate(payload, "ErrorResponse")
    assert payload["error"]["param"] == field
    assert engine.requests == []


@pytest.mark.parametrize("path", sorted(ROUTE_BODIES))
def test_a_utf8_encoded_surrogate_is_400(path):
    body = ROUTE_BODIES[path].replace("PLACE", '"Hi \ud800"').encode("utf-8", "surrogatepass")
    status, payload, _ = _post_raw(path, body)
    assert status == 400 and "not valid UTF-8" in payload["error"]["message"]
    validate(payload, "ErrorResponse")


def test_ordinary_escapes_and_nesting_within_the_limit_pass():
    # An emoji written as a surrogate pair (as json.dumps writes it), a literal backslash-u text,
    # and an unknown field nested exactly to the limit (the body itself is the first level).
    body = (r'{"prompt": "Hi \ud83d\ude00 and \\ud800", "x": ' + _nested(MAX_JSON_DEPTH - 1) + "}").encode()
    status, payload, _ = _post_raw(TOKENIZE, body)
    assert status == 200, payload
    assert payload["tokens"] == make_tokenizer().encode("Hi 😀 and \\ud800")


# --- gRPC message limit ---------------------------------------------------------------------------
def test_grpc_message_over_the_limit_is_resource_exhausted():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with edge_grpc(engine, max_receive_message_bytes=MiB) as address, stub_at(address) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as too_big:
                await stub.Tokenize(generate_pb2.TokenizeRequest(text="x" * (2 * MiB)))
            small = await stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello"))
        return too_big.value.code(), small, engine

    code, small, engine = asyncio.run(scenario())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list(small.token_ids) == make_tokenizer().encode("Hello")
