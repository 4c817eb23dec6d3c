"""PD serving of models with more than one pool, through the real sglang-router in PD mode:
Qwen3-Next (MHA KV + a Mamba conv/temporal state slot per request, sharded by heads, so TP 2 -> 1
joins and 1 -> 2 cuts the state rows of each q/k/v segment), DeepSeek-V3.2 (MLA latents + the DSA
indexer sidecar, same pages; tp 1 -> 1, 2 -> 1, 1 -> 2) and DeepSeek-V4 (a logical anchor +
compressed state rows, replicated across TP; 1 -> 1, 2 -> 1); MiMo-V2-Flash (asymmetric K/V head
dims, one pool) stays served, 1 -> 1. Greedy
outputs of single prompts and a 3-turn workload are token-identical to a plain tp1 server of the
same cache configuration, and both PD servers settle with no failure, no open room and a passed
idle integrity check (state slots included). Qwen3-Next also runs with HiCache on the prefill
side (``HiMambaRadixCache``: later turns hit the prefix and its state on prefill). Qwen3-Next
tp 1 -> 1 without HiCache runs per commit (test_pd_server_hybrid.py). The sidecar models also run
1 -> 1 with HiCache on both servers."""

import pytest

from pd_cluster import check_pd_pair, launch_servers
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=300, suite="nightly-cpu")

PROMPTS = [[12 + (i * 19 + k * 7) % 800 for i in range(30 + 26 * k)] for k in range(3)]
NO_RADIX = ("--disable-radix-cache",)
HICACHE = ("--enable-hierarchical-cache", "--hicache-ratio", "4")


def reference_url(model: str, flags: tuple[str, ...], tmp_path_factory, request) -> str:
    (srv,) = launch_servers(model, [flags], log_dir=str(tmp_path_factory.mktemp("ref_logs")))
    request.addfinalizer(srv.stop)
    return srv.url


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, request):
    model = make_tiny_model(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next", "--layers", "4")
    return model, reference_url(model, NO_RADIX, tmp_path_factory, request)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_qwen3_next_outputs_identical(qwen3_next, prefill_tp, decode_tp, tmp_path):
    model, ref = qwen3_next
    check_pd_pair(model, ref, prefill_tp, decode_tp, PROMPTS, log_dir=str(tmp_path), flags=NO_RADIX)


def test_qwen3_next_with_hicache_outputs_identical(qwen3_next, tmp_path):
    model, ref = qwen3_next
    check_pd_pair(model, ref, 1, 1, PROMPTS, log_dir=str(tmp_path), flags=("--page-size", "4", *HICACHE))


@pytest.mark.parametrize("arch, tps", [("deepseek_v32", [(1, 1), (2, 1), (1, 2)]), ("deepseek_v4", [(1, 1), (2, 1)]),
                                       ("mimo_v2_flash", [(1, 1)])])
def test_sidecar_models_outputs_identical(arch, tps, tmp_path_factory, request, tmp_path):
    model = make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch)
    ref = reference_url(model, (), tmp_path_factory, request)
    for prefill_tp, decode_tp in tps:
        check_pd_pair(model, ref, prefill_tp, decode_tp, PROMPTS, log_dir=str(tmp_path))
    # HiCache on both servers (prefill's later turns hit its tree): the same tokens
    check_pd_pair(model, ref, 1, 1, PROMPTS, log_dir=str(tmp_path), flags=("--page-size", "4", *HICACHE))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
