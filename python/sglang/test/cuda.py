"""CUDA-only test modules: skip cleanly where the hardware is missing, never elsewhere.

A file registered with ``register_cuda_ci`` calls ``require_cuda()`` at the top, before it
touches the GPU. On a machine without CUDA the whole module is skipped (collecting it is safe,
and ``run_suite.py`` reports the file as skipped); in a CUDA suite run (``SGLANG_TEST_DEVICE``
is ``cuda``) a missing GPU is an error, not a skip.
"""

from __future__ import annotations

import os

import pytest
import torch


def require_cuda(min_devices: int = 1) -> None:
    """Skip the calling module unless ``min_devices`` CUDA devices are present."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= min_devices:
        return
    reason = f"needs {min_devices} CUDA device(s), found {have}"
    if os.environ.get("SGLANG_TEST_DEVICE") == "cuda" and have == 0:
        raise RuntimeError(f"SGLANG_TEST_DEVICE=cuda but {reason}")
    pytest.skip(reason, allow_module_level=True)
