"""The endpoint picker's surroundings in the inference-pool overlays: Istio's DestinationRule for its
TLS (k8s/inference-pool-istio, validated against Istio's own schema), Prometheus scraping its
authenticated /metrics, its PodDisruptionBudget, and an update strategy that never leaves the pool
without a ready picker."""
from __future__ import annotations

import functools
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.k8s.manifests import K8S, OVERLAYS, Rendered, rendered
from tests.k8s.test_crds import POOL_OVERLAYS

SCHEMA = Path(__file__).parent / "schemas" / "istio_destinationrule_v1.yaml"
ISTIO_COMPONENT = "inference-pool-istio"
# Overlays that use the Istio component (read from their kustomization, so collection needs no kubectl).
ISTIO_OVERLAYS = [o for o in OVERLAYS if f"/{ISTIO_COMPONENT}" in (K8S / "overlays" / o / "kustomization.yaml").read_text()]


def strict(schema):
    """The schema with unknown fields refused, as the API server's strict field validation does
    (`kubectl apply` asks for it); CEL rules (x-kubernetes-validations) are not evaluated."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    return [strict(s) for s in schema] if isinstance(schema, list) else schema


@functools.lru_cache(maxsize=None)
def destination_rule_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(yaml.safe_load(SCHEMA.read_text())))


def schema_errors(rule: dict) -> list[str]:
    """What Istio's schema says against `rule` (apiVersion, kind and metadata are the API server's)."""
    body = {k: v for k, v in rule.items() if k not in ("apiVersion", "kind", "metadata")}
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in destination_rule_validator().iter_errors(body)]


def picker(r: Rendered) -> tuple[dict, dict, dict]:
    """(InferencePool, picker Service, picker Deployment)."""
    (pool,) = r.of_kind("InferencePool")
    service = r.get("Service", pool["spec"]["endpointPickerRef"]["name"])
    (deployment,) = [d for d in r.of_kind("Deployment")
                     if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                            for k, v in service["spec"]["selector"].items())]
    return pool, service, deployment


def service_host_names(service: dict) -> set[str]:
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    return {name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"}


def test_some_overlay_renders_the_istio_component():
    assert ISTIO_OVERLAYS and set(ISTIO_OVERLAYS) <= set(POOL_OVERLAYS), ISTIO_OVERLAYS
    component = yaml.safe_load((K8S / ISTIO_COMPONENT / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    kinds = [yaml.safe_load((K8S / ISTIO_COMPONENT / f).read_text())["kind"] for f in component["resources"]]
    assert kinds == ["DestinationRule"]


def test_the_schema_refuses_what_istio_refuses():
    good = {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule", "metadata": {"name": "x"},
            "spec": {"host": "x", "trafficPolicy": {"tls": {"mode": "SIMPLE"}}}}
    assert not schema_errors(good)
    for spec in ({"host": "x", "trafficPolicy": {"tls": {"mode": "TLS"}}},  # not an enum value
                 {"host": "x", "trafficPolicy": {"tls": {"mode": "SIMPLE", "skipVerify": True}}},  # unknown field
                 {"trafficPolicy": {}}):  # no host
        assert schema_errors({**good, "spec": spec}), spec


@pytest.mark.parametrize("overlay", ISTIO_OVERLAYS)
def test_the_destination_rule_gives_the_picker_port_tls(overlay):
    r = rendered(overlay)
    pool, service, deployment = picker(r)
    (rule,) = r.of_kind("DestinationRule")
    assert rule["apiVersion"] == "networking.istio.io/v1"
    errors = schema_errors(rule)
    assert not errors, errors
    assert rule["spec"]["host"] in service_host_names(service), rule["spec"]["host"]
    port = pool["spec"]["endpointPickerRef"]["port"]["number"]
    (setting,) = [s for s in rule["spec"]["trafficPolicy"]["portLevelSettings"] if s["port"]["number"] == port]
    assert setting["tls"]["mode"] == "SIMPLE"
    # The picker's certificate is its own self-signed one unless --cert-path gives it another; then
    # the rule must name a CA (credentialName or caCertificates) instead of skipping the check.
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--secure-serving=false" not in args, "TLS to a picker that serves plaintext"
    if not any(a.startswith("--cert-path=") for a in args):
        assert setting["tls"]["insecureSkipVerify"] is True
    # The metrics port is plain HTTP: no TLS setting for the whole host.
    assert "tls" not in rule["spec"]["trafficPolicy"]


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_prometheus_scrapes_the_picker_with_a_token_it_accepts(overlay):
    r = rendered(overlay)
    _, _, deployment = picker(r)
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    metrics_port = int(args["metrics-port"])
    (monitor,) = r.of_kind("ServiceMonitor")
    services = [s for s in r.of_kind("Service")
                if all(s["metadata"].get("labels", {}).get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
                and all(pod["metadata"]["labels"].get(k) == v for k, v in s["spec"]["selector"].items())]
    assert services, "the ServiceMonitor selects no Service of the picker"
    ports = {p["name"]: p for s in services for p in s["spec"]["ports"]}
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    (endpoint,) = [e for e in monitor["spec"]["endpoints"] if e["port"] in ports]
    target = ports[endpoint["port"]]["targetPort"]
    assert named.get(target, target) == metrics_port
    assert endpoint.get("scheme", "http") == "http", "the picker serves metrics over TLS only with --metrics-cert-dir"
    # --metrics-endpoint-auth is on by default: a bearer token that may GET /metrics.
    assert args.get("metrics-endpoint-auth", "true") == "true"
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"].get("type", "Bearer") == "Bearer"
    secret = r.get("Secret", credentials["name"])
    assert secret is not None and secret["type"] == "kubernetes.io/service-account-token" and credentials["key"] == "token"
    account = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    assert r.get("ServiceAccount", account) is not None
    rules = [rule for binding in r.of_kind("ClusterRoleBinding")
             if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"])
             for rule in r.get("ClusterRole", binding["roleRef"]["name"])["rules"]]
    assert rules == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}], "the scrape token may do this and no more"


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_the_picker_has_a_disruption_budget_that_lets_nodes_drain(overlay):
    r = rendered(overlay)
    _, _, deployment = picker(r)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    budgets = [b for b in r.of_kind("PodDisruptionBudget")
               if all(labels.get(k) == v for k, v in b["spec"]["selector"]["matchLabels"].items())]
    assert len(budgets) == 1, "one PodDisruptionBudget for the picker"
    spec = budgets[0]["spec"]
    replicas = deployment["spec"].get("replicas", 1)
    # minAvailable: replicas (or maxUnavailable: 0) would block every node drain.
    assert "minAvailable" not in spec and spec["maxUnavailable"] == 1 <= replicas
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_a_picker_rollout_keeps_a_ready_picker(overlay):
    """With FailClose, no ready picker fails every request: the new picker must be ready before
    the old one goes (Recreate would leave none for the old one's whole drain)."""
    r = rendered(overlay)
    pool, _, deployment = picker(r)
    assert pool["spec"]["endpointPickerRef"].get("failureMode", "FailClose") == "FailClose"
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
