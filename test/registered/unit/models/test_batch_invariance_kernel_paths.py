"""The bitwise batch-invariance tests of the layers and models, run again under the other CPU
kernel paths this machine can take: MKL's AVX2 and AVX-512 code branches (``MKL_CBWR``) and
ATen's ``default`` / ``avx2`` vectorisation (``ATEN_CPU_CAPABILITY``).

Which kernels BLAS picks depends on the CPU vendor and its instruction sets (an AMD EPYC picks
other MKL kernels than an Intel Xeon), and CI runs on either. Each environment here forces one
fixed branch on any x86 machine, so a layer whose rows depend on the call's shape under some
branch fails here whichever vendor runs the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=240, suite="nightly-cpu")

HERE = Path(__file__).resolve().parent
BITWISE_TESTS = [
    (HERE / "test_mimo_v2_flash.py", "chunk_invariant or bitwise"),
    (HERE / "test_qwen3_next.py", "chunked_prefill_and_batching"),
    (HERE / "test_deepseek_v2.py", "bitwise or moe_rows"),
    (HERE.parent / "layers" / "test_model_layers.py", "invariant"),
    (HERE.parent / "layers" / "test_torch_native_backend.py", ""),
]
KERNEL_PATHS = {
    "mkl_avx2": {"MKL_CBWR": "AVX2"},
    "mkl_avx512": {"MKL_CBWR": "AVX512"},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
}


@pytest.mark.parametrize("path", sorted(KERNEL_PATHS))
def test_bitwise_invariance_holds_on_every_kernel_path(path):
    env = {**os.environ, **KERNEL_PATHS[path]}
    failures = []
    for test_file, selection in BITWISE_TESTS:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
        if selection:
            cmd += ["-k", selection]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            failures.append(f"{test_file.name} -k {selection!r}:\n{res.stdout[-3000:]}")
    assert not failures, "\n\n".join(failures)
