"""Every overlay turns service-to-service authentication on, and wires it so that it works: each
Spindle container gets its certificate (mutual TLS) or its tokens, from Secrets; each scheduler
admits the identity its frontends present and each worker its scheduler's; server certificates
cover the addresses dialled; a frontend never holds the worker's token; the TLS ports are probed
by the in-container health probe (the kubelet's grpc probe cannot do TLS); and cert-manager's
Certificates and Issuers form the chain the Secrets come from."""
from __future__ import annotations

import ipaddress

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, PodTemplate, Rendered, addr_port, exec_probe, probes, rendered
from tests.k8s.service_flags import parse_config, worker_addresses

pytestmark = pytest.mark.parametrize("overlay", OVERLAYS)

TLS_VARIABLES = {"SPINDLE_TLS_CERT": "tls.crt", "SPINDLE_TLS_KEY": "tls.key", "SPINDLE_TLS_CA": "ca.crt"}
# Who sends and who accepts which token.
TOKENS = {
    "frontend": {"SPINDLE_SCHEDULER_TOKEN"},
    "scheduler": {"SPINDLE_SCHEDULER_TOKEN", "SPINDLE_WORKER_TOKEN"},
    "worker": {"SPINDLE_WORKER_TOKEN"},
}
# Created by hand, never by the manifests: the file that says how.
HAND_MADE_SECRETS = {"spindle-scheduler-token": "service-token/kustomization.yaml",
                     "spindle-worker-token": "service-token/kustomization.yaml",
                     # Optional: the model Job's Hugging Face token, for gated repositories.
                     "spindle-hf-token": "model-store/model-fetch-job.yaml"}
CERT_MANAGER = "cert-manager.io/v1"


def _service(container) -> str:
    return container["command"][1]


def _secret_of_mount(pod: PodTemplate, container, path: str) -> str | None:
    """The Secret mounted at the folder holding `path` in `container`, if any."""
    folder = path.rsplit("/", 1)[0]
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"].rstrip("/") == folder:
            volume = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
            return volume.get("secret", {}).get("secretName")
    return None


def _token_refs(container) -> dict[str, str]:
    """SPINDLE_*_TOKEN variable -> the Secret it comes from (a literal value maps to "")."""
    refs = {}
    for var in container.get("env", []):
        if var["name"].endswith("_TOKEN") or var["name"].endswith("_TOKEN_FILE"):
            refs[var["name"]] = var.get("valueFrom", {}).get("secretKeyRef", {}).get("name", "")
    return refs


def _tls_secret(pod: PodTemplate, container) -> str | None:
    """The Secret this container's SPINDLE_TLS_* files come from; None without TLS."""
    env = {v["name"]: v.get("value") for v in container.get("env", [])}
    if not set(TLS_VARIABLES) & set(env):
        return None
    secrets = set()
    for variable, key in TLS_VARIABLES.items():
        path = env.get(variable)
        where = f"{pod.owner}/{container['name']}: {variable}"
        assert path is not None and path.endswith("/" + key), f"{where} = {path!r}, expected a mounted {key}"
        secret = _secret_of_mount(pod, container, path)
        assert secret is not None, f"{where}: {path} is not in a mounted Secret"
        secrets.add(secret)
    assert len(secrets) == 1, f"{pod.owner}/{container['name']}: certificate, key and CA from {secrets}"
    return secrets.pop()


def _certificates(r: Rendered) -> dict[str, dict]:
    """Secret name -> the cert-manager Certificate that writes it."""
    return {c["spec"]["secretName"]: c for c in r.of_kind("Certificate")}


def _identity(certificate: dict) -> set[str]:
    return {certificate["spec"].get("commonName"), *certificate["spec"].get("dnsNames", [])} - {None}


def _covers(certificate: dict, host: str) -> bool:
    """True when a client dialling `host` accepts the server certificate's names."""
    try:
        ipaddress.ip_address(host)
        return host in certificate["spec"].get("ipAddresses", [])
    except ValueError:
        names = certificate["spec"].get("dnsNames", [])
        # A wildcard stands for exactly one leftmost label (RFC 6125).
        return host in names or ("." in host and f"*.{host.split('.', 1)[1]}" in names)


