"""Pod-level rules: the restricted Pod Security Standard, pinned images, drain that fits in the
termination grace period, GPUs requested by the worker only, only in GPU overlays, and engines and
frontends spread across zones."""
from __future__ import annotations

import pytest

from tests.k8s.manifests import OVERLAYS, rendered

pytestmark = pytest.mark.parametrize("overlay", OVERLAYS)

RESTRICTED_VOLUME_TYPES = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected", "downwardAPI",
                           "csi", "ephemeral"}
GPU = "nvidia.com/gpu"
# After SIGTERM, and after draining, a process needs a moment to close its servers.
CLOSE_MARGIN_S = 10


def test_pods_meet_the_restricted_pod_security_standard(overlay):
    for pod in rendered(overlay).pod_templates():
        security = pod.spec.get("securityContext", {})
        assert security.get("runAsNonRoot") is True, pod.owner
        assert security.get("runAsUser", 1) != 0, pod.owner
        assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault", pod.owner
        assert not pod.spec.get("hostNetwork") and not pod.spec.get("hostPID") and not pod.spec.get("hostIPC")
        for volume in pod.spec.get("volumes", []):
            assert set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES, f"{pod.owner}: {volume}"
        for container in pod.containers + pod.spec.get("initContainers", []):
            where = f"{pod.owner}/{container['name']}"
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("readOnlyRootFilesystem") is True, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("capabilities", {}).get("add"), where
            assert not context.get("privileged"), where


def test_spindle_pods_get_no_token_and_no_service_links(overlay):
    """No API token (Spindle never calls the API); no service links, which would inject variables
    such as SPINDLE_SCHEDULER_PORT=tcp://... into a process that reads every SPINDLE_* as a flag."""
    r = rendered(overlay)
    for pod in {pod.owner: pod for pod, _ in r.spindle_containers()}.values():
        assert pod.spec.get("enableServiceLinks") is False, pod.owner
        assert pod.spec.get("automountServiceAccountToken") is False, pod.owner


def test_images_are_pinned(overlay):
    for pod in rendered(overlay).pod_templates():
        for container in pod.containers:
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag and tag not in ("", "latest"), f"{pod.owner}/{container['name']}: {image}"


ZONE, HOSTNAME = "topology.kubernetes.io/zone", "kubernetes.io/hostname"


def test_engines_and_frontends_spread_across_zones_then_nodes(overlay):
    """A zone outage takes a share of the engines and frontends, not all; ScheduleAnyway, since a
    Pending engine (GPUs are scarce) is worse than an uneven spread."""
    spread = 0
    for pod in rendered(overlay).pod_templates():
        if pod.labels.get("app.kubernetes.io/name") != "spindle" or pod.labels.get("app.kubernetes.io/component") not in (
                "engine", "frontend"):
            continue
        constraints = {c["topologyKey"]: c for c in pod.spec.get("topologySpreadConstraints", [])}
        assert {ZONE, HOSTNAME} <= set(constraints), f"{pod.owner}: spread over {sorted(constraints)}"
        for key in (ZONE, HOSTNAME):
            constraint = constraints[key]
            assert constraint["whenUnsatisfiable"] == "ScheduleAnyway" and constraint["maxSkew"] == 1, pod.owner
            assert constraint["labelSelector"]["matchLabels"] == {
                "app.kubernetes.io/name": "spindle",
                "app.kubernetes.io/component": pod.labels["app.kubernetes.io/component"]}, pod.owner
            # Only this revision's pods count, or a rollout would skew against its own old pods.
            assert constraint.get("matchLabelKeys") == [pod.revision_label], pod.owner
        spread += 1
    assert spread >= 1


def test_writable_paths_are_volumes(overlay):
    """Read-only root filesystem: /tmp (HOME, Hugging Face and CuPy caches) is an emptyDir."""
    for pod, container in rendered(overlay).spindle_containers():
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{pod.owner}/{container['name']}"


def _pre_stop(container) -> list[str]:
    return container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])


def _sleep_s(container) -> float:
    command = _pre_stop(container)
    assert command[:1] == ["sleep"], f"{container['name']}: preStop is not a sleep: {command}"
    return float(command[1])


