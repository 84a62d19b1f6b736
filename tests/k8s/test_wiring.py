"""What schemas cannot express: selectors find pods, and every probe, Service, NetworkPolicy and
reference points at something that exists in the same rendered overlay."""
from __future__ import annotations

import pytest

from tests.k8s.manifests import LWS_NAME_LABEL, OVERLAYS, container_ports, exec_probe, matches, probes, rendered

pytestmark = pytest.mark.parametrize("overlay", OVERLAYS)


def test_workload_selectors_match_their_pod_labels(overlay):
    for obj in rendered(overlay).of_kind("Deployment"):
        selector = obj["spec"]["selector"]["matchLabels"]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert matches(selector, labels), f"Deployment/{obj['metadata']['name']}: {selector} vs {labels}"


def test_services_select_pods_that_declare_their_target_ports(overlay):
    r = rendered(overlay)
    for service in r.of_kind("Service"):
        name = service["metadata"]["name"]
        pods = r.selected(service["spec"]["selector"])
        assert pods, f"Service/{name} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in pods:
                assert target in pod.declared_ports(), f"Service/{name} targets {target!r}, not declared by {pod.owner}"


def test_probes_target_declared_ports(overlay):
    for pod in rendered(overlay).pod_templates():
        for container in pod.containers:
            ports = container_ports(container)
            for kind, probe in probes(container).items():
                handler = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc") or exec_probe(probe)
                assert handler is not None, (
                    f"{pod.owner}/{container['name']} {kind}: no http, tcp, grpc or health_probe check")
                assert handler["port"] in ports, (
                    f"{pod.owner}/{container['name']} {kind} targets {handler['port']!r}; "
                    f"declared: {sorted(map(str, ports))}")


def test_every_spindle_container_has_all_three_probes(overlay):
    for pod, container in rendered(overlay).spindle_containers():
        assert set(probes(container)) == {"startupProbe", "readinessProbe", "livenessProbe"}, (
            f"{pod.owner}/{container['name']}")


def test_pod_disruption_budgets_select_pods(overlay):
    r = rendered(overlay)
    for pdb in r.of_kind("PodDisruptionBudget"):
        assert r.selected(pdb["spec"]["selector"]["matchLabels"]), f"PDB/{pdb['metadata']['name']} selects no pod"


def test_network_policies_select_pods_and_admit_declared_ports(overlay):
    r = rendered(overlay)
    for policy in r.of_kind("NetworkPolicy"):
        name = policy["metadata"]["name"]
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        pods = r.selected(selector)
        assert pods, f"NetworkPolicy/{name} selects no pod"
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert r.selected(peer["podSelector"]["matchLabels"]), f"NetworkPolicy/{name}: peer matches no pod"
            for port in rule.get("ports", []):
                assert any(port["port"] in pod.declared_ports() for pod in pods), (
                    f"NetworkPolicy/{name} admits port {port['port']}, which no selected pod declares")


def test_a_default_deny_policy_covers_the_namespace(overlay):
    policies = rendered(overlay).of_kind("NetworkPolicy")
    assert any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies)


def test_only_the_frontend_port_is_open_to_every_source(overlay):
    """Rules without `from` admit any source; only the OpenAI/gRPC front door, the EPP's ext-proc and
    the SMG gateway's HTTP API (8080) may be such."""
    open_ports = set()
    for policy in rendered(overlay).of_kind("NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            if "from" not in rule:
                open_ports |= {p["port"] for p in rule.get("ports", [])}
    assert open_ports <= {8000, 50051, 9002, 8080}, open_ports


def test_the_worker_port_is_admitted_from_no_peer(overlay):
    """Except, in a LeaderWorkerSet, from the pods of the set: a rule for every port (no `ports`)
    opens 50053 too, so it may only admit those (test_leaderworkerset.py checks the group's rule)."""
    r = rendered(overlay)
    for policy in r.of_kind("NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            assert 50053 not in ports, policy["metadata"]["name"]
            if not ports:
                assert all(set(peer) == {"podSelector"} and LWS_NAME_LABEL in peer["podSelector"].get("matchLabels", {})
                           for peer in rule.get("from", [{}])), f"{policy['metadata']['name']} opens every port"


def test_hpas_target_existing_deployments_that_leave_replicas_to_them(overlay):
    r = rendered(overlay)
    for hpa in r.of_kind("HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        deployment = r.get(target["kind"], target["name"])
        assert deployment is not None, f"HPA/{hpa['metadata']['name']} targets a missing {target}"
        assert "replicas" not in deployment["spec"], f"{target['name']} sets replicas; its HPA owns the count"
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_topology_spread_selects_its_own_pods(overlay):
    for pod in rendered(overlay).pod_templates():
        for constraint in pod.spec.get("topologySpreadConstraints", []):
            assert matches(constraint["labelSelector"]["matchLabels"], pod.labels), pod.owner


def test_referenced_config_maps_and_claims_exist(overlay):
    r = rendered(overlay)
    for pod in r.pod_templates():
        for volume in pod.spec.get("volumes", []):
            if "configMap" in volume:
                assert r.get("ConfigMap", volume["configMap"]["name"]), f"{pod.owner}: {volume}"
            if "persistentVolumeClaim" in volume:
                assert r.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]), pod.owner
        for container in pod.containers:
            for source in container.get("envFrom", []):
                assert r.get("ConfigMap", source["configMapRef"]["name"]), f"{pod.owner}/{container['name']}"
            names = {v["name"] for v in pod.spec.get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in names, f"{pod.owner}/{container['name']} mounts unknown volume {mount['name']}"


def test_service_accounts_exist(overlay):
    r = rendered(overlay)
    for pod in r.pod_templates():
        account = pod.spec.get("serviceAccountName")
        if account:
            assert r.get("ServiceAccount", account), f"{pod.owner} uses missing ServiceAccount {account}"
    for binding in r.of_kind("RoleBinding") + r.of_kind("ClusterRoleBinding"):
        role = binding["roleRef"]
        where = f"{binding['kind']}/{binding['metadata']['name']}"
        assert r.get(role["kind"], role["name"]), f"{where} binds a missing role"
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount":
                account = r.get("ServiceAccount", subject["name"])
                assert account and subject.get("namespace") == account["metadata"]["namespace"], subject
