"""The multi-node engine (overlay gpu-leaderworkerset): a LeaderWorkerSet validated against the
published CRD schema (schemas/leaderworkerset_v1.yaml, unknown fields refused) and its pod templates
against Kubernetes' own; one group is one engine of `size` ranks, the leader running the scheduler
and rank 0, worker pod r rank r (from LWS_WORKER_INDEX); the scheduler dials every rank by its
pod's stable name, through the headless Service the controller makes, rank 0's name being the
rendezvous every rank resolves; the group's pods reach each other and nothing else reaches the
workers; a dead rank recreates the group.

The checks take a rendered overlay, so that the tests at the end can show each fails on a broken copy.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.k8s.manifests import (K8S, LWS_NAME_LABEL, OVERLAYS, PodTemplate, Rendered, addr_port, lws_group,
                                 matches, rendered)
from tests.k8s.service_flags import parse_config, worker_addresses
from tests.k8s.test_gateway_wiring import strict

SCHEMA = Path(__file__).parent / "schemas" / "leaderworkerset_v1.yaml"
API_VERSION = "leaderworkerset.x-k8s.io/v1"
GPU = "nvidia.com/gpu"
# Overlays that ship a LeaderWorkerSet (read from their folder, so collection needs no kubectl).
LWS_OVERLAYS = [o for o in OVERLAYS if "kind: LeaderWorkerSet" in "".join(
    p.read_text() for p in (K8S / "overlays" / o).glob("*.yaml"))]


@functools.lru_cache(maxsize=None)
def validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(yaml.safe_load(SCHEMA.read_text())))


def schema_errors(lws: dict) -> list[str]:
    """What the CRD's schema says against `lws` (metadata is the API server's; CEL rules aside)."""
    body = {k: v for k, v in lws.items() if k != "metadata"}
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator().iter_errors(body)]


def is_worker(container: dict) -> bool:
    return container.get("command", [""])[:2] == ["spindle", "worker"]


def the_lws(r: Rendered) -> dict:
    (lws,) = r.of_kind("LeaderWorkerSet")
    return lws


def workers_of(pod: PodTemplate) -> list[dict]:
    return [c for c in pod.containers if is_worker(c)]


def stable_name(pod: PodTemplate) -> str:
    """<pod>.<subdomain>.<namespace>: the pod's name in the controller's headless Service."""
    return f"{pod.fields['metadata.name']}.{pod.injected_env['LWS_LEADER_ADDRESS'].split('.', 1)[1]}"


def check_schema(r: Rendered) -> None:
    for lws in r.of_kind("LeaderWorkerSet"):
        assert lws["apiVersion"] == API_VERSION, lws["apiVersion"]
        errors = schema_errors(lws)
        assert not errors, errors


def check_group_is_one_engine(r: Rendered) -> None:
    """size pods, one rank each: the leader's scheduler and rank 0, worker pod r rank r."""
    lws = the_lws(r)
    group = lws_group(lws)
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert len(group) == size >= 2, f"size {size}: one pod per rank, at least 2"
    leader = group[0]
    assert leader.container("scheduler") is not None, "the leader runs the scheduler"
    assert [c["name"] for c in leader.containers].count("scheduler") == 1
    for pod in group:
        (worker,) = workers_of(pod)  # one rank per pod
        config = parse_config("worker", r.environment(worker, pod))
        index = int(pod.labels["leaderworkerset.sigs.k8s.io/worker-index"])
        assert config.tensor_parallel_rank == index, f"{pod.owner}: rank {config.tensor_parallel_rank}"
        assert config.tensor_parallel_size == size, f"{pod.owner}: size {config.tensor_parallel_size} != {size}"
        assert worker["resources"]["limits"].get(GPU) == 1, f"{pod.owner}: one GPU per rank"
        assert sum(c.get("resources", {}).get("limits", {}).get(GPU, 0) for c in pod.containers) == 1, pod.owner
    # Worker pods take their rank from the controller: one template serves every index.
    (worker,) = workers_of(group[1])
    rank_var = next(v for v in worker["env"] if v["name"] == "SPINDLE_TENSOR_PARALLEL_RANK")
    assert rank_var["value"] == "$(LWS_WORKER_INDEX)", rank_var
    (leader_worker,) = workers_of(leader)
    assert parse_config("worker", r.environment(leader_worker, leader)).tensor_parallel_rank == 0


