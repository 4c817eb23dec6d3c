"""sglang.srt.platforms: the device facts of this process, decided once."""

import dataclasses

import pytest
import torch

from sglang.srt.platforms import PlatformEnum, current_platform, detect_platform
from sglang.srt.platforms.interface import Platform, PlatformCapabilities
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


def test_capabilities_default_to_the_conservative_answer():
    caps = PlatformCapabilities()
    assert (caps.supports_triton, caps.hicache_device_kernels) == (False, False)
    assert PlatformCapabilities(hicache_device_kernels=True).hicache_device_kernels
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.hicache_device_kernels = True
    with pytest.raises(TypeError):
        PlatformCapabilities(True)  # keywords only, as upstream's


def test_current_platform_matches_torch():
    assert current_platform == detect_platform()
    if torch.cuda.is_available():
        assert current_platform.device_type == "cuda" and not current_platform.is_cpu()
        assert current_platform.is_rocm() == bool(torch.version.hip)
    else:
        assert current_platform == Platform(PlatformEnum.CPU, PlatformCapabilities())
        assert current_platform.device_type == "cpu" and not current_platform.is_cuda()
