"""The CPU worker's glibc malloc settings (services/worker/platforms/cpu_malloc.py)."""
from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from services.worker.platforms import cpu_malloc

GLIBC = ctypes.util.find_library("c") is not None and hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt")


# Each script runs in a fresh process, with glibc's defaults ("default") or the worker's settings ("set").
PRELUDE = f"""
import ctypes, ctypes.util, resource, sys, threading
sys.path.insert(0, {str(cpu_malloc.__file__.rsplit('/services/', 1)[0])!r})
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "set":
    from services.worker.platforms.cpu_malloc import keep_step_memory
    assert keep_step_memory()
"""


def _printed_by(body: str) -> tuple[int, int]:
    """What PRELUDE + body prints, as an int: with glibc's defaults, then with the worker's settings."""
    runs = [subprocess.run([sys.executable, "-c", PRELUDE + body, mode], capture_output=True, text=True, check=True)
            for mode in ("default", "set")]
    return int(runs[0].stdout), int(runs[1].stdout)


@pytest.mark.skipif(not GLIBC, reason="needs glibc's mallopt")
def test_freed_step_memory_is_reused_without_new_mappings():
    # 12 MiB blocks allocated and freed in turn are mapped anew each time by default (the count of
    # mmap'd chunks glibc reports goes up and down), and come from the heap once the thresholds are set.
    default, tuned = _printed_by("""
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Mallinfo2
def mapped_while_held():
    before = libc.mallinfo2().hblks
    p = libc.malloc(12 << 20)
    n = libc.mallinfo2().hblks - before
    libc.free(p)
    return n
# the default threshold rises after a mapped block is freed; the first block of a size shows it
print(mapped_while_held())
""")
    assert default == 1  # a 12 MiB block is its own mapping by default
    assert tuned == 0  # and comes from the heap with the thresholds set


@pytest.mark.skipif(not GLIBC or not hasattr(__import__("resource"), "RUSAGE_THREAD"),
                    reason="needs glibc's mallopt and per-thread page-fault counts")
def test_a_threads_freed_step_memory_is_not_faulted_in_again():
    # A thread (an arena of its own, as the worker's model thread) allocates, touches and frees
    # 96 MiB five times: more than one 64 MiB heap. By default, and with only the thresholds, the
    # arena deletes its second heap each time it empties and the next round faults those pages in
    # again; with the top pad no round after the first faults more than a few pages.
    default, tuned = _printed_by("""
faults = []
def rounds():
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(12 << 20) for _ in range(8)]
        for p in blocks:
            ctypes.memset(p, 1, 12 << 20)
        for p in blocks:
            libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(max(faults[1:]))
""")
    assert default > 4000  # 16 MiB and more faulted in again every round
    assert tuned < 100


def test_without_mallopt_nothing_is_set(monkeypatch):
    monkeypatch.setattr(cpu_malloc.ctypes.util, "find_library", lambda name: None)
    assert cpu_malloc.keep_step_memory() is False
