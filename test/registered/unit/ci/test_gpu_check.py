"""scripts/ci/gpu_check.sh on a machine without a GPU: it refuses at once with a clear reason,
and with a GPU visible but a torch that cannot use it, setup fails and nothing else runs; both
end with the summary and a non-zero status."""

import os
import subprocess
import sys
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "scripts" / "ci" / "gpu_check.sh"


def run(tmp_path, path_dirs, **env):
    full = {**os.environ, "PATH": os.pathsep.join(map(str, path_dirs)), "GPU_CHECK_LOGS": str(tmp_path / "logs"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=120)


def test_no_gpu_is_refused_with_the_reason(tmp_path):
    res = run(tmp_path, ["/usr/bin", "/bin"])
    assert res.returncode == 1
    assert "no NVIDIA GPU visible" in res.stderr
    assert "gpu_check summary" in res.stdout and "gpu_check: FAILED" in res.stdout


def test_a_torch_without_cuda_fails_setup_and_skips_the_rest(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: Stand-in GPU (UUID: GPU-0)"\n')
    (shim / "nvidia-smi").chmod(0o755)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this CPU-only torch
    (venv / "python").chmod(0o755)
    res = run(tmp_path, [shim, "/usr/bin", "/bin"], GPU_CHECK_VENV=str(venv.parent), WHEEL_DIR=str(tmp_path))
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout
    assert "torch in the venv does not see a GPU" in out
    summary = out[out.index("gpu_check summary"):]
    assert "setup" in summary and "FAIL" in summary and "not run: setup failed" in summary
    assert "per-commit-1-gpu" not in summary and "gpu_check: FAILED" in summary