def _hours(duration: str) -> int:
    assert duration.endswith("h") and duration[:-1].isdigit(), f"durations here are in hours: {duration}"
    return int(duration[:-1])


def _spindle(r: Rendered) -> list[tuple[PodTemplate, dict, str]]:
    return [(pod, container, _service(container)) for pod, container in r.spindle_containers()]


def test_every_spindle_container_authenticates(overlay):
    r = rendered(overlay)
    for pod, container, service in _spindle(r):
        where = f"{pod.owner}/{container['name']}"
        config = parse_config(service, r.environment(container))
        is_tls = _tls_secret(pod, container) is not None
        tokens = _token_refs(container)
        assert is_tls or tokens, f"{where}: neither a certificate nor a token"
        if service == "frontend":
            assert config.scheduler_auth.is_tls == is_tls
            assert is_tls or config.scheduler_auth.client_token is not None, where
        else:
            assert config.auth.is_server_auth_enforced, f"{where} would serve anyone"
        if tokens:
            assert set(tokens) == TOKENS[service], f"{where}: {sorted(tokens)}"
            assert all(tokens.values()), f"{where}: a token written into the manifest instead of a Secret"


def test_peers_agree_on_the_mechanism_and_the_secret(overlay):
    r = rendered(overlay)
    engines = [pod for pod in r.pod_templates() if pod.container("scheduler") and pod.container("worker")]
    assert engines
    frontends = [(pod, c) for pod, c, service in _spindle(r) if service == "frontend"]
    for engine in engines:
        scheduler, worker = engine.container("scheduler"), engine.container("worker")
        scheduler_tls = _tls_secret(engine, scheduler)
        worker_tls = _tls_secret(engine, worker)
        assert (scheduler_tls is None) == (worker_tls is None), engine.owner
        scheduler_tokens, worker_tokens = _token_refs(scheduler), _token_refs(worker)
        if scheduler_tokens:
            # Two secrets: what opens the scheduler does not open the worker.
            assert scheduler_tokens["SPINDLE_WORKER_TOKEN"] == worker_tokens["SPINDLE_WORKER_TOKEN"]
            assert scheduler_tokens["SPINDLE_SCHEDULER_TOKEN"] != scheduler_tokens["SPINDLE_WORKER_TOKEN"]
        for pod, frontend in frontends:
            assert (_tls_secret(pod, frontend) is None) == (scheduler_tls is None), pod.owner
            if scheduler_tokens:
                assert _token_refs(frontend) == {"SPINDLE_SCHEDULER_TOKEN": scheduler_tokens["SPINDLE_SCHEDULER_TOKEN"]}


def test_each_service_has_its_own_certificate_with_the_identity_its_server_admits(overlay):
    r = rendered(overlay)
    certificates = _certificates(r)
    for engine in [p for p in r.pod_templates() if p.container("scheduler") and p.container("worker")]:
        scheduler, worker = engine.container("scheduler"), engine.container("worker")
        scheduler_secret, worker_secret = _tls_secret(engine, scheduler), _tls_secret(engine, worker)
        if scheduler_secret is None:
            continue
        frontend_secrets = {_tls_secret(pod, c) for pod, c, service in _spindle(r) if service == "frontend"}
        assert len({scheduler_secret, worker_secret, *frontend_secrets}) == 2 + len(frontend_secrets)
        for secret in {scheduler_secret, worker_secret, *frontend_secrets}:
            assert secret in certificates, f"no cert-manager Certificate writes the Secret {secret}"
        scheduler_config = parse_config("scheduler", r.environment(scheduler)).auth
        worker_config = parse_config("worker", r.environment(worker)).auth
        for secret in frontend_secrets:
            assert _identity(certificates[secret]) & set(scheduler_config.allowed_client_names), secret
            assert not _identity(certificates[secret]) & set(worker_config.allowed_client_names), (
                f"{secret}: a frontend's certificate would open the worker")
        assert _identity(certificates[scheduler_secret]) & set(worker_config.allowed_client_names)
        # Server certificates name the hosts they are dialled by (every tensor-parallel rank's).
        for address in worker_addresses(r.environment(scheduler)):
            worker_host, _ = addr_port(address)
            assert _covers(certificates[worker_secret], worker_host), worker_host
        for pod, frontend, service in _spindle(r):
            if service == "frontend":
                host, _ = addr_port(r.environment(frontend)["SPINDLE_SCHEDULER_ADDR"])
                assert _covers(certificates[scheduler_secret], host), f"{pod.owner}: dials {host}"


