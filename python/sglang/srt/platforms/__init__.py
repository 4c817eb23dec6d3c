"""``current_platform``: the device facts of this process, decided once at import.

    from sglang.srt.platforms import current_platform
    if current_platform.capabilities.hicache_device_kernels: ...
"""

from __future__ import annotations

import importlib.util

import torch

from sglang.srt.platforms.interface import Platform, PlatformCapabilities, PlatformEnum


def detect_platform() -> Platform:
    """CUDA or ROCm when torch sees a GPU, else CPU. The copy kernels are Triton's, so device
    kernels need a GPU and Triton installed."""
    if not torch.cuda.is_available():
        return Platform(PlatformEnum.CPU, PlatformCapabilities())
    kind = PlatformEnum.ROCM if torch.version.hip else PlatformEnum.CUDA
    triton = importlib.util.find_spec("triton") is not None
    return Platform(kind, PlatformCapabilities(supports_triton=triton, hicache_device_kernels=triton))


current_platform: Platform = detect_platform()

__all__ = ["Platform", "PlatformCapabilities", "PlatformEnum", "current_platform", "detect_platform"]
