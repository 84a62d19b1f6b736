"""Every overlay puts API keys on every frontend's public ports, from the hand-made Secret the
api-keys component documents, and the frontend's parsed config then refuses callers without one."""
from __future__ import annotations

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, rendered
from tests.k8s.service_flags import parse_config

pytestmark = pytest.mark.parametrize("overlay", OVERLAYS)

SECRET, KEY = "spindle-api-keys", "keys"


def _frontends(overlay: str):
    r = rendered(overlay)
    found = [(pod, c) for pod, c in r.spindle_containers() if c["command"][1] == "frontend"]
    assert found, f"{overlay}: no frontend"
    return r, found


def test_every_frontend_takes_its_keys_from_the_secret(overlay):
    r, frontends = _frontends(overlay)
    for pod, container in frontends:
        where = f"{pod.owner}/{container['name']}"
        refs = {v["name"]: v.get("valueFrom", {}).get("secretKeyRef") for v in container.get("env", [])}
        assert refs.get("SPINDLE_API_KEY") == {"name": SECRET, "key": KEY}, f"{where}: {refs.get('SPINDLE_API_KEY')}"
        config = parse_config("frontend", r.environment(container))
        assert config.edge.api_keys, f"{where} would serve anyone"


def test_the_secret_is_documented_as_made_by_hand(overlay):
    documented = (K8S / "api-keys" / "kustomization.yaml").read_text()
    assert f"create secret generic {SECRET} --from-literal={KEY}=" in documented
    r, _ = _frontends(overlay)
    assert SECRET not in {s["metadata"]["name"] for s in r.of_kind("Secret")}, "a key written into the manifests"
