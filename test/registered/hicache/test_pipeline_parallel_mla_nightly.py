"""--pp-size through the server on MLA: a tiny DeepSeek-V2 of 3 layers (layer 0 dense, 1-2 MoE;
stage 0 holds the embedding and the dense layer, stage 1 the two MoE layers, the norm and the
head), DeepSeek-V3 (sigmoid router, YaRN rope) and DeepSeek-V3.2 (MLA + the DSA indexer sidecar)
split the same way:

- greedy tokens and logprobs at --pp-size 2 equal --pp-size 1 bit for bit, and HF ``generate``;
- --tp-size 2 --pp-size 2 with HiCache and file L3: the latent is replicated over a stage's TP
  ranks but differs between stages, so TP rank 0 of each stage writes its own objects and the
  other TP rank writes none: the directory holds exactly the objects those two ranks report
  (every TP rank writing, as non-MLA does, would be twice that); a restart with the same split
  serves from storage, a restart at --pp-size 1 (another split) finds nothing;
- DeepSeek-V4 (hyper-connection streams between layers) is refused at startup with the reason.

The Qwen3 / Qwen3-Next cases are in test_pipeline_parallel_nightly.py.
"""

import os

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals
from parallel_e2e import idle_checks_per_rank, scheduler_info, stored_objects
from model_e2e import COMMON, REFERENCE, SMALL_DEVICE, WORKLOAD, assert_equal_hf_generate, file_l3_flags
from test_hicache_storage import wait_backed_up

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process, run_launcher

register_cpu_ci(est_time=130, suite="nightly-cpu")


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def model(request, tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param, "--layers", "3")


@pytest.fixture(scope="module")
def reference(model):
    with launch_server_process(model, *COMMON, *REFERENCE) as srv:
        return run_workload(srv, **WORKLOAD)


def test_pp2_matches_pp1_and_hf(model, reference):
    with launch_server_process(model, *COMMON, *REFERENCE, "--pp-size", "2") as srv:
        turns = run_workload(srv, **WORKLOAD)
        per_rank = idle_checks_per_rank(srv)
        assert len(per_rank) == 2 and min(per_rank) > 0, per_rank
    assert_same_tokens(reference, turns)
    assert_equal_hf_generate(model, turns)


def test_tp2_pp2_hicache_file_l3_tp_rank0_of_each_stage_writes(model, reference, tmp_path):
    storage_dir = str(tmp_path / "l3")
    flags = [*COMMON, *SMALL_DEVICE, *file_l3_flags(storage_dir)]
    split = ["--tp-size", "2", "--pp-size", "2"]
    with launch_server_process(model, *flags, *split) as srv:
        first = run_workload(srv, **WORKLOAD)
        assert tier_totals(first)["host"] > 0, tier_totals(first)
        assert wait_backed_up(srv) > 0
        assert min(idle_checks_per_rank(srv)) > 0
        info = scheduler_info(srv)
    assert_same_tokens(reference, first, logprob_tol=1e-4)  # tokens equal; TP all-reduce order
    assert min(info["idle_checks_per_rank"]) > 0, info["idle_checks_per_rank"]
    # global rank = pp_rank * tp_size + tp_rank: ranks 0 and 2 are TP rank 0 of stages 0 and 1
    written = [s["pages_written"] for s in info["storage_per_rank"]]
    assert len(written) == 4 and written[0] == written[2] > 0 and written[1] == written[3] == 0, written
    objects = stored_objects(storage_dir)
    # each stage's pages once (the stages hold different layers); non-MLA would store 2x this
    assert objects == written[0] + written[2], (objects, written)
    if "v32" in model:  # the indexer sidecar's object beside each latent object, per stage too
        indexer = sum("_indexer" in n for _, _, files in os.walk(storage_dir) for n in files)
        assert 2 * indexer == objects, (indexer, objects)

    with launch_server_process(model, *flags, *split) as srv:  # same split: served from storage
        again = run_workload(srv, **WORKLOAD)
        assert min(idle_checks_per_rank(srv)) > 0
    assert_same_tokens(reference, again, logprob_tol=1e-4)
    assert tier_totals(again)["storage"] > 0, tier_totals(again)

    with launch_server_process(model, *flags, "--tp-size", "2") as srv:  # --pp-size 1: another split
        other = run_workload(srv, **WORKLOAD)
    assert_same_tokens(reference, other, logprob_tol=1e-4)
    assert tier_totals(other)["storage"] == 0, tier_totals(other)


def test_deepseek_v4_refused_with_the_reason(tmp_path):
    v4 = make_tiny_model(str(tmp_path / "v4"), "deepseek_v4")
    proc = run_launcher(v4, *COMMON, "--pp-size", "2")
    assert proc.returncode == 1
    assert "--pp-size 2 is not supported for DeepseekV4ForCausalLM: its layers hand on hc_mult" in proc.stderr, \
        proc.stderr[-2000:]
