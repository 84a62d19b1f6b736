"""API keys on the HTTP and gRPC faces, and request ids scoped to their caller (the scripted engine).

HTTP: no key, a wrong key or another scheme is 401 with an OpenAI error object on every route but
/health (and /metrics unless --protect-metrics); a right key is served. gRPC: UNAUTHENTICATED
before any handler runs, health exempt. Abort: only the caller that started a request may end it;
anyone else gets NOT_FOUND and the request finishes untouched.
"""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import generate_pb2
from services.frontend.api_keys import MISSING_KEY, WRONG_KEY, ApiKeys, bearer_token
from services.frontend.config import FrontendConfig
from services.frontend.public_edge import EdgeConfig
from services.frontend.server import FrontendServer
from tests.frontend.edge_fakes import GatedEngine, bearer, edge_client, edge_grpc, read_rest, stub_at
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model
from tests.openai_schema import validate

KEY, OTHER_KEY = "sk-test-4f1c9e", "sk-other-77ab02"
KEYED = EdgeConfig(api_keys=(KEY, OTHER_KEY))
COMPLETION = {"prompt": "Hello", "max_tokens": 3}
STOP = generate_pb2.GenerateResponse.FINISH_REASON_STOP


def _http(edge: EdgeConfig, calls):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with edge_client(engine, edge) as client:
            results = []
            for method, path, headers in calls:
                json_body = COMPLETION if method == "POST" else None
                response = await client.request(method, path, json=json_body, headers=headers)
                results.append((response.status, dict(response.headers), await response.text()))
            return results, engine

    return asyncio.run(scenario())


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/version"), ("GET", "/stats"),
          ("GET", "/no/such/route")]


@pytest.mark.parametrize("authorization, message", [
    (None, MISSING_KEY),
    ("Bearer sk-wrong", WRONG_KEY),
    (f"Bearer {KEY}x", WRONG_KEY),
    (f"Bearer {KEY[:-1]}", WRONG_KEY),
    (f"Basic {KEY}", MISSING_KEY),  # not a bearer token at all
    (KEY, MISSING_KEY),
    ("Bearer ", MISSING_KEY),
])
def test_http_without_the_right_key_is_401_on_every_route(authorization, message):
    headers = {} if authorization is None else {"Authorization": authorization}
    results, engine = _http(KEYED, [(method, path, headers) for method, path in ROUTES])
    for (method, path), (status, response_headers, text) in zip(ROUTES, results):
        assert status == 401, (method, path, text)
        payload = json.loads(text)
        validate(payload, "ErrorResponse")
        assert payload == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}
        assert response_headers["WWW-Authenticate"] == "Bearer"
    assert engine.requests == []  # refused before any handler ran


@pytest.mark.parametrize("authorization", [f"Bearer {KEY}", f"Bearer {OTHER_KEY}", f"bearer {KEY}",
                                           f"  Bearer   {KEY}  "])
def test_http_with_a_right_key_is_served(authorization):
    results, engine = _http(KEYED, [("POST", "/v1/completions", {"Authorization": authorization}),
                                    ("GET", "/v1/models", {"Authorization": authorization})])
    assert [status for status, _, _ in results] == [200, 200], results
    assert len(engine.requests) == 1


def test_health_is_open_and_metrics_open_unless_protected():
    calls = [("GET", "/health", {}), ("GET", "/metrics", {}), ("GET", "/metrics", {"Authorization": f"Bearer {KEY}"})]
    (health, metrics, keyed_metrics), _ = _http(KEYED, calls)
    assert health[0] == 200 and metrics[0] == 200 and keyed_metrics[0] == 200
    assert "# TYPE spindle:" in metrics[2]  # the Prometheus text, not an error

    protected = EdgeConfig(api_keys=(KEY,), protect_metrics=True)
    (health, metrics, keyed_metrics), _ = _http(protected, calls)
    assert health[0] == 200 and metrics[0] == 401 and keyed_metrics[0] == 200


def test_without_keys_every_route_is_open():
    results, _ = _http(EdgeConfig(), [("POST", "/v1/completions", {}), ("GET", "/metrics", {}),
                                      ("POST", "/v1/completions", {"Authorization": "Bearer anything"})])
    assert [status for status, _, _ in results] == [200, 200, 200]


