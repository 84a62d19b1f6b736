"""The manifests agree with the services' own flags: every SPINDLE_* variable is a flag of the
service it is given to, the values parse, listen ports are declared, every dialled address reaches
the port its peer listens on, and the ports are the flags' defaults (the same as `make run`)."""
from __future__ import annotations

import pytest

from tests.k8s.manifests import (OVERLAYS, Rendered, addr_port, container_ports, exec_probe, lws_group, probes,
                                 rendered)
from tests.k8s.service_flags import ASSUMED_FLAGS, SERVICES, flag_defaults, parse_config, worker_addresses

pytestmark = pytest.mark.parametrize("overlay", OVERLAYS)

# The variables each service listens on, and the port flag's default.
LISTEN_FLAGS = {
    "frontend": ("SPINDLE_HTTP_PORT", "SPINDLE_FRONTEND_GRPC_ADDR"),
    "scheduler": ("SPINDLE_SCHEDULER_ADDR",),
    "worker": ("SPINDLE_WORKER_ADDR",),
}


def service_of(container) -> str:
    service = container["command"][1]
    assert service in SERVICES, container["command"]
    return service


def listen_port(env: dict[str, str], variable: str) -> int:
    value = env[variable]
    return int(value) if variable.endswith("_PORT") else addr_port(value)[1]


def default_port(service: str, variable: str) -> int:
    default = flag_defaults(service)[variable]
    return int(default) if variable.endswith("_PORT") else addr_port(default)[1]


def test_every_spindle_variable_is_a_flag_of_its_service(overlay):
    r = rendered(overlay)
    for pod, container in r.spindle_containers():
        service = service_of(container)
        known = set(flag_defaults(service)) | set(ASSUMED_FLAGS.get(service, {}))
        own = {v["name"] for v in container.get("env", []) if v["name"].startswith("SPINDLE_")}
        assert own <= known, f"{pod.owner}/{container['name']}: not flags of {service}: {own - known}"
        for source in container.get("envFrom", []):
            shared = {k for k in r.config_map_data(source["configMapRef"]["name"]) if k.startswith("SPINDLE_")}
            every_flag = set().union(*(flag_defaults(s) for s in SERVICES))
            assert shared <= every_flag, f"shared settings that no service reads: {shared - every_flag}"


def test_assumed_flags_exist_with_the_defaults_assumed(overlay):
    for service, flags in ASSUMED_FLAGS.items():
        for variable, assumed in flags.items():
            assert variable in flag_defaults(service), (service, variable)
            assert flag_defaults(service)[variable] == assumed, (service, variable)


def test_containers_configs_parse(overlay):
    r = rendered(overlay)
    for pod, container in r.spindle_containers():
        try:
            parse_config(service_of(container), r.environment(container))
        except (SystemExit, ValueError) as exc:
            pytest.fail(f"{pod.owner}/{container['name']}: the service rejects its environment: {exc!r}")


def tensor_parallel_rank(r: Rendered, container) -> int:
    """The worker's rank (0 without tensor parallelism): rank r of one pod listens on port + r."""
    return parse_config("worker", r.environment(container)).tensor_parallel_rank


def test_listen_addresses_are_declared_ports_and_flag_defaults(overlay):
    r = rendered(overlay)
    for pod, container in r.spindle_containers():
        service = service_of(container)
        env = r.environment(container)
        declared = set(container_ports(container).values())
        # Tensor-parallel ranks in one pod listen on consecutive ports; in pods of their own, all
        # on the default (the rank's own pod address tells them apart).
        is_shared_pod = service == "worker" and len(_listener_containers(pod, service)) > 1
        shift = tensor_parallel_rank(r, container) if is_shared_pod else 0
        # Loopback only where nothing outside the container needs the port: every probe runs in it.
        is_probed_inside = all(exec_probe(p) is not None for p in probes(container).values())
        for variable in LISTEN_FLAGS[service]:
            assert variable in env, f"{pod.owner}/{container['name']} does not set {variable}"
            port = listen_port(env, variable)
            assert port in declared, f"{pod.owner}/{container['name']} listens on {port}, declares {declared}"
            assert port == default_port(service, variable) + shift, f"{variable}={env[variable]}: not the default port"
            if variable.endswith("_ADDR"):
                hosts = {"0.0.0.0", "127.0.0.1"} if service == "worker" and is_probed_inside else {"0.0.0.0"}
                assert addr_port(env[variable])[0] in hosts, f"{variable} must listen on all addresses"
        if service == "frontend":
            assert env["SPINDLE_HTTP_HOST"] == "0.0.0.0"


