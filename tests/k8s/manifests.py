"""Renders the kustomize overlays under k8s/ and indexes the objects for the tests in this folder.

`kubectl kustomize` does the rendering (offline); without kubectl the tests skip and say why.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
NAMESPACE = "spindle"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
# Kinds kubernetes-validate has no schema for (CRDs): test_crds.py checks these by hand (cert-manager's
# Certificate and Issuer: test_service_auth.py; Istio's DestinationRule: test_gateway_wiring.py, and the
# LeaderWorkerSet: test_leaderworkerset.py, against the schemas in schemas/).
CRD_KINDS = {"ServiceMonitor", "InferencePool", "InferenceObjective", "HTTPRoute", "Certificate", "Issuer",
             "DestinationRule", "LeaderWorkerSet"}
# What the LeaderWorkerSet controller (kubernetes-sigs/lws) puts on its pods: labels, and variables at
# the front of every container's env.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"


def require_kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found on PATH: the manifests cannot be rendered (`kubectl kustomize`)")
    return kubectl


@functools.lru_cache(maxsize=None)
def render_text(overlay: str) -> str:
    kubectl = require_kubectl()
    result = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize k8s/overlays/{overlay} failed:\n{result.stderr}"
    return result.stdout


@dataclass(frozen=True)
class PodTemplate:
    """A workload's pod template, with the workload's kind and name for messages."""

    owner: str
    labels: dict[str, str]
    spec: dict[str, Any]
    # The label whose value is the pod's revision (a spread over "this revision's pods" keys on it).
    revision_label: str = "pod-template-hash"
    # One pod of a template whose pods the tests can name (a LeaderWorkerSet's): the values its
    # downward API fields take (metadata.name, metadata.namespace) and the variables the controller
    # injects; for a LeaderWorkerSet worker, the template of its group's leader.
    fields: dict[str, str] = field(default_factory=dict)
    injected_env: dict[str, str] = field(default_factory=dict)
    leader: PodTemplate | None = None

    @property
    def containers(self) -> list[dict[str, Any]]:
        return self.spec["containers"]

    def container(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.containers if c["name"] == name), None)

    def declared_ports(self) -> dict[str | int, int]:
        """Port name and number -> number, over every container."""
        ports: dict[str | int, int] = {}
        for container in self.containers:
            ports.update(container_ports(container))
        return ports


class Rendered:
    """The objects of one rendered overlay."""

    def __init__(self, overlay: str, objects: list[dict[str, Any]]):
        self.overlay = overlay
        self.objects = objects

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def pod_templates(self) -> list[PodTemplate]:
        """Every workload's pod template; for a LeaderWorkerSet, its leader's and its first worker's
        (worker index 1) of group 0."""
        templates = [PodTemplate(f"{o['kind']}/{o['metadata']['name']}",
                                 o["spec"]["template"]["metadata"].get("labels", {}), o["spec"]["template"]["spec"])
                     for o in self.objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]
        for lws in self.of_kind("LeaderWorkerSet"):
            group = lws_group(lws)
            templates += group[:2]
        return templates

    def pod_of(self, container: dict[str, Any]) -> PodTemplate | None:
        """The pod template holding `container` (the same object)."""
        return next((pod for pod in self.pod_templates()
                     if any(c is container for c in pod.containers + pod.spec.get("initContainers", []))), None)

    def selected(self, selector: dict[str, str]) -> list[PodTemplate]:
        return [t for t in self.pod_templates() if matches(selector, t.labels)]

    def claim_mounts(self, pod: PodTemplate, claim: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(container, volumeMount) for every container and init container of `pod` that mounts `claim`."""
        volumes = {v["name"] for v in pod.spec.get("volumes", [])
                   if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
        return [(c, m) for c in pod.containers + pod.spec.get("initContainers", [])
                for m in c.get("volumeMounts", []) if m["name"] in volumes]

    def spindle_containers(self) -> list[tuple[PodTemplate, dict[str, Any]]]:
        """(pod, container) for every container that runs a Spindle service (`spindle <service>`)."""
        return [(t, c) for t in self.pod_templates() for c in t.containers if c.get("command", [""])[0] == "spindle"]

    def expand(self, container: dict[str, Any], args: list[str]) -> list[str]:
        """`args` with $(VAR) replaced from the container's environment, as the kubelet does."""
        env = self.environment(container)
        return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in args]

    def config_map_data(self, name: str) -> dict[str, str]:
        config_map = self.get("ConfigMap", name)
        assert config_map is not None, f"{self.overlay}: ConfigMap {name} not found"
        return config_map.get("data", {})

    def environment(self, container: dict[str, Any], pod: PodTemplate | None = None) -> dict[str, str]:
        """The container's variables as the kubelet sets them in a pod of `pod` (default: the
        template holding the container): envFrom first, then what a controller injects, then env
        (which wins), each value's $(VAR) references expanded from the variables before it."""
        pod = pod or self.pod_of(container)
        fields = pod.fields if pod else {}
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.config_map_data(source["configMapRef"]["name"]))
        env.update(pod.injected_env if pod else {})
        for var in container.get("env", []):
            secret = var.get("valueFrom", {}).get("secretKeyRef")
            config_key = var.get("valueFrom", {}).get("configMapKeyRef")
            field_ref = var.get("valueFrom", {}).get("fieldRef")
            if secret is not None:  # a stand-in the flag parsers accept (a token: no whitespace)
                env[var["name"]] = f"<secret:{secret['name']}/{secret['key']}>"
            elif config_key is not None:
                env[var["name"]] = self.config_map_data(config_key["name"])[config_key["key"]]
            elif "valueFrom" in var:  # the downward API
                path = (field_ref or {}).get("fieldPath")
                env[var["name"]] = fields.get(path, f"<{var['name']} from the downward API>")
            else:
                env[var["name"]] = expand_references(var.get("value", ""), env)
        return env


