"""NIXL processes exit cleanly on a host with libibverbs and no RDMA device (Mooncake's wheel
needs libibverbs; with it, UCX's InfiniBand module makes NIXL 1.5.1 segfault at exit unless the
project leaves that module out, which importing either of our NIXL packages does)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from sglang.srt.utils.ucx_env import NO_IB_MODULES, ensure_ucx_env
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")

AGENT_SCRIPT = """
import {package}
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("exit-check", nixl_agent_config(backends=["UCX"]))
print("agent made")
"""


def test_ib_module_is_left_out_only_without_rdma_devices(tmp_path, monkeypatch):
    monkeypatch.delenv("UCX_MODULES", raising=False)
    assert ensure_ucx_env(str(tmp_path / "absent")) == NO_IB_MODULES
    monkeypatch.delenv("UCX_MODULES")
    (tmp_path / "mlx5_0").mkdir()
    assert ensure_ucx_env(str(tmp_path)) is None and "UCX_MODULES" not in os.environ
    monkeypatch.setenv("UCX_MODULES", "^cuda")
    assert ensure_ucx_env(str(tmp_path / "absent")) == "^cuda"  # the user's setting stands


def test_libibverbs_is_installed_so_the_exit_check_means_something():
    name = ctypes.util.find_library("ibverbs")
    assert name, "libibverbs is not installed: `make install` installs Debian's libibverbs1 and librdmacm1"
    ctypes.CDLL(name)


@pytest.mark.parametrize("package", ["sglang.srt.mem_cache.storage.nixl", "sglang.srt.disaggregation.nixl"])
def test_a_nixl_process_exits_zero_with_libibverbs_loaded(package):
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    res = subprocess.run([sys.executable, "-c", AGENT_SCRIPT.format(package=package)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert "agent made" in res.stdout, res.stderr[-2000:]
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
