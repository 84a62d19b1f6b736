"""Choosing between two CPU kernels by timing them once per weight shape, and keeping the choice.

What the int8 path selector (int8_linear.py) and the column tiles' row limit (tile_rows.py) share:
the timing of one kernel call on a shared machine, the rule that turns timings at a grid of row
counts into a row limit, and the file that keeps each limit per machine. Two kernels round
differently, so a limit that moved between restarts would change greedy output: a restart reads
the stored limit instead of timing again.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

MIN_RUN_S = 0.002  # each timed run of a kernel lasts about this long


def best_time(fn: Callable[[], object], num_repeats: int) -> float:
    """Seconds per call: the best of `num_repeats` runs of enough calls to last about 2 ms (a
    single 20 us call is too noisy to rank on a shared machine)."""
    start = time.perf_counter()
    fn()  # warm-up: first calls allocate and pick oneDNN kernels
    num_calls = max(1, min(100, int(MIN_RUN_S / max(time.perf_counter() - start, 1e-6))))
    best = float("inf")
    for _ in range(num_repeats):
        start = time.perf_counter()
        for _ in range(num_calls):
            fn()
        best = min(best, (time.perf_counter() - start) / num_calls)
    return best


def last_win(grid: tuple[int, ...], wins: Callable[[int], bool], threshold: int) -> tuple[int, bool]:
    """The last row count of `grid` where `wins(num_rows)` held before it first failed twice in a
    row (`threshold` if it never held; one failure is not enough), and whether it never failed.
    Counts after the second failure are not timed."""
    num_losses = 0
    for num_rows in grid:
        if wins(num_rows):
            threshold, num_losses = (num_rows if num_losses == 0 else threshold), 0
        else:
            num_losses += 1
            if num_losses == 2:
                return threshold, False
    return threshold, num_losses == 0


def first_win(grid: tuple[int, ...], wins: Callable[[int], bool]) -> int:
    """The first row count of `grid` where `wins(num_rows)` holds, or 0 where it never does."""
    return next((num_rows for num_rows in grid if wins(num_rows)), 0)


class ThresholdStore:
    """Row limits by name in a JSON file (None: in memory only), each name prefixed with this
    machine (CPU model, torch's CPU capability, thread count, torch version). Read on first use."""

    def __init__(self, cache_path: Path | None, what: str):
        self.cache_path = cache_path
        self.what = what  # for the log: which limits these are
        self._stored: dict | None = None

    def get(self, name: str, measure: Callable[[], int]) -> int:
        """The stored limit of `name` on this machine, or `measure()`'s, which is then stored."""
        if self._stored is None:
            self._stored = self._load()
        key = f"{_machine()}/{name}"
        stored = self._stored.get(key)
        value = stored if isinstance(stored, int) else measure()
        if stored != value:
            self._save(key, value)
        return value

    def _load(self) -> dict:
        if self.cache_path is None or not self.cache_path.is_file():
            return {}
        try:
            stored = json.loads(self.cache_path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", self.cache_path, exc)
            return {}
        return stored if isinstance(stored, dict) else {}

    def _save(self, key: str, value: int) -> None:
        self._stored[key] = value
        if self.cache_path is None:
            return
        try:  # best effort: a read-only cache measures again at the next start
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_path.with_name(f".{self.cache_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._stored, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.cache_path)
        except OSError as exc:
            logger.warning("%s not stored in %s: %s", self.what, self.cache_path, exc)


def _machine() -> str:
    capability, num_threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    return f"{_cpu_model()}/{capability}/{num_threads}t/torch-{torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown cpu"
