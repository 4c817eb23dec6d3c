"""--pp-size through the server, on a tiny Qwen3 of 3 layers with tied embeddings (stage 0 holds
the embedding and layer 0; stage 1 layers 1-2, the norm and the head, which is the embedding):

- greedy tokens and logprobs equal --tp-size 1 bit for bit at --pp-size 2 and 3 (and HF
  ``generate``); --tp-size 2 --pp-size 2 (4 ranks) equal tokens, logprobs within 1e-4
  (all-reduce order);
- HiCache with file L3 at --pp-size 2: host hits, every stage writes its own objects once (the
  directory holds exactly what the stages report written, the same count per stage), the idle
  integrity check ran on every rank; a restart with the same split serves from storage; a
  restart at --pp-size 1 over the same directory finds nothing (another split never reads them);
- Qwen3-Next (linear, full, linear, full: each stage one linear-attention layer with its state
  pool and one full-attention layer with its KV pool) at --pp-size 2: without a prefix cache
  the tokens of --pp-size 1 (logprobs within Qwen3-Next's 1e-4: chunk placement follows batch
  composition) and of HF; with HiCache + file L3 host hits restore KV and
  state on both stages, a restart with the same split serves from storage, one at --pp-size 1
  finds nothing;
- refused at startup: more stages than layers and a Qwen3-Next split that leaves a stage without
  a full-attention layer (an architecture without pipeline support, DeepSeek-V4, and the MLA
  cases are in test_pipeline_parallel_mla_nightly.py).
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
from sglang.test.server_utils import launch_server_process, run_launcher

register_cpu_ci(est_time=240, suite="nightly-cpu")


def _run(model, *flags):
    with launch_server_process(model, *COMMON, *flags) as srv:
        turns = run_workload(srv, **WORKLOAD)
        per_rank = idle_checks_per_rank(srv)
    return turns, per_rank


@pytest.mark.parametrize("pp", [2, 3])
def test_pp_matches_tp1_and_hf(model3, reference, pp):
    turns, per_rank = _run(model3, *REFERENCE, "--pp-size", str(pp))
    assert_same_tokens(reference, turns)
    assert len(per_rank) == pp and min(per_rank) > 0
    if pp == 2:
        assert_equal_hf_generate(model3, turns)


def test_tp2_pp2_matches_tp1(model3, reference):
    turns, per_rank = _run(model3, *REFERENCE, "--tp-size", "2", "--pp-size", "2")
    assert_same_tokens(reference, turns, logprob_tol=1e-4)
    assert len(per_rank) == 4 and min(per_rank) > 0


def test_pp2_hicache_file_l3_per_stage(model3, reference, tmp_path):
    storage_dir = str(tmp_path / "l3")
    flags = [*COMMON, *SMALL_DEVICE, *file_l3_flags(storage_dir)]
    written, objects = check_split_l3(model3, reference, flags, ["--pp-size", "2"], storage_dir=storage_dir)
    assert len(written) == 2 and written[0] == written[1] > 0, written
    # one object per page per stage (the KV of its layers), no stage's page twice
    assert objects == sum(written)


def test_qwen3_next_pp2_matches_pp1_and_hf(next4, next_reference):
    with launch_server_process(next4, *NEXT_PLAIN, "--pp-size", "2") as srv:
        turns = run_workload(srv, **NEXT_WORKLOAD)
        assert min(idle_checks_per_rank(srv)) > 0
    # tokens equal; logprobs within the Qwen3-Next tolerance: concurrent clients may meet other
    # batch compositions, so prefill chunks (and the delta rule's chunking) can fall elsewhere
    assert_same_tokens(next_reference, turns, NEXT_LOGPROB_TOL)
    assert_equal_hf_generate(next4, turns)


def test_qwen3_next_pp2_hicache_host_then_storage(next4, next_reference, tmp_path):
    written = check_qwen3_next_split_l3(next4, next_reference, str(tmp_path / "l3"), ["--pp-size", "2"])
    assert len(written) == 2 and written[0] == written[1] > 0, written


def test_refused_at_startup(model3, next4):
    proc = run_launcher(model3, *COMMON, "--pp-size", "4")
    assert proc.returncode == 1
    assert "--pp-size 4 exceeds the model's 3 layers; allowed: 1 to 3" in proc.stderr, proc.stderr[-2000:]
    # 4 stages of one layer each: stages 0 and 2 hold only linear-attention layers
    proc = run_launcher(next4, *COMMON, "--pp-size", "4")
    assert proc.returncode == 1
    assert "has no full_attention layer" in proc.stderr, proc.stderr[-2000:]