def test_metrics_ports_are_declared(overlay):
    r = rendered(overlay)
    for pod, container in r.spindle_containers():
        service = service_of(container)
        env = r.environment(container)
        if service in ASSUMED_FLAGS:
            port = int(env["SPINDLE_METRICS_PORT"])
            if service == "worker" and tensor_parallel_rank(r, container) > 0 and port == 0:
                continue  # a rank other than 0 may leave metrics off: rank 0's step times are the group's
            assert port == ASSUMED_FLAGS[service]["SPINDLE_METRICS_PORT"]
            assert container_ports(container).get(f"{'sched' if service == 'scheduler' else service}-metrics") == port


def _listener_containers(pod, service: str) -> list[dict]:
    return [c for c in pod.containers if c.get("command", [""])[0] == "spindle" and service_of(c) == service]


def _listeners(r: Rendered, pod, service: str) -> set[int]:
    """Ports that `service` containers of `pod` listen on."""
    return {listen_port(r.environment(c), LISTEN_FLAGS[service][0]) for c in _listener_containers(pod, service)}


def _group_pod(r: Rendered, host: str):
    """(leader, pod) of the LeaderWorkerSet group-0 pod whose stable name is `host`
    (<pod>.<subdomain>.<namespace>); (None, None) when no pod has that name."""
    for lws in r.of_kind("LeaderWorkerSet"):
        group = lws_group(lws)
        for member in group:
            subdomain = member.injected_env["LWS_LEADER_ADDRESS"].split(".", 1)[1]
            if host == f"{member.fields['metadata.name']}.{subdomain}":
                return group[0], member
    return None, None


def _reaches(r: Rendered, pod, address: str, service: str) -> bool:
    """True when `address`, dialled from `pod`, lands on a `service` container's listen port."""
    host, port = addr_port(address)
    if host in ("127.0.0.1", "localhost"):
        return port in _listeners(r, pod, service)
    target = r.get("Service", host)
    if target is None:
        return False
    for service_port in target["spec"]["ports"]:
        if service_port["port"] != port:
            continue
        backends = r.selected(target["spec"]["selector"])
        return bool(backends) and all(
            backend.declared_ports().get(service_port.get("targetPort", port)) in _listeners(r, backend, service)
            for backend in backends)
    return False


def test_dialled_addresses_reach_their_peers(overlay):
    r = rendered(overlay)
    for pod, container in r.spindle_containers():
        service = service_of(container)
        env = r.environment(container)
        if service == "frontend":
            assert _reaches(r, pod, env["SPINDLE_SCHEDULER_ADDR"], "scheduler"), (
                f"{pod.owner}: SPINDLE_SCHEDULER_ADDR={env['SPINDLE_SCHEDULER_ADDR']} reaches no scheduler")
        if service == "scheduler":
            # The workers (one per tensor-parallel rank) belong to this scheduler alone: each is in
            # the same pod, or in a pod of its LeaderWorkerSet group, dialled by the pod's own name.
            for address in worker_addresses(env):
                host, port = addr_port(address)
                if host == "127.0.0.1":
                    assert _reaches(r, pod, address, "worker"), f"{pod.owner}: {address} reaches no worker"
                    continue
                leader, target = _group_pod(r, host)
                assert target is not None and leader.owner == pod.owner, (
                    f"{pod.owner}: worker address {address} is neither in the pod nor a pod of its group")
                assert port in _listeners(r, target, "worker"), f"{pod.owner}: {address} reaches no worker"


def test_scheduler_and_worker_agree_on_batch_limits(overlay):
    r = rendered(overlay)
    for pod in r.pod_templates():
        configs = {}
        for container in pod.containers:
            if container.get("command", [""])[0] == "spindle" and service_of(container) in ("scheduler", "worker"):
                configs[service_of(container)] = parse_config(service_of(container), r.environment(container))
        if len(configs) == 2:
            assert configs["scheduler"].scheduler.max_num_seqs == configs["worker"].max_num_seqs
            assert configs["scheduler"].scheduler.max_num_batched_tokens == configs["worker"].max_num_batched_tokens


def test_frontend_and_worker_serve_the_same_model(overlay):
    r = rendered(overlay)
    models = {(service_of(c), r.environment(c).get("SPINDLE_MODEL", "")) for _, c in r.spindle_containers()
              if service_of(c) in ("frontend", "worker")}
    assert len({model for _, model in models}) == 1, models
