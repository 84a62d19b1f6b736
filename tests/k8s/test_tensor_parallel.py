"""Tensor parallelism on one node (k8s/tensor-parallel, overlay gpu-tp2): the engine pod holds the
scheduler and one worker container per rank; ranks 0..N-1 each once, each on its own port and GPU;
the scheduler's size and worker addresses are the workers' own; rank 0's rendezvous store is where
every rank can reach it; and every rank probes, drains and mounts as rank 0 does.

Each check is a function of a rendered overlay, so that the tests at the end can show it fails on a
deliberately broken copy."""
from __future__ import annotations

import copy

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, PodTemplate, Rendered, addr_port, exec_probe, probes, rendered
from tests.k8s.service_flags import parse_config, worker_addresses

GPU = "nvidia.com/gpu"
# Overlays that use the component (read from their kustomization, so collection needs no kubectl).
TP_OVERLAYS = [o for o in OVERLAYS if "/tensor-parallel" in (K8S / "overlays" / o / "kustomization.yaml").read_text()]


def is_worker(container: dict) -> bool:
    return container.get("command", [""])[:2] == ["spindle", "worker"]


def tensor_parallel_engines(r: Rendered) -> list[PodTemplate]:
    """Deployment pods with a scheduler and more than one worker container."""
    return [p for p in r.pod_templates() if p.owner.startswith("Deployment/") and p.container("scheduler")
            and sum(map(is_worker, p.containers)) > 1]


def ranks(r: Rendered, pod: PodTemplate) -> dict[int, dict]:
    """rank -> worker container, checking that no rank appears twice."""
    by_rank: dict[int, dict] = {}
    for container in filter(is_worker, pod.containers):
        rank = parse_config("worker", r.environment(container)).tensor_parallel_rank
        assert rank not in by_rank, f"{pod.owner}: rank {rank} in {by_rank[rank]['name']} and {container['name']}"
        by_rank[rank] = container
    return by_rank


def scheduler_addresses(r: Rendered, pod: PodTemplate) -> list[str]:
    """The ranks' addresses the scheduler dials, rank 0 first, as its own flag parser reads them."""
    return worker_addresses(r.environment(pod.container("scheduler")))


def check_one_worker_per_rank(r: Rendered) -> None:
    engines = tensor_parallel_engines(r)
    assert engines, f"{r.overlay}: no engine pod with more than one worker"
    for pod in engines:
        by_rank = ranks(r, pod)
        size = len(scheduler_addresses(r, pod))
        assert sorted(by_rank) == list(range(size)), f"{pod.owner}: ranks {sorted(by_rank)}, scheduler drives {size}"
        ports = [addr_port(r.environment(c)["SPINDLE_WORKER_ADDR"])[1] for c in by_rank.values()]
        assert len(set(ports)) == len(ports), f"{pod.owner}: ranks share a port: {ports}"
        for rank, container in by_rank.items():
            config = parse_config("worker", r.environment(container))
            assert config.tensor_parallel_size == size, (
                f"{container['name']}: size {config.tensor_parallel_size} != {size}")
            limits = container["resources"]["limits"]
            assert limits.get(GPU) == 1, f"{container['name']} (rank {rank}) must hold exactly one GPU: {limits}"


def check_scheduler_dials_where_the_ranks_listen(r: Rendered) -> None:
    for pod in tensor_parallel_engines(r):
        by_rank = ranks(r, pod)
        for rank, address in enumerate(scheduler_addresses(r, pod)):
            listen = r.environment(by_rank[rank])["SPINDLE_WORKER_ADDR"]
            # Loopback both ways: the ranks are reached by their scheduler only.
            assert address == listen and addr_port(address)[0] == "127.0.0.1", (
                f"{pod.owner}: the scheduler dials rank {rank} at {address}, it listens on {listen}")


def check_rendezvous_is_reachable_and_free(r: Rendered) -> None:
    """The scheduler sends every rank rank 0's host as it dials it plus rank 0's tensor-parallel
    port; in one pod, loopback reaches rank 0 from every rank, and no container may use the port."""
    for pod in tensor_parallel_engines(r):
        by_rank = ranks(r, pod)
        host = addr_port(scheduler_addresses(r, pod)[0])[0]
        port = parse_config("worker", r.environment(by_rank[0])).tensor_parallel_port
        assert host == "127.0.0.1", f"{pod.owner}: rendezvous at {host}"
        used = set(pod.declared_ports().values())
        for container in filter(is_worker, pod.containers):
            env = r.environment(container)
            used |= {addr_port(env["SPINDLE_WORKER_ADDR"])[1], int(env["SPINDLE_METRICS_PORT"])}
        assert port not in used, f"{pod.owner}: the rendezvous port {port} is another listener's"


def _without_port(value, port: int):
    """A probe or hook with the rank's own address taken out, to compare ranks."""
    if isinstance(value, dict):
        return {k: _without_port(v, port) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_port(v, port) for v in value]
    return "<own address>" if value == f"127.0.0.1:{port}" else value


def _mounts(container: dict) -> list[tuple]:
    return sorted((m["name"], m["mountPath"], m.get("readOnly", False)) for m in container["volumeMounts"])


