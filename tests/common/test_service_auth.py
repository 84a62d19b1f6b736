"""Service-to-service authentication without TLS: the check itself, the flags and config, and the
token over real gRPC on calls of all four kinds, with health exempt."""
from __future__ import annotations

import argparse
import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from services.common import bearer
from services.common.auth_interceptor import bearer_token, check_call, peer_identities, tokens_equal
from services.common.grpc_server import GrpcServer
from services.common.service_auth import (
    ServiceAuthConfig,
    add_service_auth_flags,
    open_channel,
    service_auth_config_from_args,
    token_interceptors,
)
from tests.k8s.service_flags import flag_defaults, spindle_environment

TOKEN = "scheduler-token-0123456789abcdef"
OTHER_TOKEN = "worker-token-fedcba9876543210"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
TLS = ServiceAuthConfig("c.pem", "k.pem", "ca.pem", allowed_client_names=("spindle-frontend",))


def _auth_context(*dns_names: str, common_name: str | None = None) -> dict[str, list[bytes]]:
    context = {"transport_security_type": [b"ssl"], "peer_dns": [n.encode() for n in dns_names]}
    if common_name is not None:
        context["x509_common_name"] = [common_name.encode()]
    return context


# --- the check ---------------------------------------------------------------------------------------
def test_token_check_refuses_a_missing_or_wrong_token_and_admits_the_right_one():
    config = ServiceAuthConfig(server_token=TOKEN)
    assert check_call(config, [], {})[0] == UNAUTHENTICATED
    assert check_call(config, [("authorization", f"Bearer {OTHER_TOKEN}")], {}) == (
        UNAUTHENTICATED, "invalid service token")
    assert check_call(config, [("authorization", TOKEN)], {})[0] == UNAUTHENTICATED  # no scheme
    assert check_call(config, [("authorization", f"Basic {TOKEN}")], {})[0] == UNAUTHENTICATED
    assert check_call(config, [("authorization", f"Bearer {TOKEN}x")], {})[0] == UNAUTHENTICATED
    assert check_call(config, [("authorization", f"Bearer {TOKEN[:-1]}")], {})[0] == UNAUTHENTICATED
    assert check_call(config, [("x-other", "1"), ("authorization", f"Bearer {TOKEN}")], {}) is None
    assert check_call(config, [("Authorization", f"bearer {TOKEN}")], {}) is None  # RFC 6750: any case


def test_refusals_never_carry_the_token():
    config = ServiceAuthConfig(server_token=TOKEN)
    for metadata in ([], [("authorization", f"Bearer {TOKEN[:20]}")]):
        assert TOKEN[:20] not in check_call(config, metadata, {})[1]
    assert TOKEN not in repr(config) and TOKEN not in repr(token_interceptors(TOKEN))


