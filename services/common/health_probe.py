"""`python -m services.common.health_probe HOST:PORT`: exits 0 when the server's gRPC health check
answers SERVING, 1 otherwise; for Kubernetes exec probes.

The kubelet's own `grpc` probe speaks plaintext only, while under mutual TLS the scheduler's and
the worker's ports accept only TLS connections that present a certificate. This probe runs inside
the container and reads the container's own `SPINDLE_TLS_*` settings (or flags), so it connects as
the service itself; health is exempt from the identity and token checks, so that is enough. Without
TLS settings it connects in plaintext, as the kubelet would.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.service_auth import add_service_auth_flags, read_pem_files, service_auth_config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.health_probe",
                                     description="exit 0 when a Spindle gRPC server reports SERVING")
    parser.add_argument("address", help="host:port to check, e.g. 127.0.0.1:50052")
    parser.add_argument("--service", default="", help="health service name to ask for ('' = the server)")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="seconds to wait for the answer")
    add_service_auth_flags(parser)
    args = parser.parse_args(argv)
    try:
        auth = service_auth_config_from_args(args)
        if auth.is_tls:
            cert, key, ca = read_pem_files(auth)
            channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(ca, key, cert))
        else:
            channel = grpc.insecure_channel(args.address)
    except ValueError as exc:
        print(f"health probe: {exc}", file=sys.stderr)
        return 1
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
        except grpc.RpcError as exc:
            print(f"health probe: {args.address}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{args.address}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