def test_keys_are_never_logged_nor_echoed(caplog):
    caplog.set_level(logging.DEBUG)
    calls = [("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"}),
             ("POST", "/v1/completions", {"Authorization": "Bearer sk-guess-123"}),
             ("GET", "/nope", {"Authorization": f"Bearer {KEY}"})]
    results, _ = _http(KEYED, calls)
    logged = caplog.text + "".join(repr(r.args) for r in caplog.records)
    for secret in (KEY, OTHER_KEY, "sk-guess-123"):
        assert secret not in logged
        assert all(secret not in text for _, _, text in results)
    assert KEY not in repr(FrontendConfig(edge=KEYED)) and KEY not in str(KEYED)


def test_identity_names_the_key_not_its_value():
    keys = ApiKeys([KEY, OTHER_KEY, KEY])
    assert keys.identity(f"Bearer {KEY}") == "api-key-0"
    assert keys.identity(f"Bearer {OTHER_KEY}") == "api-key-1"
    assert keys.identity("Bearer nope") is None and keys.identity(None) is None
    assert bearer_token("Token abc") is None and bearer_token("BEARER abc") == "abc"
    assert not ApiKeys().is_enabled


# --- flags -----------------------------------------------------------------------------------------
def test_keys_from_flags_env_and_file(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\n\nsk-file-1\n  sk-file-2  \nsk-a\n")
    monkeypatch.setenv("SPINDLE_API_KEY", "sk-env-1, sk-env-2")
    assert FrontendConfig.from_args([]).edge.api_keys == ("sk-env-1", "sk-env-2")
    # The command line replaces the environment; the file adds to either; duplicates go.
    config = FrontendConfig.from_args(["--api-key", "sk-a,sk-b", "--api-key", "sk-c", "--api-key-file", str(key_file)])
    assert config.edge.api_keys == ("sk-a", "sk-b", "sk-c", "sk-file-1", "sk-file-2")
    monkeypatch.delenv("SPINDLE_API_KEY")
    assert FrontendConfig.from_args([]).edge == EdgeConfig()
    monkeypatch.setenv("SPINDLE_PROTECT_METRICS", "1")
    assert FrontendConfig.from_args(["--api-key", "k"]).edge.protect_metrics


def test_bad_key_settings_are_refused_without_quoting_the_key(tmp_path):
    with pytest.raises(ValueError, match="needs API keys"):
        FrontendConfig.from_args(["--protect-metrics"])
    with pytest.raises(ValueError) as info:
        EdgeConfig(api_keys=("good", "sk-bad\u00e9secret"))
    assert "#2" in str(info.value) and "secret" not in str(info.value)
    with pytest.raises(ValueError, match="cannot read --api-key-file"):
        FrontendConfig.from_args(["--api-key-file", str(tmp_path / "missing")])


# --- gRPC ------------------------------------------------------------------------------------------
def _generate(**fields) -> generate_pb2.GenerateRequest:
    params = generate_pb2.GenerateRequest.SamplingParams(max_tokens=fields.pop("max_tokens", 250))
    return generate_pb2.GenerateRequest(sampling_params=params, **fields)


@pytest.mark.parametrize("metadata, message", [
    ((), MISSING_KEY), (bearer("sk-wrong"), WRONG_KEY), ((("authorization", KEY),), MISSING_KEY)])
def test_grpc_without_the_right_key_is_unauthenticated(metadata, message):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        codes = []
        async with edge_grpc(engine, KEYED.api_keys) as address, stub_at(address) as stub:
            calls = [lambda: stub.Generate(_generate(text="x"), metadata=metadata).read(),
                     lambda: stub.Tokenize(generate_pb2.TokenizeRequest(text="x"), metadata=metadata),
                     lambda: stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=metadata),
                     lambda: stub.Abort(generate_pb2.AbortRequest(request_id="x"), metadata=metadata)]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call()
                codes.append((info.value.code(), info.value.details()))
            async with grpc.aio.insecure_channel(address) as channel:  # probes need no key
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return codes, health, engine

    codes, health, engine = asyncio.run(scenario())
    assert codes == [(grpc.StatusCode.UNAUTHENTICATED, message)] * 4
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered, not refused
    assert engine.requests == []


