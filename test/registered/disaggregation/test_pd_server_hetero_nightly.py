"""PD serving across TP sizes with a model whose KV heads split evenly (2 KV heads): prefill
tp2 -> decode tp1 (decode gathers one head from each prefill rank), tp1 -> tp2 (each decode rank
takes its head slice of the one prefill rank) and tp2 -> tp2, token-identical to a plain tp1
server for single prompts and a multi-turn workload (the one-KV-head replication cases run per
commit in test_pd_server_hetero.py)."""

import pytest

from pd_cluster import check_pd_pair, reference_server
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=60, suite="nightly-cpu")

PROMPTS = [[15 + (i * 23 + k * 11) % 850 for i in range(40 + 30 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny2kv")), "qwen3", "--kv-heads", "2")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    with reference_server(model, str(tmp_path_factory.mktemp("logs"))) as srv:
        yield srv


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2)],
                         ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"])
def test_head_split_tp_outputs_identical(model, reference, prefill_tp, decode_tp, tmp_path):
    check_pd_pair(model, reference.url, prefill_tp, decode_tp, PROMPTS, log_dir=str(tmp_path))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