def test_tls_ports_are_probed_from_inside_the_container(overlay):
    """The kubelet's grpc probe speaks plaintext: a TLS port answers it with a failed handshake."""
    r = rendered(overlay)
    for pod, container, service in _spindle(r):
        if service == "frontend" or _tls_secret(pod, container) is None:
            continue
        own_port = addr_port(r.environment(container)[f"SPINDLE_{service.upper()}_ADDR"])[1]
        for kind, probe in probes(container).items():
            where = f"{pod.owner}/{container['name']} {kind}"
            assert "grpc" not in probe, f"{where}: a grpc probe cannot reach a TLS port"
            checked = exec_probe(probe)
            if checked is not None:
                assert (checked["host"], checked["port"]) == ("127.0.0.1", own_port), where
                assert probe.get("timeoutSeconds", 1) >= 3, f"{where}: a Python start needs more than 1 s"
        assert exec_probe(container["readinessProbe"]) is not None, f"{pod.owner}/{container['name']}"


def test_secrets_come_from_certificates_or_are_made_by_hand(overlay):
    r = rendered(overlay)
    produced = set(_certificates(r)) | {s["metadata"]["name"] for s in r.of_kind("Secret")}
    for pod in r.pod_templates():
        used = {v["secret"]["secretName"] for v in pod.spec.get("volumes", []) if "secret" in v}
        for container in pod.containers:
            used |= {ref for ref in _token_refs(container).values() if ref}
        for secret in used:
            assert secret in produced or secret in HAND_MADE_SECRETS, f"{pod.owner}: Secret {secret} comes from nowhere"
            if secret in HAND_MADE_SECRETS:
                documented = (K8S / HAND_MADE_SECRETS[secret]).read_text()
                assert f"create secret generic {secret} --from-literal=token=" in documented, secret


def test_cert_manager_issues_from_one_private_ca(overlay):
    r = rendered(overlay)
    issuers = {i["metadata"]["name"]: i for i in r.of_kind("Issuer")}
    certificates = r.of_kind("Certificate")
    for obj in [*issuers.values(), *certificates]:
        assert obj["apiVersion"] == CERT_MANAGER, obj["metadata"]["name"]
    ca_secrets = {c["spec"]["secretName"] for c in certificates if c["spec"].get("isCA")}
    for certificate in certificates:
        spec, name = certificate["spec"], certificate["metadata"]["name"]
        assert spec["issuerRef"]["kind"] == "Issuer" and spec["issuerRef"]["name"] in issuers, name
        issuer = issuers[spec["issuerRef"]["name"]]["spec"]
        if spec.get("isCA"):
            assert "selfSigned" in issuer, name
            continue
        # Leaf certificates come from the CA Issuer, so their Secrets carry its ca.crt.
        assert issuer.get("ca", {}).get("secretName") in ca_secrets, name
        assert "client auth" in spec["usages"], f"{name}: every service connects as a client (probes too)"
        assert spec["commonName"] == spec["dnsNames"][0], name
        assert spec["privateKey"]["rotationPolicy"] == "Always", name
        assert _hours(spec["renewBefore"]) < _hours(spec["duration"]), name
        namespace = certificate["metadata"]["namespace"]
        if spec["commonName"] in {s["metadata"]["name"] for s in r.of_kind("Service")}:
            assert f"{spec['commonName']}.{namespace}.svc" in spec["dnsNames"], name
