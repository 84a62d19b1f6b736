"""Hand-written checks for the custom resources kubernetes-validate has no schema for
(ServiceMonitor, InferencePool, InferenceObjective, HTTPRoute), and for the metric names that
tie the HPA and the endpoint picker to Spindle's Model Server Protocol gauges."""
from __future__ import annotations

import re

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, rendered

# The Model Server Protocol's gauges, vLLM's names under our prefix.
QUEUE_METRIC = "spindle:num_requests_waiting"
RUNNING_METRIC = "spindle:num_requests_running"
KV_METRIC = "spindle:kv_cache_usage_perc"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Overlays that use the inference-pool component (read from their kustomization, not rendered,
# so that collection needs no kubectl).
POOL_OVERLAYS = [o for o in OVERLAYS if "/inference-pool" in (K8S / "overlays" / o / "kustomization.yaml").read_text()]


def _objects(overlay, kind, api_version):
    objects = rendered(overlay).of_kind(kind)
    for obj in objects:
        assert obj["apiVersion"] == api_version, f"{kind}/{obj['metadata']['name']}: {obj['apiVersion']}"
        assert DNS_LABEL.match(obj["metadata"]["name"]), obj["metadata"]["name"]
    return objects


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_every_metrics_port(overlay):
    r = rendered(overlay)
    (monitor,) = _objects(overlay, "ServiceMonitor", "monitoring.coreos.com/v1")
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels"}
    services = [s for s in r.of_kind("Service")
                if all(s["metadata"].get("labels", {}).get(k) == v for k, v in spec["selector"]["matchLabels"].items())]
    port_names = {p.get("name") for s in services for p in s["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                                 "metricRelabelings", "honorLabels", "authorization"}, endpoint
        assert endpoint["port"] in port_names, f"ServiceMonitor endpoint {endpoint['port']} matches no Service port"
        assert endpoint["path"] == "/metrics"
    # Frontend HTTP, scheduler metrics, worker metrics.
    assert {"http", "sched-metrics", "worker-metrics"} <= {e["port"] for e in spec["endpoints"]}


def test_some_overlay_runs_an_inference_pool():
    assert POOL_OVERLAYS, "no overlay renders the inference-pool component"


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_inference_pool_selects_model_servers(overlay):
    r = rendered(overlay)
    (pool,) = _objects(overlay, "InferencePool", "inference.networking.k8s.io/v1")
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert set(spec["selector"]) == {"matchLabels"}, "v1 pools select by matchLabels only"
    pods = r.selected(spec["selector"]["matchLabels"])
    assert pods, "the InferencePool selects no pod"
    assert 1 <= len(spec["targetPorts"]) <= 8
    for pod in pods:
        frontend = pod.container("frontend")
        assert frontend is not None, f"{pod.owner}: a pool member must serve the OpenAI API itself"
        for port in spec["targetPorts"]:
            assert port["number"] in {p["containerPort"] for p in frontend["ports"]}, port
        # Exactly one engine behind each member, so its gauges describe one queue.
        assert [c["name"] for c in pod.containers].count("scheduler") == 1
        assert r.environment(frontend)["SPINDLE_SCHEDULER_ADDR"].startswith("127.0.0.1:")
    picker = spec["endpointPickerRef"]
    assert picker.get("kind", "Service") == "Service"
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    service = r.get("Service", picker["name"])
    assert service is not None, f"endpointPickerRef {picker['name']} is not a Service"
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert r.selected(service["spec"]["selector"]), "the endpoint picker Service selects no pod"


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_inference_objective_and_route_point_at_the_pool(overlay):
    r = rendered(overlay)
    pools = {p["metadata"]["name"] for p in r.of_kind("InferencePool")}
    for objective in _objects(overlay, "InferenceObjective", "inference.networking.x-k8s.io/v1alpha2"):
        assert set(objective["spec"]) <= {"priority", "poolRef"}
        assert isinstance(objective["spec"].get("priority", 0), int)
        ref = objective["spec"]["poolRef"]
        assert ref.get("group", "inference.networking.k8s.io") == "inference.networking.k8s.io"
        assert ref["name"] in pools
    (route,) = _objects(overlay, "HTTPRoute", "gateway.networking.k8s.io/v1")
    parents = route["spec"]["parentRefs"]
    assert parents and all(p.get("kind", "Gateway") == "Gateway" for p in parents)
    for rule in route["spec"]["rules"]:
        for backend in rule["backendRefs"]:
            assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
            assert backend["name"] in pools


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_endpoint_picker_reads_spindle_metrics(overlay):
    r = rendered(overlay)
    (pool,) = r.of_kind("InferencePool")
    epp = r.selected(r.get("Service", pool["spec"]["endpointPickerRef"]["name"])["spec"]["selector"])[0]
    args = dict(a.removeprefix("--").split("=", 1) for a in epp.container("epp")["args"])
    assert args["pool-name"] == pool["metadata"]["name"]
    config = r.get("ConfigMap", epp.spec["volumes"][0]["configMap"]["name"])
    assert config, "the EPP's plugin config is missing"
    # The names are in the config's engineConfigs, not flags (test_epp_flags.py checks where exactly).
    assert all(m in "".join(config["data"].values()) for m in (QUEUE_METRIC, RUNNING_METRIC, KV_METRIC))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_scale_on_queue_depth_only_where_requests_are_routed_per_engine(overlay):
    """An HPA on the engine only helps where the gateway spreads requests over engines; plain
    frontends keep one stream to one engine, so new engines would sit idle."""
    r = rendered(overlay)
    hpa = r.get("HorizontalPodAutoscaler", "spindle-engine")
    assert (hpa is not None) == (overlay in POOL_OVERLAYS)
    if hpa is not None:
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == QUEUE_METRIC
        assert metric["pods"]["target"]["type"] == "AverageValue"
    frontend_hpa = r.get("HorizontalPodAutoscaler", "spindle-frontend")
    if frontend_hpa is not None:
        (metric,) = frontend_hpa["spec"]["metrics"]
        assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