def check_ranks_probe_drain_and_mount_as_rank_0(r: Rendered) -> None:
    for pod in tensor_parallel_engines(r):
        by_rank = ranks(r, pod)
        first = by_rank[0]
        first_port = addr_port(r.environment(first)["SPINDLE_WORKER_ADDR"])[1]
        for rank, container in by_rank.items():
            where = f"{pod.owner}/{container['name']} (rank {rank})"
            port = addr_port(r.environment(container)["SPINDLE_WORKER_ADDR"])[1]
            for kind, probe in probes(first).items():
                assert kind in container, f"{where}: no {kind}"
                assert exec_probe(container[kind]) == {"host": "127.0.0.1", "port": port}, f"{where}: {kind}"
                assert _without_port(container[kind], port) == _without_port(probe, first_port), f"{where}: {kind}"
            assert container["lifecycle"] == first["lifecycle"], f"{where}: preStop differs from rank 0's"
            for key in ("image", "envFrom", "resources", "securityContext"):
                assert container.get(key) == first.get(key), f"{where}: {key} differs from rank 0's"
            assert _mounts(container) == _mounts(first), f"{where}: mounts differ from rank 0's"
            env, first_env = r.environment(container), r.environment(first)
            for variable in ("SPINDLE_DEVICE", "SPINDLE_DTYPE", "SPINDLE_MODEL", "SPINDLE_TLS_CERT", "SPINDLE_TLS_CA",
                             "SPINDLE_WORKER_TOKEN", "NCCL_SOCKET_IFNAME"):
                assert env.get(variable) == first_env.get(variable), f"{where}: {variable} differs from rank 0's"
        # One /dev/shm for the pod: NCCL's shared-memory transport between the ranks needs it.
        shm = {m["name"] for c in by_rank.values() for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"}
        assert len(shm) == 1, f"{pod.owner}: ranks mount /dev/shm from {shm}"
        (volume,) = [v for v in pod.spec["volumes"] if v["name"] in shm]
        assert volume["emptyDir"]["medium"] == "Memory"


CHECKS = [check_one_worker_per_rank, check_scheduler_dials_where_the_ranks_listen,
          check_rendezvous_is_reachable_and_free, check_ranks_probe_drain_and_mount_as_rank_0]


def test_some_overlay_runs_tensor_parallel_engines():
    assert "gpu-tp2" in TP_OVERLAYS, TP_OVERLAYS


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("overlay", TP_OVERLAYS)
def test_tensor_parallel_engine(overlay, check):
    check(rendered(overlay))


def test_the_shipped_overlay_has_two_ranks():
    (pod,) = tensor_parallel_engines(rendered("gpu-tp2"))
    assert sorted(ranks(rendered("gpu-tp2"), pod)) == [0, 1]


# Deliberately broken copies of gpu-tp2: each check must fail on its own kind of mistake.

def broken(mutate) -> Rendered:
    r = rendered("gpu-tp2")
    objects = copy.deepcopy(r.objects)
    engine = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "spindle-engine")
    containers = {c["name"]: c for c in engine["spec"]["template"]["spec"]["containers"]}
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("spindle-config"))
    mutate(containers, config["data"])
    return Rendered("gpu-tp2", objects)


def set_env(container: dict, name: str, value: str) -> None:
    (var,) = [v for v in container["env"] if v["name"] == name]
    var["value"] = value


def test_a_duplicated_rank_is_caught():
    r = broken(lambda c, _: set_env(c["worker-1"], "SPINDLE_TENSOR_PARALLEL_RANK", "0"))
    with pytest.raises(AssertionError, match="rank 0 in worker and worker-1"):
        check_one_worker_per_rank(r)


def test_a_size_that_is_not_the_number_of_ranks_is_caught():
    def three_ranks(containers, config):
        config["SPINDLE_TENSOR_PARALLEL_SIZE"] = "3"
        set_env(containers["scheduler"], "SPINDLE_WORKER_ADDRS", "127.0.0.1:50053,127.0.0.1:50054,127.0.0.1:50055")
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\], scheduler drives 3"):
        check_one_worker_per_rank(broken(three_ranks))


def test_a_rank_without_its_own_gpu_is_caught():
    def shared_gpu(containers, _):
        del containers["worker-1"]["resources"]["limits"][GPU]
    with pytest.raises(AssertionError, match="exactly one GPU"):
        check_one_worker_per_rank(broken(shared_gpu))


def test_a_scheduler_dialling_the_wrong_port_is_caught():
    r = broken(lambda c, _: set_env(c["scheduler"], "SPINDLE_WORKER_ADDRS", "127.0.0.1:50053,127.0.0.1:50055"))
    with pytest.raises(AssertionError, match="dials rank 1 at 127.0.0.1:50055"):
        check_scheduler_dials_where_the_ranks_listen(r)


def test_a_rendezvous_port_taken_by_a_rank_is_caught():
    r = broken(lambda c, _: set_env(c["worker"], "SPINDLE_TENSOR_PARALLEL_PORT", "50054"))
    with pytest.raises(AssertionError, match="rendezvous port 50054"):
        check_rendezvous_is_reachable_and_free(r)


def test_a_rank_probing_another_ranks_port_is_caught():
    def probes_rank_0(containers, _):
        containers["worker-1"]["livenessProbe"]["exec"]["command"][-1] = "127.0.0.1:50053"
    with pytest.raises(AssertionError, match="livenessProbe"):
        check_ranks_probe_drain_and_mount_as_rank_0(broken(probes_rank_0))


def test_a_rank_that_stops_before_the_scheduler_drains_is_caught():
    def short_wait(containers, _):
        containers["worker-1"]["lifecycle"]["preStop"]["exec"]["command"][-1] = "30"
    with pytest.raises(AssertionError, match="preStop differs"):
        check_ranks_probe_drain_and_mount_as_rank_0(broken(short_wait))
