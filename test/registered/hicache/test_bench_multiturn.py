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


def test_bench_multiturn_follow_ups_and_ideal_server(tmp_path):
    """``--sub-question-input-length`` (upstream's name) sets the question length of the rounds
    after the first, and ``--ideal-device-tokens`` adds the plain-cache server whose device pool
    holds everything; its ratios are reported, and HiCache on answers as it does."""
    model = make_tiny_model(str(tmp_path / "tiny"), "qwen3")
    out = tmp_path / "bench.json"
    clients, rounds, first, follow, answer = 4, 4, 64, 16, 8
    cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "bench", "bench_multiturn_hicache.py"),
           "--model-path", model, "--device-tokens", "256", "--page-size", "4", "--num-clients", str(clients),
           "--num-rounds", str(rounds), "--request-length", str(first), "--sub-question-input-length", str(follow),
           "--output-length", str(answer), "--request-rate", "50", "--ideal-device-tokens", "4096",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    # round r sends the first question, r answers and r follow-ups
    per_client = sum(first + r * (follow + answer) for r in range(rounds))
    for side in ("off", "on"):
        assert result[side]["prompt_tokens"] == clients * per_client, side
    for key in ("on_vs_ideal_ttft", "ideal_ttft_ratio"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["outputs_identical"]
    assert "TTFT p50 on/ideal" in proc.stdout
