"""Renders the kustomize overlays under k8s/ and indexes the objects for the tests in this folder.

`kubectl kustomize` does the rendering (offline); without kubectl the tests skip and say why.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
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
# Certificate and Issuer: test_service_auth.py; Istio's DestinationRule: test_gateway_wiring.py, against
# the schema in schemas/).
CRD_KINDS = {"ServiceMonitor", "InferencePool", "InferenceObjective", "HTTPRoute", "Certificate", "Issuer",
             "DestinationRule"}


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
        return [PodTemplate(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["metadata"].get("labels", {}),
                            o["spec"]["template"]["spec"])
                for o in self.objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]

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

    def environment(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's variables as the kubelet sets them: envFrom first, then env (which wins)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.config_map_data(source["configMapRef"]["name"]))
        for var in container.get("env", []):
            secret = var.get("valueFrom", {}).get("secretKeyRef")
            config_key = var.get("valueFrom", {}).get("configMapKeyRef")
            if secret is not None:  # a stand-in the flag parsers accept (a token: no whitespace)
                env[var["name"]] = f"<secret:{secret['name']}/{secret['key']}>"
            elif config_key is not None:
                env[var["name"]] = self.config_map_data(config_key["name"])[config_key["key"]]
            else:
                env[var["name"]] = var.get("value", f"<{var['name']} from the downward API>")
        return env


@functools.lru_cache(maxsize=None)
def rendered(overlay: str) -> Rendered:
    return Rendered(overlay, [o for o in yaml.safe_load_all(render_text(overlay)) if o])


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
