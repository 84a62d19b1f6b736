"""What the end-to-end tests poll: a frontend's /health, a service's gRPC health, and a bounded
wait for a condition (a TimeoutError naming what did not happen)."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_status(cluster) -> int:
    """The HTTP status of the cluster's frontend /health."""
    try:
        with urllib.request.urlopen(cluster.base_url + "/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def grpc_serving(addr: str) -> bool:
    """Whether the gRPC server at `addr` (no credentials) reports SERVING."""
    with grpc.insecure_channel(addr) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.1f} s")
        time.sleep(0.05)
