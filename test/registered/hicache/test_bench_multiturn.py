"""The multi-turn benchmark wrapper runs end to end on a tiny model (HiCache off, then on, with a
device pool smaller than the working set) and its JSON holds the promised keys; with HiCache on
the hit rate is within 5% of the reusable fraction, and without it far below."""

import json
import os
import subprocess
import sys

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT, make_tiny_model
from sglang.test.server_utils import server_env

register_cpu_ci(est_time=30, suite="nightly-cpu")


def test_bench_multiturn_off_vs_on(tmp_path):
    model = make_tiny_model(str(tmp_path / "tiny"), "qwen3")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "bench", "bench_multiturn_hicache.py"),
           "--model-path", model, "--device-tokens", "512", "--page-size", "4", "--num-clients", "6",
           "--num-rounds", "4", "--request-length", "64", "--output-length", "8", "--request-rate", "50",
           "--round-barrier", "--json", str(out)]
    proc = subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for key in ("ttft_p50_off", "ttft_p50_on", "ttft_ratio", "throughput_ratio", "hit_rate", "reusable_fraction"):
        assert isinstance(result[key], float), key
    assert result["reusable_fraction"] > 0.5
    assert abs(result["hit_rate"] - result["reusable_fraction"]) <= 0.05
    assert result["hit_rate_off"] < result["hit_rate"] - 0.2  # the device alone cannot hold the history
    assert result["on"]["hit_rate_by_tier"]["host"] > 0
    assert "TTFT p50 on/off" in proc.stdout