def check_scheduler_dials_every_rank_by_its_stable_name(r: Rendered) -> None:
    lws = the_lws(r)
    group = lws_group(lws)
    leader = group[0]
    scheduler = leader.container("scheduler")
    addresses = worker_addresses(r.environment(scheduler, leader))
    assert len(addresses) == len(group), f"the scheduler drives {len(addresses)} ranks, the group has {len(group)}"
    for pod, address in zip(group, addresses):
        (worker,) = workers_of(pod)
        host, port = addr_port(address)
        assert host == stable_name(pod), f"rank {pod.fields['metadata.name']} dialled at {host}, not {stable_name(pod)}"
        listen_host, listen_port = addr_port(r.environment(worker, pod)["SPINDLE_WORKER_ADDR"])
        assert (listen_host, listen_port) == ("0.0.0.0", port), f"{pod.owner} listens on {listen_host}:{listen_port}"


def check_rendezvous_resolves_from_every_rank(r: Rendered) -> None:
    """Rank 0's host as the scheduler dials it is the rendezvous: the leader's stable name, the
    LWS_LEADER_ADDRESS every pod is given, in a headless Service the controller creates (Shared:
    one Service named after the LeaderWorkerSet, publishing pods before they are ready)."""
    lws = the_lws(r)
    group = lws_group(lws)
    leader = group[0]
    host = addr_port(worker_addresses(r.environment(leader.container("scheduler"), leader))[0])[0]
    for pod in group:
        assert host == pod.injected_env["LWS_LEADER_ADDRESS"], f"{pod.owner} knows the leader as another name"
    assert lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared") == "Shared"
    name = lws["metadata"]["name"]
    assert host.split(".")[1] == name, f"rendezvous {host} is not in the Service {name}"
    # A Service of that name in the manifests would be used instead of the controller's.
    assert r.get("Service", name) is None, f"Service/{name} would shadow the LeaderWorkerSet's headless Service"


def check_restart_and_start_up(r: Rendered) -> None:
    spec = the_lws(r)["spec"]
    # One rank's restart recreates the group, so every rank starts clean together.
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The leader is ready only once every rank has joined: workers cannot wait for it.
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"


def _policies_selecting(r: Rendered, pod: PodTemplate) -> list[dict]:
    return [p for p in r.of_kind("NetworkPolicy")
            if matches(p["spec"]["podSelector"].get("matchLabels", {}), pod.labels)]


def _admits_group_on_every_port(rule: dict, group: list[PodTemplate]) -> bool:
    return bool(rule.get("from")) and not rule.get("ports") and any(
        set(peer) == {"podSelector"}
        and all(matches(peer["podSelector"].get("matchLabels", {}), q.labels) for q in group)
        for peer in rule["from"])


def check_group_peers_and_nothing_else_reach_the_ranks(r: Rendered) -> None:
    lws = the_lws(r)
    group = lws_group(lws)
    peers = {LWS_NAME_LABEL: lws["metadata"]["name"]}
    for pod in group:
        policies = _policies_selecting(r, pod)
        # Every TCP port from every pod of the group: gRPC, the rendezvous store, NCCL's ephemeral ports.
        assert any(_admits_group_on_every_port(rule, group)
                   for policy in policies for rule in policy["spec"].get("ingress", [])), (
            f"{pod.owner}: no policy admits the group's pods on every port")
        worker_port = addr_port(r.environment(workers_of(pod)[0], pod)["SPINDLE_WORKER_ADDR"])[1]
        for policy in policies:
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])}
                if ports and worker_port not in ports:
                    continue
                # A rule that opens a rank's port admits group peers only.
                assert "from" in rule, f"NetworkPolicy/{policy['metadata']['name']} opens {pod.owner} to every source"
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"} and peer["podSelector"].get("matchLabels") == peers, (
                        f"NetworkPolicy/{policy['metadata']['name']} admits {peer} to {pod.owner}'s worker port")


