"""--attn-cp-size through the server, on a tiny Qwen3 (3 layers, tied embeddings) and a tiny
Qwen3-Next (linear, full, linear, full):

- greedy tokens at --attn-cp-size 2 (page round robin over 2 CP ranks, partial attentions combined
  by log-sum-exp) equal --tp-size 1 and HF ``generate``, logprobs within 1e-4 (the combine sums
  in another order); --page-size 1, --attn-cp-size 3 and --tp-size 2 --attn-cp-size 2 (4 ranks)
  equal tokens too;
- HiCache with file L3 (write_through) and NIXL (write_back) at --attn-cp-size 2: host hits,
  every CP rank writes its own objects (namespace carries cp rank/size), the idle integrity
  check ran on every rank; a restart with the same split serves from storage; a restart at
  --attn-cp-size 1 finds nothing;
- seed 003 on the served path: Qwen3-Next's HybridCacheController on each CP rank reports its own
  attn_cp_rank and the shared attn_cp_size, and its storage config carries them;
- refused at startup: an architecture without CP support (MLA), CP with --pp-size.
"""

import pytest
from hicache_workload import assert_same_tokens, run_workload
from model_e2e import COMMON, REFERENCE, SMALL_DEVICE, WORKLOAD, assert_equal_hf_generate, file_l3_flags
from parallel_e2e import (  # noqa: F401 (model3, reference, next4, next_reference: fixtures)
    NEXT_PLAIN,
    check_qwen3_next_split_l3,
    check_split_l3,
    idle_checks_per_rank,
    model3,
    next4,
    next_reference,
    reference,
)
from test_qwen3_next_e2e import LOGPROB_TOL as NEXT_LOGPROB_TOL
from test_qwen3_next_e2e import WORKLOAD as NEXT_WORKLOAD

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process, run_launcher

register_cpu_ci(est_time=150, suite="nightly-cpu")

LOGPROB_TOL = 1e-4


def _run(model, *flags):
    with launch_server_process(model, *COMMON, *flags) as srv:
        turns = run_workload(srv, **WORKLOAD)
        per_rank = idle_checks_per_rank(srv)
    return turns, per_rank


def test_cp2_matches_tp1_and_hf(model3, reference):
    turns, per_rank = _run(model3, *REFERENCE, "--attn-cp-size", "2")
    assert_same_tokens(reference, turns, LOGPROB_TOL)
    assert len(per_rank) == 2 and min(per_rank) > 0
    assert_equal_hf_generate(model3, turns)


@pytest.mark.parametrize("flags", [("--attn-cp-size", "2", "--page-size", "1"), ("--attn-cp-size", "3")])
def test_other_splits_match_tp1(model3, reference, flags):
    # --page-size 1: token round robin (upstream's interleave split); 3 CP ranks
    turns, per_rank = _run(model3, *REFERENCE, *flags)
    assert_same_tokens(reference, turns, LOGPROB_TOL)
    assert len(per_rank) == int(flags[1]) and min(per_rank) > 0


def test_tp2_cp2_matches_tp1(model3, reference):
    turns, per_rank = _run(model3, *REFERENCE, "--tp-size", "2", "--attn-cp-size", "2")
    assert_same_tokens(reference, turns, LOGPROB_TOL)
    assert len(per_rank) == 4 and min(per_rank) > 0


@pytest.mark.parametrize("backend, policy", [("file", "write_through"), ("nixl", "write_back")])
def test_cp2_hicache_l3_per_rank(model3, reference, tmp_path, backend, policy):
    storage_dir = str(tmp_path / "l3")
    flags = [*COMMON, *SMALL_DEVICE, *file_l3_flags(storage_dir, backend), "--hicache-write-policy", policy]
    written, objects = check_split_l3(model3, reference, flags, ["--attn-cp-size", "2"], storage_dir=storage_dir,
                                      tol=LOGPROB_TOL)
    assert len(written) == 2 and written[0] == written[1] > 0, written
    if backend == "file":  # one object per page per CP rank (NIXL's file plugin keeps more per page)
        assert objects == sum(written)


def test_qwen3_next_cp2_matches_cp1_and_hf(next4, next_reference):
    with launch_server_process(next4, *NEXT_PLAIN, "--attn-cp-size", "2") as srv:
        turns = run_workload(srv, **NEXT_WORKLOAD)
        assert min(idle_checks_per_rank(srv)) > 0
    assert_same_tokens(next_reference, turns, NEXT_LOGPROB_TOL)
    assert_equal_hf_generate(next4, turns)


def test_qwen3_next_cp2_hicache_seed003_and_storage(next4, next_reference, tmp_path):
    def seed003(info):  # each CP rank's HybridCacheController from the one CacheInitParams
        ctrl = info["cache_controller_per_rank"]
        assert [c["class"] for c in ctrl] == ["HybridCacheController"] * 2, ctrl
        assert [c["attn_cp_rank_and_size"] for c in ctrl] == [[0, 2], [1, 2]], ctrl
        assert [[c["storage_config"]["attn_cp_rank"], c["storage_config"]["attn_cp_size"]] for c in ctrl] \
            == [[0, 2], [1, 2]], ctrl

    written = check_qwen3_next_split_l3(next4, next_reference, str(tmp_path / "l3"), ["--attn-cp-size", "2"],
                                        on_start=seed003)
    assert len(written) == 2 and min(written) > 0, written  # every CP rank writes its own KV and states


def test_refused_at_startup(model3, tmp_path):
    deepseek = make_tiny_model(str(tmp_path / "deepseek"), "deepseek_v2")
    proc = run_launcher(deepseek, *COMMON, "--attn-cp-size", "2")
    assert proc.returncode == 1
    assert "--attn-cp-size 2 is not supported for DeepseekV2ForCausalLM" in proc.stderr, proc.stderr[-2000:]
    proc = run_launcher(model3, *COMMON, "--attn-cp-size", "2", "--pp-size", "2")
    assert proc.returncode == 2  # a flag combination: refused while parsing
    assert "--attn-cp-size 2 is not supported with --pp-size 2" in proc.stderr, proc.stderr[-2000:]
