"""The worker's platforms (cpu.py, cuda.py) behind `Platform` (interface.py); `build_platform`
picks one for the resolved device."""
from __future__ import annotations

import torch

from services.worker.config import WorkerConfig
from services.worker.platforms.cpu import CpuPlatform
from services.worker.platforms.interface import AttentionHeads, Platform

__all__ = ["AttentionHeads", "Platform", "build_platform"]


def build_platform(config: WorkerConfig, device: torch.device, dtype: torch.dtype,
                   heads: AttentionHeads) -> Platform:
    if device.type == "cuda":
        # Imported here: a CPU worker never loads the GPU path's modules.
        from services.worker.platforms.cuda import CudaPlatform

        return CudaPlatform.from_config(config, device, dtype, heads)
    return CpuPlatform.from_config(config, dtype, heads)
