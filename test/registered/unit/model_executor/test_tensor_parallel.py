"""TP=2 over gloo (two processes on 127.0.0.1) gives the same greedy tokens as TP=1 and close
logits, with sharded KV heads and with KV heads replicated (tp_size > num_kv_heads)."""


import pytest
import torch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model, run_tp_workers
from tp_worker import run_model

register_cpu_ci(est_time=30, suite="per-commit-cpu")

TP_SIZE, NEW_TOKENS, TIMEOUT_S = 2, 5, 240
_g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(5, 1000, (n,), generator=_g).tolist() for n in (4, 33, 140)]


def run_tp(models, out_file):
    return run_tp_workers(models, PROMPTS, NEW_TOKENS, out_file, TP_SIZE, TIMEOUT_S)


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
