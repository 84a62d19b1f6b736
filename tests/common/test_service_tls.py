"""Mutual TLS between services over real gRPC, with throwaway CAs: a client needs a certificate from
the CA, the server admits only the listed identities, health answers every certified client, a
certificate renewed in place is served without a restart, and the exec health probe connects."""
from __future__ import annotations

import asyncio
import contextlib
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common import health_probe
from services.common.grpc_server import GrpcServer
from services.common.service_auth import ServiceAuthConfig, open_channel
from tests.common.certs import CertificateAuthority, Issued
from tests.common.test_service_auth import EXPECTED, HANDLERS, TOKEN, _health, call_every_kind


def _config(issued: Issued, allowed: tuple[str, ...] = (), **tokens) -> ServiceAuthConfig:
    return ServiceAuthConfig(str(issued.cert_path), str(issued.key_path), str(issued.ca_path), allowed, **tokens)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(root / "ca")
    other_ca = CertificateAuthority(root / "other-ca", name="another-ca")
    return {
        "ca": ca,
        "worker": ca.issue("spindle-worker"),
        "scheduler": ca.issue("spindle-scheduler"),
        "frontend": ca.issue("spindle-frontend"),
        "foreign-scheduler": other_ca.issue("spindle-scheduler"),
    }


@contextlib.asynccontextmanager
async def tls_server(config: ServiceAuthConfig):
    server = GrpcServer("127.0.0.1:0", ["test.Echo"], auth=config)
    server.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", HANDLERS)])
    await server.start()
    await server.set_serving(True)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


async def _unary(channel: grpc.aio.Channel) -> object:
    try:
        return await channel.unary_unary("/test.Echo/UnaryUnary")(b"x", timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_only_a_certified_client_of_an_admitted_identity_gets_through(pki):
    async def run():
        results = {}
        async with tls_server(_config(pki["worker"], ("spindle-scheduler",))) as address:
            async with open_channel(address, _config(pki["scheduler"]), []) as channel:
                results["scheduler"] = await call_every_kind(channel)
                results["scheduler health"] = await _health(channel)
            async with open_channel(address, _config(pki["frontend"]), []) as channel:
                results["frontend"] = await call_every_kind(channel, expect_refusal=True)
                results["frontend health"] = await _health(channel)
            # TLS that trusts the server but presents no certificate: the handshake fails.
            no_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"].ca_path.read_bytes())
            async with grpc.aio.secure_channel(address, no_cert) as channel:
                results["no certificate"] = await _unary(channel)
            async with grpc.aio.insecure_channel(address) as channel:
                results["plaintext"] = await _unary(channel)
            # A certificate with the right name from another CA.
            cert, key, _ = pki["foreign-scheduler"].read()
            foreign = grpc.ssl_channel_credentials(pki["ca"].ca_path.read_bytes(), key, cert)
            async with grpc.aio.secure_channel(address, foreign) as channel:
                results["foreign CA"] = await _unary(channel)
        return results

    results = asyncio.run(run())
    assert results["scheduler"] == EXPECTED
    assert results["frontend"] == dict.fromkeys(EXPECTED, grpc.StatusCode.PERMISSION_DENIED)
    # Health is exempt from the identity check: any certificate of the CA may ask.
    assert results["scheduler health"] == results["frontend health"] == health_pb2.HealthCheckResponse.SERVING
    assert results["no certificate"] == results["plaintext"] == results["foreign CA"] == grpc.StatusCode.UNAVAILABLE


def test_the_client_refuses_a_server_whose_certificate_the_ca_did_not_sign(pki):
    async def run():
        async with tls_server(_config(pki["foreign-scheduler"], ("spindle-frontend",))) as address:
            async with open_channel(address, _config(pki["frontend"]), []) as channel:
                return await _unary(channel)

    assert asyncio.run(run()) == grpc.StatusCode.UNAVAILABLE


def test_tls_and_a_token_together(pki):
    async def run():
        async with tls_server(_config(pki["worker"], ("spindle-scheduler",), server_token=TOKEN)) as address:
            async with open_channel(address, _config(pki["scheduler"]), []) as channel:
                without = await _unary(channel)
            async with open_channel(address, _config(pki["scheduler"], client_token=TOKEN), []) as channel:
                return without, await _unary(channel)

    assert asyncio.run(run()) == (grpc.StatusCode.UNAUTHENTICATED, b"x!")


def test_a_certificate_renewed_in_place_is_served_to_new_connections(pki, tmp_path):
    """As when cert-manager renews a mounted Secret: the files change, the server is not restarted."""
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for name in ("tls.crt", "tls.key", "ca.crt"):
        shutil.copy(pki["foreign-scheduler"].cert_path.parent / name, mounted / name)
    serving = Issued(mounted / "tls.crt", mounted / "tls.key", mounted / "ca.crt")

    async def run():
        async with tls_server(_config(serving, ("spindle-frontend",))) as address:
            async with open_channel(address, _config(pki["frontend"]), []) as channel:
                before = await _unary(channel)  # signed by another CA: the frontend refuses it
            renewed = pki["ca"].issue("spindle-scheduler", folder=tmp_path / "renewed")
            for name in ("tls.crt", "tls.key", "ca.crt"):
                shutil.copy(renewed.cert_path.parent / name, mounted / name)
            async with open_channel(address, _config(pki["frontend"]), []) as channel:
                return before, await _unary(channel)

    assert asyncio.run(run()) == (grpc.StatusCode.UNAVAILABLE, b"x!")


def test_unreadable_certificate_files_fail_the_server_start_naming_the_flag(pki, tmp_path):
    config = ServiceAuthConfig(str(tmp_path / "missing.crt"), str(pki["worker"].key_path), str(pki["worker"].ca_path))

    async def run():
        await GrpcServer("127.0.0.1:0", [], auth=config).start()

    with pytest.raises(ValueError, match="--tls-cert: cannot read .*missing.crt"):
        asyncio.run(run())


def test_the_exec_health_probe_connects_with_the_containers_certificate(pki, monkeypatch, capsys):
    async def run():
        async with tls_server(_config(pki["worker"], ("spindle-scheduler",))) as address:
            for variable, value in pki["worker"].env().items():
                monkeypatch.setenv(variable, value)
            with_cert = await asyncio.to_thread(health_probe.main, [address])
            for variable in pki["worker"].env():
                monkeypatch.delenv(variable)
            without = await asyncio.to_thread(health_probe.main, [address, "--timeout-s", "2"])
            return with_cert, without

    assert asyncio.run(run()) == (0, 1)
    assert "SERVING" in capsys.readouterr().out
