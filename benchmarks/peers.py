"""The peers Spindle is measured against, each in its own virtual environment.

Peers pull other versions of transformers and friends, so each gets a venv under
`benchmarks/.peers/<name>/` (git-ignored), never the project's. `install(name)` is idempotent: a
stamp file records the install spec, and a failure returns the reason, which the peer's row shows as
"skipped: <reason>". torch is pinned to the CPU build on local disk (an unpinned torch would pull a
multi-GB CUDA build).

    .venv/bin/python -m benchmarks.peers install [transformers-serve] [llama-cpp] [openvino]
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PEERS_DIR = Path(__file__).parent / ".peers"
TORCH = "torch==2.13.0"
LLAMA_CPP_BUILD_MINUTES = 10


@dataclass(frozen=True)
class PeerSpec:
    name: str
    packages: tuple[tuple[str, ...], ...]  # pip install steps, in order
    check: str  # Python run in the venv that must succeed after install
    env: tuple[tuple[str, str], ...] = ()
    timeout_s: int = 1800
    uninstall: tuple[str, ...] = ()  # removed after the install steps (dependencies that break the peer)


PEERS = {
    "transformers-serve": PeerSpec(
        "transformers-serve",
        packages=((TORCH,), ("transformers[serving]",)),
        check="import transformers, fastapi, uvicorn; print(transformers.__version__)",
    ),
    # Builds llama.cpp from source (about 8 minutes on 2 cores, both kept busy).
    "llama-cpp": PeerSpec(
        "llama-cpp",
        packages=(("llama-cpp-python[server]",),),
        check="import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)",
        env=(("CMAKE_BUILD_PARALLEL_LEVEL", "2"),),
        timeout_s=3600,
    ),
    # OpenVINO GenAI, driven in-process by benchmarks/openvino_peer.py; optimum-intel exports the IR.
    # torch is repeated in the second step so that no dependency can move it off the CPU build, and
    # the torchvision optimum-intel pulls in does not import with it (the export does not need it).
    "openvino": PeerSpec(
        "openvino",
        packages=((TORCH,), ("openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0", "openvino-genai==2026.4.1.0",
                             "optimum-intel[openvino]==2.2.0", TORCH)),
        check="import torch, openvino_genai, optimum.intel; print(openvino_genai.__version__.split('-')[0], torch.__version__)",
        uninstall=("torchvision",),
    ),
}


def venv_dir(name: str) -> Path:
    return PEERS_DIR / name


def venv_python(name: str) -> Path:
    return venv_dir(name) / "bin" / "python"


def _stamp(name: str) -> Path:
    return venv_dir(name) / ".installed.json"


def is_installed(name: str) -> bool:
    spec = PEERS[name]
    stamp = _stamp(name)
    return stamp.exists() and json.loads(stamp.read_text()).get("packages") == _stamped_packages(spec)


def _stamped_packages(spec: PeerSpec) -> list[list[str]]:
    return [list(p) for p in spec.packages] + ([["uninstall", *spec.uninstall]] if spec.uninstall else [])


def install(name: str, log=print) -> str:
    """Installs the peer if needed; returns "" on success or the reason it could not be installed."""
    import os

    spec = PEERS[name]
    if is_installed(name):
        return ""
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    log_path = PEERS_DIR / f"{name}.install.log"
    env = {**os.environ, **dict(spec.env)}
    start = time.monotonic()
    with open(log_path, "ab") as out:
        try:
            if not venv_python(name).exists():
                subprocess.run([sys.executable, "-m", "venv", str(venv_dir(name))], check=True, stdout=out,
                               stderr=subprocess.STDOUT, timeout=300)
            for packages in spec.packages:
                log(f"[peers] {name}: pip install {' '.join(packages)} (log: {log_path})")
                subprocess.run([str(venv_python(name)), "-m", "pip", "install", "-q", *packages], check=True,
                               stdout=out, stderr=subprocess.STDOUT, env=env,
                               timeout=max(60, spec.timeout_s - (time.monotonic() - start)))
            if spec.uninstall:
                log(f"[peers] {name}: pip uninstall {' '.join(spec.uninstall)}")
                subprocess.run([str(venv_python(name)), "-m", "pip", "uninstall", "-y", "-q", *spec.uninstall],
                               check=True, stdout=out, stderr=subprocess.STDOUT, timeout=300)
            version = subprocess.run([str(venv_python(name)), "-c", spec.check], check=True, capture_output=True,
                                     text=True, timeout=300).stdout.strip()
        except subprocess.TimeoutExpired:
            return f"install took over {spec.timeout_s} s (log: {log_path})"
        except subprocess.CalledProcessError as exc:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            why = " / ".join(line.strip() for line in tail if line.strip() and "Location" not in line)
            return f"install failed ({' '.join(map(str, exc.cmd[-2:]))}): {why[-300:]} (log: {log_path})"
    _stamp(name).write_text(json.dumps({"packages": _stamped_packages(spec), "version": version,
                                        "seconds": round(time.monotonic() - start)}))
    log(f"[peers] {name}: installed ({version}) in {time.monotonic() - start:.0f} s")
    return ""


def installed_version(name: str) -> str:
    return json.loads(_stamp(name).read_text()).get("version", "") if _stamp(name).exists() else ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "install":
        print(__doc__)
        return 2
    names = args[1:] or list(PEERS)
    failed = False
    for name in names:
        why = install(name)
        print(f"{name}: {'ok ' + installed_version(name) if not why else 'skipped: ' + why}")
        failed |= bool(why)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
