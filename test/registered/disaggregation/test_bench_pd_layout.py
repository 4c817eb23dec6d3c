"""bench_pd_transfer.py's page layouts: ``allocator`` hands a request the pages the server's
PagedAllocator would on a busy server (valid, deterministic, in long runs), ``scattered`` no two
adjacent; and the benchmark runs end to end with either (real rank processes, NIXL UCX). The
``--sidecar-layers`` case (DeepSeek-V3.2 shape: MLA latents + DSA indexer pages, replicated, so
every decode rank gets whole pages from its first prefill target) counts its bytes so and runs."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np

from sglang.srt.disaggregation.common.descriptors import page_runs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT

register_cpu_ci(est_time=20, suite="nightly-cpu")

sys.path.insert(0, os.path.join(REPO_ROOT, "scripts", "bench"))
import bench_pd_transfer as bench  # noqa: E402


class Pool:  # a rank's pool for a 256-page request with --layout allocator
    page_size = 16
    size = bench.pool_pages(SimpleNamespace(tokens=256 * 16, page_size=16, layout="allocator")) * 16


def test_allocator_layout_is_valid_deterministic_and_in_runs():
    n = 256
    runs = []
    for seed in range(6):
        pages = np.array(bench.allocator_pages(Pool, n, seed))
        assert pages.tolist() == bench.allocator_pages(Pool, n, seed)  # same seed, same pages
        assert len(np.unique(pages)) == n and pages.min() >= 1 and pages.max() <= Pool.size // Pool.page_size
        runs.append(len(page_runs(pages, pages)[0]))
    assert max(runs) < n // 8, runs  # the sorted free list keeps most pages adjacent
    scattered = np.array(bench.scattered_pages(Pool, n, 0))
    assert len(page_runs(scattered, scattered)[0]) > n // 2


def test_request_pages_follows_the_layout_flag():
    args = SimpleNamespace(layout="allocator")
    assert bench.request_pages(args, Pool, 64, 3) == bench.allocator_pages(Pool, 64, 3)
    args.layout = "scattered"
    assert bench.request_pages(args, Pool, 64, 3) == bench.scattered_pages(Pool, 64, 3)


def test_bench_runs_with_the_allocator_layout(tmp_path):
    out = tmp_path / "pd.json"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "bench", "bench_pd_transfer.py"), "--tokens", "64",
           "--layers", "2", "--cases", "1x1x2", "--iters", "1", "--layout", "allocator", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (rec,) = json.loads(out.read_text())
    assert rec["layout"] == "allocator" and 1 <= rec["page_runs_median"] <= 4
    assert rec["gbps"] > 0 and rec["baseline_gbps"] > 0


def test_sidecar_bytes_are_whole_pages_from_the_first_target():
    args = SimpleNamespace(tokens=64, layers=2, sidecar_layers=3, state_layers=0)
    per_token = 2 * (512 + 64) * 2 + 3 * (128 * 2 + 4)  # MLA latents + indexer key and scale
    assert bench.pair_bytes(args, 1, 2, 8) == {(0, 0): 64 * per_token, (0, 1): 64 * per_token}
    assert bench.pair_bytes(args, 2, 1, 8) == {(0, 0): 64 * per_token}  # replicated: one sender
    assert bench.paged_buffers(args) == 2 + 2 * 3


def test_bench_runs_the_sidecar_case(tmp_path):
    out = tmp_path / "pd.json"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "bench", "bench_pd_transfer.py"), "--tokens", "64",
           "--layers", "2", "--sidecar-layers", "2", "--cases", "1x1x1,1x2x1", "--iters", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "sidecar" in proc.stdout
    one, two = json.loads(out.read_text())
    assert one["sidecar_bytes"] == 64 * 2 * (128 * 2 + 4) and two["sidecar_bytes"] == 2 * one["sidecar_bytes"]
    assert two["bytes"] == 2 * one["bytes"] and all(r["gbps"] > 0 and r["ratio"] > 0 for r in (one, two))
    refused = subprocess.run([*cmd[:2], "--sidecar-layers", "1", "--state-layers", "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "exclude each other" in refused.stderr
