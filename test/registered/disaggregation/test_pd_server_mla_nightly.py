"""PD serving of an MLA model (tiny DeepSeek-V2): ``KVArgs`` come from the runner's MLA pool (one
latent per token, replicated across TP ranks, so only one prefill rank sends it), for prefill
tp 1 -> 1, 2 -> 1 and 1 -> 2 behind the real router; greedy outputs of single prompts and a
multi-turn workload token-identical to a plain tp1 server, both PD servers settle clean. (Models
with a sidecar pool or a state pool: test_pd_server_hybrid_nightly.py.)"""

import pytest

from pd_cluster import check_pd_pair, reference_server
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=40, suite="nightly-cpu")

PROMPTS = [[10 + (i * 17 + k * 5) % 800 for i in range(30 + 25 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_mla")), "deepseek_v2")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    with reference_server(model, str(tmp_path_factory.mktemp("logs"))) as srv:
        yield srv


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (2, 1), (1, 2)],
                         ids=["tp1-to-tp1", "tp2-to-tp1", "tp1-to-tp2"])
def test_mla_outputs_identical(model, reference, prefill_tp, decode_tp, tmp_path):
    check_pd_pair(model, reference.url, prefill_tp, decode_tp, PROMPTS, log_dir=str(tmp_path))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
