"""Session-wide settings and reporting: every logit tie the greedy parity oracle took is listed in
the summary; services the tests spawn keep their packed weights on small pages."""
from __future__ import annotations

import os

# Packed decode weights on huge pages (--cpu-huge-pages, on by default) cost a served bf16
# SmolLM2-135M worker 3.5 s more at start-up on VMs that hand freed 2 MiB blocks back to the host
# (every huge page is then a host fault again), and the bf16 oracle module 57 s against 21. The
# spawned services here start dozens of times, so they run without; tests/worker/test_weight_memory.py
# covers the arena, and in-process workers keep the default.
os.environ.setdefault("SPINDLE_CPU_HUGE_PAGES", "false")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests.e2e.parity import TIE_HITS

    if TIE_HITS:
        terminalreporter.section(f"greedy parity: {len(TIE_HITS)} logit tie(s) taken")
        for line in TIE_HITS:
            terminalreporter.write_line(line)
