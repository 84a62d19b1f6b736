"""A Deployment whose pods may legitimately take their whole start-up window (a large model loading)
must not be marked failed first: `progressDeadlineSeconds` (600 s by default) has to outlast the
slowest container's start-up probe window plus its first readiness window, in every overlay."""
from __future__ import annotations

import pytest

from tests.k8s.manifests import OVERLAYS, rendered

DEFAULT_PROGRESS_DEADLINE_S = 600
DEFAULT_PERIOD_S, DEFAULT_FAILURE_THRESHOLD = 10, 3


def probe_window_s(probe: dict | None) -> int:
    """How long a probe may keep failing before it gives up: initial delay + period x threshold."""
    if not probe:
        return 0
    return (probe.get("initialDelaySeconds", 0)
            + probe.get("periodSeconds", DEFAULT_PERIOD_S) * probe.get("failureThreshold", DEFAULT_FAILURE_THRESHOLD))


def start_window_s(spec: dict) -> int:
    """The longest a pod of this template may take to become ready without failing a probe."""
    containers = spec.get("initContainers", []) + spec["containers"]
    return max(probe_window_s(c.get("startupProbe")) + probe_window_s(c.get("readinessProbe")) for c in containers)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_progress_deadlines_outlast_the_start_up_windows(overlay):
    for deployment in rendered(overlay).of_kind("Deployment"):
        spec = deployment["spec"]
        deadline = spec.get("progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE_S)
        window = start_window_s(spec["template"]["spec"])
        assert deadline > window, (f"{overlay}: Deployment {deployment['metadata']['name']} is marked failed after "
                                   f"{deadline} s, but its pods may take {window} s to become ready")


def test_the_check_catches_the_gpu_overlays_old_default():
    engine = rendered("gpu").get("Deployment", "spindle-engine")
    assert start_window_s(engine["spec"]["template"]["spec"]) > DEFAULT_PROGRESS_DEADLINE_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_drain_lets_every_stream_a_route_allows_finish(overlay):
    """A rollout must not cut a stream the HTTPRoute still allows: SPINDLE_SHUTDOWN_TIMEOUT (the
    services' drain) and the gateway's shutdown grace are at least every route's request timeout."""
    objects = rendered(overlay)
    drains = {float(objects.environment(c)["SPINDLE_SHUTDOWN_TIMEOUT"]) for _, c in objects.spindle_containers()
              if c["name"] in ("frontend", "scheduler")}
    assert len(drains) == 1, f"{overlay}: the services drain for different times: {drains}"
    drain_s = drains.pop()
    for route in objects.of_kind("HTTPRoute"):
        for rule in route["spec"]["rules"]:
            timeout = rule.get("timeouts", {}).get("request")
            if timeout is not None:
                assert drain_s >= float(timeout.rstrip("s")), (
                    f"{overlay}: a {drain_s:.0f} s drain cuts streams route {route['metadata']['name']} allows "
                    f"for {timeout}")
    gateway = objects.get("Deployment", "spindle-smg")
    if gateway is not None:
        args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
        grace = [a.split("=", 1)[1] for a in args if a.startswith("--shutdown-grace-period-secs=")]
        assert grace and float(grace[0]) >= drain_s