def check_every_rank_has_dev_shm_and_waits_for_its_scheduler(r: Rendered) -> None:
    for pod in lws_group(the_lws(r)):
        (worker,) = workers_of(pod)
        (mount,) = [m for m in worker["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in pod.spec["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory", f"{pod.owner}: NCCL needs a memory-backed /dev/shm"
        address = worker["lifecycle"]["preStop"]["exec"]["command"][-2]
        expected = "127.0.0.1:50052" if pod.container("scheduler") else "$LWS_LEADER_ADDRESS:50052"
        assert address == expected, f"{pod.owner}: the rank waits for {address}"


CHECKS = [check_schema, check_group_is_one_engine, check_scheduler_dials_every_rank_by_its_stable_name,
          check_rendezvous_resolves_from_every_rank, check_restart_and_start_up,
          check_group_peers_and_nothing_else_reach_the_ranks, check_every_rank_has_dev_shm_and_waits_for_its_scheduler]


def test_some_overlay_ships_a_leader_worker_set():
    assert "gpu-leaderworkerset" in LWS_OVERLAYS, LWS_OVERLAYS


def test_the_schema_refuses_what_the_api_server_refuses():
    container = {"name": "c", "image": "i:1"}
    good = {"apiVersion": API_VERSION, "kind": "LeaderWorkerSet", "metadata": {"name": "x"},
            "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": {"containers": [container]}}}}}
    assert not schema_errors(good)
    template = good["spec"]["leaderWorkerTemplate"]
    for bad in ({**template, "restartPolicy": "Always"},  # not an enum value
                {**template, "groupSize": 2},  # unknown field
                {**template, "workerTemplate": {"spec": {"containers": [{**container, "imagePullPolcy": "Always"}]}}},
                {**template, "leaderTemplate": {"spec": {"containers": [{"image": "i:1"}]}}},  # no container name
                {"size": 2}):  # no worker template
        assert schema_errors({**good, "spec": {"leaderWorkerTemplate": bad}}), bad
    assert schema_errors({**good, "spec": {**good["spec"], "startupPolicy": "LeaderStarted"}})


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_leader_worker_set(overlay, check):
    check(rendered(overlay))


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_pod_templates_validate_strict(overlay):
    """The templates as PodTemplates, against each Kubernetes version's schema (the CRD's schema is
    of the Kubernetes version lws was built with)."""
    kv_utils = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate not installed")
    from tests.k8s.test_schemas import VERSIONS

    for lws in rendered(overlay).of_kind("LeaderWorkerSet"):
        for role in ("leaderTemplate", "workerTemplate"):
            template = lws["spec"]["leaderWorkerTemplate"][role]
            obj = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()}, "template": template}
            for version in VERSIONS:
                kv_utils.validate(obj, version, strict=True)


def test_the_shipped_group_has_two_ranks():
    assert len(lws_group(the_lws(rendered("gpu-leaderworkerset")))) == 2


# Deliberately broken copies of gpu-leaderworkerset: each check must fail on its own kind of mistake.

def broken(mutate) -> Rendered:
    r = rendered("gpu-leaderworkerset")
    objects = copy.deepcopy(r.objects)
    mutate(next(o for o in objects if o["kind"] == "LeaderWorkerSet"), objects)
    return Rendered(r.overlay, objects)


