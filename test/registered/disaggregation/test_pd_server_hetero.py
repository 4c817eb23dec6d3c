"""PD serving with different TP sizes on the two sides, behind the real router: prefill tp2 ->
decode tp1 and prefill tp1 -> decode tp2 (gloo TP, NIXL UCX between servers), plus tp1 -> tp1
as the reference point, on a model with ONE KV head, so every tp2 rank holds a replica of it
(decode tp2 ranks each receive the whole head; of two prefill tp2 ranks only one sends).
Greedy outputs of single prompts and a multi-turn workload are token-identical to a plain tp1
server, and both PD servers settle clean (no room open, no failure, idle integrity check)."""

import pytest

from pd_cluster import check_pd_pair, reference_server
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=45, suite="nightly-cpu")

PROMPTS = [[10 + (i * 17 + k * 5) % 800 for i in range(30 + 25 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny1kv")), "qwen3", "--kv-heads", "1")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    with reference_server(model, str(tmp_path_factory.mktemp("logs"))) as srv:
        yield srv


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (1, 1)],
                         ids=["tp2-to-tp1", "tp1-to-tp2", "tp1-to-tp1"])
def test_hetero_tp_outputs_identical(model, reference, prefill_tp, decode_tp, tmp_path):
    check_pd_pair(model, reference.url, prefill_tp, decode_tp, PROMPTS, log_dir=str(tmp_path))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
