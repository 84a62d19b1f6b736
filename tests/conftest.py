"""Session-wide settings and reporting: every logit tie the greedy parity oracle took is listed in
the summary; services the tests spawn keep their packed weights on small pages; the compiled CPU
kernels build once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Packed decode weights on huge pages (--cpu-huge-pages, on by default) cost a served bf16
# SmolLM2-135M worker 3.5 s more at start-up on VMs that hand freed 2 MiB blocks back to the host
# (every huge page is then a host fault again), and the bf16 oracle module 57 s against 21. The
# spawned services here start dozens of times, so they run without; tests/worker/test_weight_memory.py
# covers the arena, and in-process workers keep the default.
os.environ.setdefault("SPINDLE_CPU_HUGE_PAGES", "false")


@pytest.fixture(scope="session")
def kernel_builds(tmp_path_factory) -> Path:
    """The session's one folder of compiled CPU kernel libraries. A build of every source takes
    about 22 s on two cores, and the library's file name is keyed by its sources, flags and (for
    `native`) the CPU's, so every test may load the same file."""
    return tmp_path_factory.mktemp("kernel-builds")


def _with_session_kernels(folder: Path, kernel_builds: Path) -> Path:
    (folder / "kernels").symlink_to(kernel_builds, target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory, kernel_builds) -> Path:
    """A Spindle cache folder for one module: its own per-machine timing files (tile rows, AMX
    rows, int8 thresholds), the session's kernel builds."""
    return _with_session_kernels(tmp_path_factory.mktemp("cache"), kernel_builds)


@pytest.fixture
def fresh_kernel_cache(tmp_path, kernel_builds) -> Path:
    """kernel_cache for one test: no timing file stored yet."""
    return _with_session_kernels(tmp_path, kernel_builds)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests.e2e.parity import TIE_HITS

    if TIE_HITS:
        terminalreporter.section(f"greedy parity: {len(TIE_HITS)} logit tie(s) taken")
        for line in TIE_HITS:
            terminalreporter.write_line(line)
