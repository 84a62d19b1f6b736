"""The compiled CPU kernels for the tests that cover both builds: the library for this CPU
(`native`) and the portable one an image ships (`x86-64-v3`), each built once per test session
(a build of every source takes tens of seconds on two cores)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from services.worker.cpu_kernels import MARCH_FEATURES, _cpu_flags, load_cpu_kernels

MARCHES = ["native", "x86-64-v3"]
_libraries: dict[str, ctypes.CDLL] = {}


def library_for(march: str, cache_dir: Path) -> ctypes.CDLL:
    """The library built for `march`, into `cache_dir` at the session's first call for it; skips
    the test where this CPU cannot run that build."""
    if march != "native" and MARCH_FEATURES[march] - _cpu_flags():
        pytest.skip(f"this CPU cannot run {march} code")
    if march in _libraries:
        return _libraries[march]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPINDLE_CPU_KERNEL_MARCH", march)
        library = load_cpu_kernels(cache_dir)
    assert library is not None, "the CPU kernels must build here (gcc is on every CI machine)"
    _libraries[march] = library
    return library