def test_tokens_compare_by_digest_in_constant_time(monkeypatch):
    calls = []
    real = bearer.hmac.compare_digest
    monkeypatch.setattr(bearer.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert tokens_equal(TOKEN, TOKEN) and not tokens_equal(TOKEN, TOKEN + "x")
    # Equal-length digests: the comparison time says nothing about the expected token's length.
    assert len(calls) == 2 and all(len(a) == len(b) == 32 for a, b in calls)


def test_bearer_token_parsing():
    assert bearer_token([("authorization", b"Bearer abc")]) == "abc"
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token([]) is None


def test_identity_check_admits_listed_dns_names_or_cn_and_denies_others():
    assert check_call(TLS, [], _auth_context("spindle-frontend", "localhost")) is None
    assert check_call(TLS, [], _auth_context(common_name="spindle-frontend")) is None
    code, details = check_call(TLS, [], _auth_context("spindle-worker", common_name="spindle-worker"))
    assert code == PERMISSION_DENIED and "spindle-worker" in details
    # No verified certificate identity at all (never the case after a TLS handshake): refused.
    assert check_call(TLS, [], {})[0] == UNAUTHENTICATED
    # An IP address SAN is not an identity.
    assert check_call(TLS, [], {"x509_subject_alternative_name": [b"spindle-frontend"]})[0] == UNAUTHENTICATED
    assert peer_identities(_auth_context("a", common_name="b")) == {"a", "b"}


def test_with_tls_and_a_token_both_are_required():
    config = ServiceAuthConfig("c", "k", "ca", allowed_client_names=("spindle-frontend",), server_token=TOKEN)
    good = [("authorization", f"Bearer {TOKEN}")]
    assert check_call(config, good, _auth_context("spindle-frontend")) is None
    assert check_call(config, [], _auth_context("spindle-frontend"))[0] == UNAUTHENTICATED
    assert check_call(config, good, _auth_context("spindle-worker"))[0] == PERMISSION_DENIED


# --- config and flags --------------------------------------------------------------------------------
def _parse(env: dict[str, str], argv: list[str] = (), **roles) -> ServiceAuthConfig:
    with spindle_environment(env):
        parser = argparse.ArgumentParser()
        add_service_auth_flags(parser, **roles)
        return service_auth_config_from_args(parser.parse_args(list(argv)))


SCHEDULER_ROLES = dict(accepts_token_of="scheduler", sends_token_to="worker", default_allowed_clients="spindle-frontend")


def test_no_flags_means_no_service_auth():
    config = _parse({}, **SCHEDULER_ROLES)
    assert not config.is_tls and not config.is_server_auth_enforced and config.client_token is None
    assert config.allowed_client_names == ("spindle-frontend",)


def test_the_scheduler_accepts_one_token_and_sends_another():
    config = _parse({"SPINDLE_SCHEDULER_TOKEN": TOKEN, "SPINDLE_WORKER_TOKEN": OTHER_TOKEN}, **SCHEDULER_ROLES)
    assert (config.server_token, config.client_token) == (TOKEN, OTHER_TOKEN)


def test_token_from_a_file_without_its_newline(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    config = _parse({"SPINDLE_WORKER_TOKEN_FILE": str(path)}, accepts_token_of="worker")
    assert config.server_token == TOKEN and config.client_token is None


@pytest.mark.parametrize("env, message", [
    ({"SPINDLE_WORKER_TOKEN": "short"}, "--worker-token must be at least 16"),
    ({"SPINDLE_WORKER_TOKEN": "has whitespace 0123456789"}, "without whitespace"),
    ({"SPINDLE_TLS_CERT": "c", "SPINDLE_TLS_KEY": "k", "SPINDLE_TLS_CA": "a", "SPINDLE_TLS_ALLOWED_CLIENTS": " , "},
     "would admit no one"),
    ({"SPINDLE_WORKER_TOKEN": TOKEN, "SPINDLE_WORKER_TOKEN_FILE": "/x"}, "not both"),
    ({"SPINDLE_WORKER_TOKEN_FILE": "/nonexistent/token"}, "cannot read /nonexistent/token"),
    ({"SPINDLE_TLS_CERT": "c.pem", "SPINDLE_TLS_KEY": "k.pem"}, "all of --tls-cert, --tls-key and --tls-ca"),
])
def test_bad_settings_fail_at_start_up(env, message):
    with pytest.raises(ValueError, match=message):
        _parse(env, accepts_token_of="worker")


def test_each_service_has_the_flags_of_its_role():
    frontend, scheduler, worker = (set(flag_defaults(s)) for s in ("frontend", "scheduler", "worker"))
    tls = {"SPINDLE_TLS_CERT", "SPINDLE_TLS_KEY", "SPINDLE_TLS_CA"}
    assert tls <= frontend and tls <= scheduler and tls <= worker
    assert {"SPINDLE_SCHEDULER_TOKEN", "SPINDLE_SCHEDULER_TOKEN_FILE"} <= frontend
    # The frontend cannot even be configured with the worker's token.
    assert not {"SPINDLE_WORKER_TOKEN", "SPINDLE_TLS_ALLOWED_CLIENTS"} & frontend
    assert {"SPINDLE_SCHEDULER_TOKEN", "SPINDLE_WORKER_TOKEN", "SPINDLE_TLS_ALLOWED_CLIENTS"} <= scheduler
    assert "SPINDLE_WORKER_TOKEN" in worker and "SPINDLE_SCHEDULER_TOKEN" not in worker
    assert flag_defaults("scheduler")["SPINDLE_TLS_ALLOWED_CLIENTS"] == "spindle-frontend"
    assert flag_defaults("worker")["SPINDLE_TLS_ALLOWED_CLIENTS"] == "spindle-scheduler"


# --- over gRPC: every call kind ----------------------------------------------------------------------
async def _unary_unary(request, context):
    return request + b"!"


async def _unary_stream(request, context):
    for i in range(3):
        yield request + bytes([48 + i])


async def _unary_stream_writer(request, context):
    await context.write(request + b"w")


async def _stream_unary(request_iterator, context):
    return b"".join([r async for r in request_iterator])


async def _stream_stream(request_iterator, context):
    async for request in request_iterator:
        yield request.upper()


HANDLERS = {
    "UnaryUnary": grpc.unary_unary_rpc_method_handler(_unary_unary),
    "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
    "UnaryStreamWriter": grpc.unary_stream_rpc_method_handler(_unary_stream_writer),
    "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
    "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
}


@contextlib.asynccontextmanager
async def echo_server(auth: ServiceAuthConfig):
    server = GrpcServer("127.0.0.1:0", ["test.Echo"], auth=auth)
    server.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", HANDLERS)])
    await server.start()
    await server.set_serving(True)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


async def _send_requests():
    for part in (b"a", b"b"):
        yield part


async def _no_requests():
    return
    yield


async def call_every_kind(channel: grpc.aio.Channel, expect_refusal: bool = False) -> dict[str, object]:
    """Each method's answer, or the status code it was refused with. `expect_refusal`: the streaming
    kinds send no request message (the refusal comes at the call's start; a write racing the server's
    abort would end the call INTERNAL on the client's side instead)."""
    _requests = _no_requests if expect_refusal else _send_requests
    calls = {
        "UnaryUnary": lambda: channel.unary_unary("/test.Echo/UnaryUnary")(b"x", timeout=10),
        "UnaryStream": lambda: _collect(channel.unary_stream("/test.Echo/UnaryStream")(b"x", timeout=10)),
        "UnaryStreamWriter": lambda: _collect(channel.unary_stream("/test.Echo/UnaryStreamWriter")(b"x", timeout=10)),
        "StreamUnary": lambda: channel.stream_unary("/test.Echo/StreamUnary")(_requests(), timeout=10),
        "StreamStream": lambda: _collect(channel.stream_stream("/test.Echo/StreamStream")(_requests(), timeout=10)),
    }
    results: dict[str, object] = {}
    for name, call in calls.items():
        try:
            results[name] = await call()
        except grpc.aio.AioRpcError as exc:
            results[name] = exc.code()
    return results


async def _collect(call) -> list:
    return [response async for response in call]


EXPECTED = {"UnaryUnary": b"x!", "UnaryStream": [b"x0", b"x1", b"x2"], "UnaryStreamWriter": [b"xw"],
            "StreamUnary": b"ab", "StreamStream": [b"A", b"B"]}


async def _health(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return response.status


def test_a_server_with_a_token_refuses_every_call_kind_without_it_and_serves_health():
    async def run():
        async with echo_server(ServiceAuthConfig(server_token=TOKEN)) as address:
            results = {}
            for label, token in (("none", None), ("wrong", OTHER_TOKEN), ("right", TOKEN)):
                async with open_channel(address, ServiceAuthConfig(client_token=token), []) as channel:
                    results[label] = await call_every_kind(channel, expect_refusal=token != TOKEN)
                    assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING, label
            async with open_channel(address, ServiceAuthConfig(), []) as channel:
                # No request message: the refusal comes at the call's start, and a write racing the
                # server's abort would end the call INTERNAL on the client's side instead.
                reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([]), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _collect(reflection)
                assert refused.value.code() == UNAUTHENTICATED
            return results

    results = asyncio.run(run())
    assert results["none"] == dict.fromkeys(EXPECTED, UNAUTHENTICATED)
    assert results["wrong"] == dict.fromkeys(EXPECTED, UNAUTHENTICATED)
    assert results["right"] == EXPECTED


def test_without_service_auth_the_server_is_open_as_before():
    async def run():
        async with echo_server(ServiceAuthConfig()) as address:
            async with open_channel(address, ServiceAuthConfig(), []) as channel:
                return await call_every_kind(channel)

    assert asyncio.run(run()) == EXPECTED


def test_the_token_goes_after_other_interceptors_metadata():
    """A tracing interceptor's metadata and the token travel together."""
    seen = []

    class AddHeader(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            details = grpc.aio.ClientCallDetails(details.method, details.timeout,
                                                 grpc.aio.Metadata(("traceparent", "00-abc")),
                                                 details.credentials, details.wait_for_ready)
            return await continuation(details, request)

    async def record(request, context):
        seen.append(dict(context.invocation_metadata()))
        return request

    async def run():
        server = GrpcServer("127.0.0.1:0", ["test.Echo"], auth=ServiceAuthConfig(server_token=TOKEN))
        server.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Echo", {"UnaryUnary": grpc.unary_unary_rpc_method_handler(record)})])
        await server.start()
        try:
            async with open_channel(f"127.0.0.1:{server.port}", ServiceAuthConfig(client_token=TOKEN), [],
                                    [AddHeader()]) as channel:
                return await channel.unary_unary("/test.Echo/UnaryUnary")(b"x", timeout=10)
        finally:
            await server.stop(0)

    assert asyncio.run(run()) == b"x"
    assert seen[0]["traceparent"] == "00-abc" and seen[0]["authorization"] == f"Bearer {TOKEN}"


def test_max_receive_message_bytes_is_a_server_parameter():
    async def run():
        server = GrpcServer("127.0.0.1:0", ["test.Echo"], max_receive_message_bytes=1024)
        server.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", HANDLERS)])
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                small = await channel.unary_unary("/test.Echo/UnaryUnary")(b"x" * 1000, timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await channel.unary_unary("/test.Echo/UnaryUnary")(b"x" * 2000, timeout=10)
                return small, refused.value.code()
        finally:
            await server.stop(0)

    small, code = asyncio.run(run())
    assert small == b"x" * 1000 + b"!" and code == grpc.StatusCode.RESOURCE_EXHAUSTED
