"""What the platform this process runs on can do: read before choosing a code path."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PlatformEnum(str, Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"


@dataclass(frozen=True, kw_only=True)
class PlatformCapabilities:
    """Every field defaults to the conservative answer.

    ``supports_triton``: Triton kernels launch on this device (the ``kernel`` IO backend).
    ``hicache_device_kernels``: the device-side HiCache copy kernels run here, so host pools
    prepare their write-back staging buffers; otherwise they skip them.
    """

    supports_triton: bool = False
    hicache_device_kernels: bool = False


@dataclass(frozen=True)
class Platform:
    """The device facts of this process: its kind and what it can do."""

    kind: PlatformEnum
    capabilities: PlatformCapabilities

    @property
    def device_type(self) -> str:
        """torch's device type (ROCm devices are ``cuda`` to torch)."""
        return "cpu" if self.kind is PlatformEnum.CPU else "cuda"

    def is_cuda(self) -> bool:
        return self.kind is PlatformEnum.CUDA

    def is_rocm(self) -> bool:
        return self.kind is PlatformEnum.ROCM

    def is_cpu(self) -> bool:
        return self.kind is PlatformEnum.CPU
