"""Session-wide reporting: every logit tie the greedy parity oracle took is listed in the summary."""
from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests.e2e.parity import TIE_HITS

    if TIE_HITS:
        terminalreporter.section(f"greedy parity: {len(TIE_HITS)} logit tie(s) taken")
        for line in TIE_HITS:
            terminalreporter.write_line(line)
