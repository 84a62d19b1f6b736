"""Every overlay renders with `kubectl kustomize` and validates with kubernetes-validate --strict.

Strict mode rejects properties a Kubernetes version does not know (a typo, or a field newer than
that version). Kinds without a bundled schema (CRDs) are allowed only from a known list; those
are checked by hand in test_crds.py.
"""
from __future__ import annotations

import functools
import re

import pytest
import yaml

from tests.k8s.manifests import CLUSTER_SCOPED, CRD_KINDS, NAMESPACE, OVERLAYS, ROOT, rendered

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed: pip install kubernetes-validate")
from kubernetes_validate import utils as kv_utils  # noqa: E402

# The oldest Kubernetes these manifests support, the kubectl on the machine image, the newest
# the installed kubernetes-validate knows.
WANTED_VERSIONS = ("1.29", "1.32", "latest")


def _versions() -> list[str]:
    shipped = {kv_utils.major_minor(v) for v in kv_utils.all_versions()}
    latest = kv_utils.major_minor(kv_utils.latest_version())
    chosen = sorted({latest if v == "latest" else v for v in WANTED_VERSIONS} & shipped,
                    key=lambda v: tuple(map(int, v.split("."))))
    return chosen


VERSIONS = _versions()


@pytest.fixture(scope="module", autouse=True)
def cached_schemas():
    """kubernetes-validate reads its schema files for every object; read each once here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_utils, "schema_contents", functools.lru_cache(maxsize=None)(kv_utils.schema_contents))
        yield


def test_at_least_two_kubernetes_versions():
    assert len(VERSIONS) >= 2, f"kubernetes-validate ships {kv_utils.all_versions()}; wanted {WANTED_VERSIONS}"


def test_overlays_exist():
    assert {"cpu", "gpu"} <= set(OVERLAYS), OVERLAYS


def validate_all(overlay: str, version: str) -> tuple[list[str], set[str]]:
    """(errors, kinds without a schema) for every object of the overlay, as `kubernetes-validate --strict`."""
    errors, unknown = [], set()
    for obj in rendered(overlay).objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kv_utils.validate(obj, version, strict=True)
        except kv_utils.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{name}: {path}: {exc.message}")
        except kv_utils.SchemaNotFoundError:
            unknown.add(obj["kind"])
    return errors, unknown


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strict(overlay, version):
    errors, unknown = validate_all(overlay, version)
    assert not errors, f"k8s/overlays/{overlay} against Kubernetes {version}:\n" + "\n".join(errors)
    assert unknown <= CRD_KINDS, f"kinds with no schema that test_crds.py does not check: {unknown - CRD_KINDS}"


def test_strict_mode_rejects_unknown_fields():
    """The validator really is strict: a misspelt field fails."""
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
        "spec": {"selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}},
                              "spec": {"containers": [{"name": "c", "image": "i:1", "imagePullPolcy": "Always"}]}}},
    }
    with pytest.raises(kv_utils.ValidationError):
        kv_utils.validate(deployment, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_live_in_the_spindle_namespace(overlay):
    for obj in rendered(overlay).objects:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], obj["metadata"]
        else:
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


def test_examples_in_the_deploy_guide_validate():
    """The Kubernetes objects shown in docs/deploy.md are valid too."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    objects = [o for block in re.findall(r"```yaml\n(.*?)```", text, re.S) for o in yaml.safe_load_all(block)
               if o and "kind" in o]
    assert objects, "docs/deploy.md shows no Kubernetes object"
    for obj in objects:
        kv_utils.validate(obj, VERSIONS[-1], strict=True)
