"""The loader's promises: importing compiles nothing and does not import CuPy; every module's
source and shared header is package data; every listed instance is a real template instance."""
from __future__ import annotations

import subprocess
import sys

from services.worker.kernels.loader import MODULES, kernels_dir, read_source


def test_importing_the_gpu_path_does_not_import_cupy():
    code = ("import sys; import services.worker.kernels.loader, services.worker.kernels.attention_ops, "
            "services.worker.kernels.sampling_ops, services.worker.attention.cupy_backend, "
            "services.worker.cuda_sampler; print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_sources_are_package_data_and_include_no_toolkit_header():
    assert (kernels_dir() / "common.cuh").is_file()
    local_headers = {f'#include "{p.name}"' for p in kernels_dir().glob("*.cuh")}
    assert '#include "wmma.cuh"' in local_headers
    for module in MODULES:
        source = read_source(module)
        includes = [line for line in source.splitlines() if line.startswith("#include")]
        assert includes[0] == '#include "common.cuh"' and set(includes) <= local_headers, (module, includes)
    for header in kernels_dir().glob("*.cuh"):  # the headers themselves include nothing
        assert "#include" not in header.read_text(), header.name
        for expr in MODULES[module].name_expressions:
            assert expr.split("<")[0].removeprefix("spindle::") in source
