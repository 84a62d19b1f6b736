"""GPU fixtures: skip cleanly without a CUDA device or CuPy; otherwise a `shim` fixture that runs
the CPU kernel tests' launches on the device, so the same test bodies check the real kernels.

`DeviceLauncher` takes a KernelLaunch built on CPU tensors, copies each tensor's whole storage to
the GPU (so strided views keep their strides and offsets), launches through CupyLauncher, and
copies the storages back.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device visible to PyTorch"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy not installed (pip install -e '.[cuda]')"
    return None


@pytest.fixture(scope="session", autouse=True)
def require_gpu():
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)


class DeviceLauncher:
    def __init__(self):
        from services.worker.kernels.loader import CupyLauncher

        self.cupy = CupyLauncher()
        self.launches: list[str] = []

    def __call__(self, launch):
        self.launches.append(launch.name)
        copies, args = [], []
        for arg in launch.args:
            if isinstance(arg, torch.Tensor) and arg.device.type == "cpu":
                storage = arg.untyped_storage()
                device_storage = storage.cuda() if storage.nbytes() else torch.UntypedStorage(0, device="cuda")
                view = torch.empty(0, dtype=arg.dtype, device="cuda").set_(
                    device_storage, arg.storage_offset(), arg.shape, arg.stride())
                copies.append((storage, device_storage))
                args.append(view)
            else:
                args.append(arg)
        self.cupy(dataclasses.replace(launch, args=tuple(args)))
        torch.cuda.synchronize()
        for storage, device_storage in copies:
            if storage.nbytes():
                storage.copy_(device_storage.cpu())


@pytest.fixture
def shim():
    return DeviceLauncher()


@pytest.fixture(scope="session")
def shim_library():  # the CPU tests' "unbroken copy" fixture has no meaning here
    pytest.skip("CPU shim only")
