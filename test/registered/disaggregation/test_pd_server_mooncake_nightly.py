"""PD serving with ``--disaggregation-transfer-backend mooncake`` (Mooncake's transfer engine,
TCP on 127.0.0.1) behind the real router: prefill tp2 -> decode tp1 and tp1 -> tp2 on a model
with two KV heads (decode gathers one head from each prefill rank; each decode rank takes its
slice of the one prefill rank). Greedy outputs of single prompts and a multi-turn workload are
token-identical to a plain tp1 server, and both PD servers settle clean."""

import pytest

from pd_cluster import check_pd_pair, reference_server
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=60, suite="nightly-cpu")

PROMPTS = [[12 + (i * 19 + k * 7) % 820 for i in range(35 + 30 * k)] for k in range(3)]
MOONCAKE = ("--disaggregation-transfer-backend", "mooncake")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny2kv")), "qwen3", "--kv-heads", "2")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    with reference_server(model, str(tmp_path_factory.mktemp("logs"))) as srv:
        yield srv


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_mooncake_pd_outputs_identical(model, reference, prefill_tp, decode_tp, tmp_path):
    check_pd_pair(model, reference.url, prefill_tp, decode_tp, PROMPTS, log_dir=str(tmp_path), flags=MOONCAKE)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