@functools.lru_cache(maxsize=None)
def rendered(overlay: str) -> Rendered:
    return Rendered(overlay, [o for o in yaml.safe_load_all(render_text(overlay)) if o])


def expand_references(value: str, env: dict[str, str]) -> str:
    """$(VAR) replaced from `env` as the kubelet does: $$ is a literal $, an unknown $(VAR) stays."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


def lws_group(lws: dict[str, Any], group_index: int = 0) -> list[PodTemplate]:
    """The pods of one group of a LeaderWorkerSet, leader (worker index 0) first: the names, labels
    and LWS_* variables the controller gives them (kubernetes-sigs/lws, pkg/utils/pod/pod_utils.go,
    v0.10.0). The leader template defaults to the worker template."""
    name, namespace = lws["metadata"]["name"], lws["metadata"].get("namespace", NAMESPACE)
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template.get("size", 1)
    leader_name = f"{name}-{group_index}"
    shared = lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared") == "Shared"
    subdomain = name if shared else leader_name
    pods: list[PodTemplate] = []
    for worker_index in range(size):
        pod_template = template.get("leaderTemplate") or template["workerTemplate"]
        if worker_index:
            pod_template = template["workerTemplate"]
        pod_name = leader_name if worker_index == 0 else f"{leader_name}-{worker_index}"
        labels = {**pod_template["metadata"].get("labels", {}), LWS_NAME_LABEL: name,
                  LWS_GROUP_INDEX_LABEL: str(group_index), LWS_WORKER_INDEX_LABEL: str(worker_index)}
        pods.append(PodTemplate(
            f"LeaderWorkerSet/{name}/{'leader' if worker_index == 0 else f'worker-{worker_index}'}",
            labels, pod_template["spec"], revision_label=LWS_REVISION_LABEL,
            fields={"metadata.name": pod_name, "metadata.namespace": namespace},
            injected_env={"LWS_LEADER_ADDRESS": f"{leader_name}.{subdomain}.{namespace}", "LWS_GROUP_SIZE": str(size),
                          "LWS_WORKER_INDEX": str(worker_index)},
            leader=pods[0] if pods else None))
    return pods


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def container_ports(container: dict[str, Any]) -> dict[str | int, int]:
    ports: dict[str | int, int] = {}
    for port in container.get("ports", []):
        ports[port["containerPort"]] = port["containerPort"]
        if "name" in port:
            ports[port["name"]] = port["containerPort"]
    return ports


def probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container}


HEALTH_PROBE = ["python", "-m", "services.common.health_probe"]


def exec_probe(probe: dict[str, Any]) -> dict[str, Any] | None:
    """An exec probe running Spindle's gRPC health probe, as {"host", "port"} of the address it
    checks (the probe runs inside the container); None for any other probe."""
    command = probe.get("exec", {}).get("command", [])
    if command[:3] != HEALTH_PROBE or len(command) < 4:
        return None
    host, port = addr_port(command[3])
    return {"host": host, "port": port}


def addr_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