def _container(lws: dict, role: str, name: str) -> dict:
    return next(c for c in lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"] if c["name"] == name)


def _set_env(container: dict, name: str, value: str) -> None:
    next(v for v in container["env"] if v["name"] == name)["value"] = value


def test_an_unknown_field_is_caught():
    def typo(lws, _):
        lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnRestart"
        _container(lws, "workerTemplate", "worker")["imagePullPolcy"] = "Always"
    with pytest.raises(AssertionError, match="imagePullPolcy"):
        check_schema(broken(typo))


def test_a_worker_pod_claiming_rank_0_is_caught():
    def rank_0(lws, _):
        _set_env(_container(lws, "workerTemplate", "worker"), "SPINDLE_TENSOR_PARALLEL_RANK", "0")
    r = broken(rank_0)
    with pytest.raises(AssertionError, match="worker-1: rank 0"):
        check_group_is_one_engine(r)


def test_a_group_larger_than_the_scheduler_drives_is_caught():
    def three_pods(lws, _):
        lws["spec"]["leaderWorkerTemplate"]["size"] = 3
    # The scheduler's size is LWS_GROUP_SIZE: its own parser refuses two addresses for three ranks.
    with pytest.raises(ValueError, match="names 2 workers, --tensor-parallel-size is 3"):
        check_scheduler_dials_every_rank_by_its_stable_name(broken(three_pods))

    def three_pods_fixed_size(lws, objects):
        three_pods(lws, objects)
        _set_env(_container(lws, "leaderTemplate", "scheduler"), "SPINDLE_TENSOR_PARALLEL_SIZE", "2")
    with pytest.raises(AssertionError, match="drives 2 ranks, the group has 3"):
        check_scheduler_dials_every_rank_by_its_stable_name(broken(three_pods_fixed_size))


def test_a_rank_dialled_at_a_name_no_pod_has_is_caught():
    def wrong_subdomain(lws, _):
        _set_env(_container(lws, "leaderTemplate", "scheduler"), "SPINDLE_WORKER_ADDRS",
                 "$(POD_NAME).spindle-engine.$(POD_NAMESPACE):50053,$(POD_NAME)-1.spindle.$(POD_NAMESPACE):50053")
    with pytest.raises(AssertionError, match="dialled at spindle-engine-0-1.spindle.spindle"):
        check_scheduler_dials_every_rank_by_its_stable_name(broken(wrong_subdomain))


def test_a_loopback_rendezvous_is_caught():
    def loopback(lws, _):
        _set_env(_container(lws, "leaderTemplate", "scheduler"), "SPINDLE_WORKER_ADDRS",
                 "127.0.0.1:50053,$(POD_NAME)-1.spindle-engine.$(POD_NAMESPACE):50053")
    with pytest.raises(AssertionError, match="knows the leader as another name"):
        check_rendezvous_resolves_from_every_rank(broken(loopback))


def test_a_group_that_outlives_a_dead_rank_is_caught():
    def none(lws, _):
        lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "None"
    with pytest.raises(AssertionError):
        check_restart_and_start_up(broken(none))


def test_a_worker_port_open_beyond_the_group_is_caught():
    def open_to_namespace(_, objects):
        policy = next(o for o in objects
                      if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "spindle-engine-group")
        policy["spec"]["ingress"][0]["from"].append({"podSelector": {}})
    with pytest.raises(AssertionError, match="admits {'podSelector': {}}"):
        check_group_peers_and_nothing_else_reach_the_ranks(broken(open_to_namespace))


def test_a_group_without_its_peer_policy_is_caught():
    def no_policy(_, objects):
        objects[:] = [o for o in objects if not (o["kind"] == "NetworkPolicy"
                                                 and o["metadata"]["name"] == "spindle-engine-group")]
    with pytest.raises(AssertionError, match="no policy admits the group's pods"):
        check_group_peers_and_nothing_else_reach_the_ranks(broken(no_policy))