def test_grpc_with_a_right_key_is_served():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "Hello world.")
        async with edge_grpc(engine, KEYED.api_keys) as address, stub_at(address) as stub:
            responses = [r async for r in stub.Generate(_generate(text="x"), metadata=bearer(OTHER_KEY))]
            tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello"), metadata=bearer(KEY))
        return responses, tokens

    responses, tokens = asyncio.run(scenario())
    assert "".join(r.text for r in responses) == "Hello world." and responses[-1].finish_reason == STOP
    assert list(tokens.token_ids) == make_tokenizer().encode("Hello")


# --- Abort belongs to its caller ------------------------------------------------------------------------
@pytest.mark.parametrize("keys, victim_key, intruder_key", [
    ((), None, None),  # no keys: callers are told apart by their connection
    (KEYED.api_keys, KEY, OTHER_KEY),
])
def test_abort_from_another_caller_is_not_found_and_the_victim_completes(keys, victim_key, intruder_key):
    reply = "Hello world. The capital of France is Paris."

    async def scenario():
        engine = GatedEngine(make_tokenizer(), reply)
        victim_md = bearer(victim_key) if victim_key else ()
        intruder_md = bearer(intruder_key) if intruder_key else ()
        async with edge_grpc(engine, keys) as address, stub_at(address) as victim, stub_at(address) as intruder:
            call = victim.Generate(_generate(request_id="job-1", text="x"), metadata=victim_md)
            first = await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await intruder.Abort(generate_pb2.AbortRequest(request_id="job-1"), metadata=intruder_md)
            # The same id from another caller is a request of its own, not a clash with the victim's.
            other = intruder.Generate(_generate(request_id="job-1", text="y"), metadata=intruder_md)
            await other.read()
            engine.release.set()  # the engine was holding the victim's last token until now
            rest = await read_rest(call)
            others = await read_rest(other)
        return engine, [first, *rest], refused.value, others

    engine, responses, refused, others = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert refused.details() == "No running request with id 'job-1'. (param: request_id)"
    assert "".join(r.text for r in responses) == reply
    assert responses[-1].finish_reason == STOP and all(r.request_id == "job-1" for r in responses)
    assert others[-1].finish_reason == STOP
    assert engine.aborted == []  # nothing was aborted in the engine


def test_the_same_key_on_another_connection_may_abort():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.01)
        async with edge_grpc(engine, KEYED.api_keys) as address, stub_at(address) as a, stub_at(address) as b:
            call = a.Generate(_generate(request_id="job-2", text="x"), metadata=bearer(KEY))
            await call.read()
            await b.Abort(generate_pb2.AbortRequest(request_id="job-2"), metadata=bearer(KEY))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read_rest(call)
        return ended.value.code(), engine

    code, engine = asyncio.run(scenario())
    assert code == grpc.StatusCode.CANCELLED
    assert engine.aborted == [engine.requests[0].request_id]


# --- the running frontend wires them ------------------------------------------------------------------
def test_frontend_server_guards_both_faces():
    """FrontendServer (not only create_app) puts the keys on HTTP and gRPC and the limit on gRPC."""
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "Hello world.")
        edge = EdgeConfig(api_keys=(KEY,), max_grpc_message_bytes=2**20)
        config = FrontendConfig(http_port=0, grpc_addr="127.0.0.1:0", shutdown_timeout_s=1, edge=edge)
        server = FrontendServer(config, engine, serving_model(engine.tokenizer))
        await server.start()
        try:
            base = f"http://127.0.0.1:{server.http_port}"
            async with aiohttp.ClientSession() as session:
                statuses = []
                for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
                    async with session.post(base + "/v1/completions", json=COMPLETION, headers=headers) as r:
                        statuses.append(r.status)
                for path in ("/health", "/metrics"):
                    async with session.get(base + path) as r:
                        statuses.append(r.status)
            async with stub_at(f"127.0.0.1:{server.grpc_port}") as stub:
                codes = []
                for metadata, text in (((), "x"), (bearer(KEY), "x" * (2 * 2**20))):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.Tokenize(generate_pb2.TokenizeRequest(text=text), metadata=metadata)
                    codes.append(info.value.code())
                served = await stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello"), metadata=bearer(KEY))
        finally:
            await server.stop()
        return statuses, codes, served

    statuses, codes, served = asyncio.run(scenario())
    assert statuses == [401, 200, 200, 200]
    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert list(served.token_ids) == make_tokenizer().encode("Hello")
