"""The model store (k8s/model-store): the Job that fills the volumes runs the Spindle image's own
CLI (nothing installed at run time) under the restricted profile, with retries, a deadline, a TTL
and resources; the volumes' sizes and classes come from the overlay's model-store.env; workers read
the weights, frontends only the tokenizer volume, at the same path; and every pod that reads a
volume waits for its folder first."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from services.common.model_fetch import build_parser
from tests.k8s.manifests import K8S, OVERLAYS, Rendered, rendered, require_kubectl

# GPU overlays serve a model from a volume; the CPU ones the model baked into the image.
MODEL_STORE_OVERLAYS = [o for o in OVERLAYS if o.startswith("gpu")]
JOB = "spindle-model-fetch"
WEIGHTS_CLAIM, TOKENIZER_CLAIM = "spindle-model", "spindle-tokenizer"
FETCH_COMMAND = ["python", "-m", "services.common.model_fetch"]


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {key: value for key, value in pairs}


def settings_file(overlay: str) -> Path:
    """The model-store.env of the overlay, or of the overlay it builds on."""
    folder = K8S / "overlays" / overlay
    while not (folder / "model-store.env").is_file():
        resources = yaml.safe_load((folder / "kustomization.yaml").read_text()).get("resources", [])
        (parent,) = [r for r in resources if (folder / r).resolve().parent == K8S / "overlays"]
        folder = (folder / parent).resolve()
    return folder / "model-store.env"


def job(r: Rendered) -> dict:
    obj = r.get("Job", JOB)
    assert obj is not None, f"{r.overlay}: Job/{JOB} missing"
    return obj


def worker_model(r: Rendered) -> str:
    """The one model folder every worker (every tensor-parallel rank) reads."""
    (model,) = {r.environment(c)["SPINDLE_MODEL"] for _, c in r.spindle_containers() if c["command"][1] == "worker"}
    return model


def test_cpu_overlays_have_no_model_store():
    for overlay in set(OVERLAYS) - set(MODEL_STORE_OVERLAYS):
        r = rendered(overlay)
        assert not r.of_kind("PersistentVolumeClaim") and not r.of_kind("Job"), overlay


@pytest.mark.parametrize("overlay", MODEL_STORE_OVERLAYS)
def test_the_job_runs_the_spindle_image_cli_without_installing_anything(overlay):
    r = rendered(overlay)
    spec = job(r)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert not spec.get("initContainers")
    # The CPU Spindle image, the one the frontends and schedulers run.
    scheduler_images = {c["image"] for _, c in r.spindle_containers() if c["name"] == "scheduler"}
    assert scheduler_images == {container["image"]}, (scheduler_images, container["image"])
    assert container["command"] == FETCH_COMMAND
    words = " ".join(container["command"] + container.get("args", []))
    assert "pip" not in words and "install" not in words, words
    # The arguments, as the kubelet expands them, parse with the CLI's own parser.
    args = build_parser().parse_args(r.expand(container, container["args"]))
    assert args.command == "fetch" and args.source


@pytest.mark.parametrize("overlay", MODEL_STORE_OVERLAYS)
def test_the_job_writes_the_folders_the_services_read(overlay):
    r = rendered(overlay)
    pod = next(p for p in r.pod_templates() if p.owner == f"Job/{JOB}")
    (container,) = pod.containers
    args = build_parser().parse_args(r.expand(container, container["args"]))
    model = worker_model(r)
    assert str(args.model_dir) == model, "the Job fills a folder the worker does not read"
    assert args.source == read_env_file(settings_file(overlay))["MODEL_SOURCE"]
    (weights,) = r.claim_mounts(pod, WEIGHTS_CLAIM)
    (tokenizer,) = r.claim_mounts(pod, TOKENIZER_CLAIM)
    assert not weights[1].get("readOnly") and not tokenizer[1].get("readOnly")
    assert PurePosixPath(weights[1]["mountPath"]) == PurePosixPath(model).parent
    assert PurePosixPath(args.tokenizer_root) == PurePosixPath(tokenizer[1]["mountPath"])


@pytest.mark.parametrize("overlay", MODEL_STORE_OVERLAYS)
def test_the_job_is_restricted_bounded_and_cleaned_up(overlay):
    obj = job(rendered(overlay))
    spec = obj["spec"]
    assert 1 <= spec["backoffLimit"] <= 6
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["activeDeadlineSeconds"] > 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


@pytest.mark.parametrize("overlay", MODEL_STORE_OVERLAYS)
def test_storage_sizes_and_classes_come_from_model_store_env(overlay):
    r = rendered(overlay)
    settings = read_env_file(settings_file(overlay))
    for claim, prefix in ((WEIGHTS_CLAIM, "MODEL"), (TOKENIZER_CLAIM, "TOKENIZER")):
        pvc = r.get("PersistentVolumeClaim", claim)
        assert pvc is not None, claim
        assert pvc["spec"]["resources"]["requests"]["storage"] == settings[f"{prefix}_STORAGE_SIZE"], claim
        assert pvc["spec"]["storageClassName"] == settings[f"{prefix}_STORAGE_CLASS"], claim
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "read by pods on many nodes"


def test_a_change_to_model_store_env_reaches_the_claims(tmp_path):
    """The settings are applied at build time: edit them in a copy and render again."""
    kubectl = require_kubectl()
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    env_file = copy / "overlays" / "gpu" / "model-store.env"
    text = env_file.read_text()
    for key, value in (("MODEL_STORAGE_SIZE", "750Gi"), ("MODEL_STORAGE_CLASS", "efs-sc"),
                       ("TOKENIZER_STORAGE_SIZE", "5Gi"), ("TOKENIZER_STORAGE_CLASS", "nfs-csi")):
        old = f"{key}={read_env_file(env_file)[key]}\n"
        assert old in text
        text = text.replace(old, f"{key}={value}\n")
    env_file.write_text(text)
    result = subprocess.run([kubectl, "kustomize", str(copy / "overlays" / "gpu-inference-pool")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    claims = {o["metadata"]["name"]: o["spec"] for o in yaml.safe_load_all(result.stdout)
              if o and o["kind"] == "PersistentVolumeClaim"}
    assert (claims[WEIGHTS_CLAIM]["resources"]["requests"]["storage"], claims[WEIGHTS_CLAIM]["storageClassName"]) \
        == ("750Gi", "efs-sc")
    assert (claims[TOKENIZER_CLAIM]["resources"]["requests"]["storage"],
            claims[TOKENIZER_CLAIM]["storageClassName"]) == ("5Gi", "nfs-csi")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_workers_and_the_job_mount_the_weights(overlay):
    """A pod without a worker (the standalone frontends) never mounts the weights volume; the
    frontend beside a worker (inference pool) may read the volume its pod has anyway."""
    r = rendered(overlay)
    for pod in r.pod_templates():
        if pod.owner == f"Job/{JOB}" or pod.container("worker") is not None:
            continue
        assert not r.claim_mounts(pod, WEIGHTS_CLAIM), f"{pod.owner} mounts the weights volume"
        assert WEIGHTS_CLAIM not in {v.get("persistentVolumeClaim", {}).get("claimName")
                                     for v in pod.spec.get("volumes", [])}, pod.owner


@pytest.mark.parametrize("overlay", MODEL_STORE_OVERLAYS)
def test_standalone_frontends_read_the_tokenizer_volume_at_the_model_path(overlay):
    r = rendered(overlay)
    frontends = [p for p in r.pod_templates() if p.container("frontend") and not p.container("worker")]
    if any(p.container("frontend") and p.container("worker") for p in r.pod_templates()):
        assert not frontends, "the inference pool serves from the engine pods' frontends"
        return
    (pod,) = frontends
    mounts = [m for c, m in r.claim_mounts(pod, TOKENIZER_CLAIM) if c["name"] == "frontend"]
    assert len(mounts) == 1 and mounts[0].get("readOnly") is True
    model = r.environment(pod.container("frontend"))["SPINDLE_MODEL"]
    assert model == worker_model(r), "frontend and worker name one model folder"
    assert PurePosixPath(model).parent == PurePosixPath(mounts[0]["mountPath"])


@pytest.mark.parametrize("overlay", MODEL_STORE_OVERLAYS)
def test_pods_that_read_a_volume_wait_for_their_folder(overlay):
    """Engines and frontends can be applied with the Job: an init container waits until the Job
    has published the folder (SPINDLE_MODEL) on the volume the pod's Spindle containers read."""
    r = rendered(overlay)
    checked = 0
    for pod in r.pod_templates():
        if pod.owner == f"Job/{JOB}":
            continue
        for claim in (WEIGHTS_CLAIM, TOKENIZER_CLAIM):
            readers = [(c, m) for c, m in r.claim_mounts(pod, claim) if c in pod.containers]
            if not readers:
                continue
            waits = [(c, m) for c, m in r.claim_mounts(pod, claim) if c in pod.spec.get("initContainers", [])]
            assert len(waits) == 1, f"{pod.owner}: no init container waits for {claim}"
            init, mount = waits[0]
            assert init["command"] == FETCH_COMMAND, init["command"]
            args = build_parser().parse_args(r.expand(init, init["args"]))
            assert args.command == "wait" and not args.timeout_s
            assert mount["mountPath"] == readers[0][1]["mountPath"] and mount.get("readOnly") is True
            model = r.environment(readers[0][0])["SPINDLE_MODEL"]
            assert str(args.dir) == model, f"{pod.owner} waits for {args.dir}, reads {model}"
            checked += 1
    assert checked >= 1
