"""TP=2 over gloo (two processes on 127.0.0.1) gives the same greedy tokens as TP=1 and close
logits, with sharded KV heads and with KV heads replicated (tp_size > num_kv_heads)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.multiprocess import free_port
from tp_worker import run_model

register_cpu_ci(est_time=30, suite="per-commit-cpu")

TP_SIZE, NEW_TOKENS, TIMEOUT_S = 2, 5, 240
_g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(5, 1000, (n,), generator=_g).tolist() for n in (4, 33, 140)]


def run_tp(models, out_file):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in range(TP_SIZE):
            cmd = [sys.executable, worker, "--rank", str(rank), "--tp-size", str(TP_SIZE), "--port", str(port),
                   "--models", *models, "--prompts", json.dumps(PROMPTS), "--new-tokens", str(NEW_TOKENS),
                   "--out", out_file]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for rank, proc in enumerate(procs):
            output, _ = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    with open(out_file) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return [
        make_tiny_model(str(root / "llama"), "llama", "--kv-heads", "2", "--attention-bias", "--seed", "1"),
        make_tiny_model(str(root / "qwen3_kv1"), "qwen3", "--kv-heads", "1", "--seed", "2"),
    ]


def test_tp2_matches_tp1(models, tmp_path):
    tp2 = run_tp(models, str(tmp_path / "tp2.json"))
    for path in models:
        tp1 = run_model(ModelRunner(ModelRunnerConfig(path, max_total_tokens=4096, max_running_requests=8)),
                        PROMPTS, NEW_TOKENS)
        torch.testing.assert_close(torch.tensor(tp2[path]["logits"]), torch.tensor(tp1["logits"]), atol=1e-4, rtol=1e-4)
        for got, want in zip(tp2[path]["outputs"], tp1["outputs"]):
            assert [t for t, _ in got] == [t for t, _ in want], path
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4