def test_termination_grace_covers_pre_stop_and_drain(overlay):
    r = rendered(overlay)
    pods = {pod.owner: pod for pod, _ in r.spindle_containers()}
    for pod in pods.values():
        grace = pod.spec["terminationGracePeriodSeconds"]
        containers = {c["name"]: c for c in pod.containers}
        for name in ("frontend", "scheduler"):
            if name in containers:
                drain = float(r.environment(containers[name])["SPINDLE_SHUTDOWN_TIMEOUT"])
                assert grace >= _sleep_s(containers[name]) + drain + CLOSE_MARGIN_S, (
                    f"{pod.owner}: {grace} s cannot hold {name}'s preStop + {drain} s of drain")
        for worker in [c for c in pod.containers if c.get("command", [""])[:2] == ["spindle", "worker"]]:
            # Every worker (every tensor-parallel rank) waits for its scheduler to drain and close,
            # then stops: the scheduler beside it, or a LeaderWorkerSet worker's leader's.
            command = _pre_stop(worker)
            if "scheduler" in containers:
                scheduler, expected = containers["scheduler"], "127.0.0.1:50052"
            else:
                assert pod.leader is not None, f"{pod.owner}: a worker with no scheduler"
                scheduler, expected = pod.leader.container("scheduler"), "$LWS_LEADER_ADDRESS:50052"
                assert "os.path.expandvars(sys.argv[1])" in command[2], "exec hooks expand no variables"
            assert command[-2] == expected, command
            wait_s = float(command[-1])
            drain = float(r.environment(scheduler)["SPINDLE_SHUTDOWN_TIMEOUT"])
            assert wait_s >= _sleep_s(scheduler) + drain, "the worker could stop while the scheduler drains"
            assert grace >= wait_s + CLOSE_MARGIN_S, f"{pod.owner}: {grace} s < worker wait {wait_s} s + close"


def test_startup_probes_allow_for_model_load(overlay):
    """Scheduler and worker turn SERVING only after the model is loaded: give them minutes."""
    minimum_s = 1200 if overlay.startswith("gpu") else 300
    for pod, container in rendered(overlay).spindle_containers():
        if container["name"] in ("scheduler", "worker"):
            probe = container["startupProbe"]
            assert probe["periodSeconds"] * probe["failureThreshold"] >= minimum_s, f"{pod.owner}/{container['name']}"


def test_only_the_worker_requests_a_gpu_and_only_in_gpu_overlays(overlay):
    is_gpu_overlay = overlay.startswith("gpu")
    workers = 0
    for pod in rendered(overlay).pod_templates():
        for container in pod.containers:
            resources = container.get("resources", {})
            wants_gpu = GPU in resources.get("limits", {}) or GPU in resources.get("requests", {})
            # Every worker service: one per engine, or one per tensor-parallel rank.
            if container.get("command", [""])[:2] == ["spindle", "worker"]:
                workers += 1
                assert wants_gpu == is_gpu_overlay, f"{overlay}: worker GPU request is {wants_gpu}"
                if is_gpu_overlay:
                    assert resources["limits"][GPU] == 1
                    assert container["image"].split(":")[0].endswith("spindle-cuda"), container["image"]
                    assert any(t.get("key") == GPU for t in pod.spec.get("tolerations", [])), pod.owner
                    assert pod.spec.get("nodeSelector"), pod.owner
            else:
                assert not wants_gpu, f"{pod.owner}/{container['name']} requests a GPU"
    # One engine: its worker, or one per rank (test_tensor_parallel.py checks their number).
    assert workers >= 1, f"{overlay}: {workers} worker containers"


def test_workers_have_a_memory_backed_dev_shm(overlay):
    for pod, container in rendered(overlay).spindle_containers():
        if container["name"] == "worker":
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
            volume = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
            assert volume["emptyDir"]["medium"] == "Memory"


def test_containers_have_requests_and_memory_limits(overlay):
    for pod in rendered(overlay).pod_templates():
        for container in pod.containers:
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{pod.owner}/{container['name']}"
            assert "memory" in resources.get("limits", {}), f"{pod.owner}/{container['name']}"
