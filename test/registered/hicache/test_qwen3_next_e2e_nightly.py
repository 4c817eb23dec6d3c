"""Qwen3-Next served with HiCache, the longer stories: the NIXL L3 backend (POSIX plugin) restores
KV pages and linear-attention states after a restart like the file backend does; bf16 states come
back from L3 bit for bit; a TP=2 server (each rank holds its head shard of every state) gives the
reference's tokens."""

import random

import pytest
import test_qwen3_next_e2e as e2e
from hicache_workload import (
    GREEDY,
    assert_same_tokens,
    run_workload,
    tier_totals,
    wait_idle_check,
)
from model_e2e import file_l3_flags, run_checked
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.server_utils import launch_server_process
from test_hicache_storage import wait_backed_up
from test_qwen3_next_e2e import (
    COMMON,
    LOGPROB_TOL,
    SMALL_DEVICE,
    WORKLOAD,
    run_later_rounds,
)

register_cpu_ci(est_time=60, suite="nightly-cpu")

qwen3_next, reference = e2e.qwen3_next, e2e.reference  # fixtures: the tiny checkpoint, the reference run


def test_nixl_restart_restores_kv_and_state(qwen3_next, reference, tmp_path):
    pytest.importorskip("nixl")
    flags = [*COMMON, *SMALL_DEVICE, *file_l3_flags(str(tmp_path / "nixl"), "nixl")]
    with launch_server_process(qwen3_next, *flags) as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert_same_tokens(reference, turns, LOGPROB_TOL)
        assert wait_backed_up(srv) > 0
    with launch_server_process(qwen3_next, *flags) as srv:
        assert run_later_rounds(srv, reference) > 0
        assert wait_idle_check(srv)["num_idle_checks"] > 0


def test_tp2_hicache_matches_reference(qwen3_next, reference):
    turns = run_checked(qwen3_next, reference, *COMMON, *SMALL_DEVICE, "--tp-size", "2", logprob_tol=LOGPROB_TOL,
                        workload=WORKLOAD)
    assert tier_totals(turns)["host"] > 0


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_bf16_state_survives_l3_bit_for_bit(qwen3_next, tmp_path, backend):
    """bf16 conv states: a turn resumed from a state restored from L3 after a restart gives exactly
    the logprobs of the same turn resumed from that state on device before the restart (same hit
    length). With layer_first, NIXL moves the KV pages through byte bounce buffers and the Mamba
    states (contiguous per slot on the host) zero-copy. Flipping the low mantissa bit of the
    restored conv states (checked by hand, by patching the NIXL read) fails this test."""
    if backend == "nixl":
        pytest.importorskip("nixl")
    flags = [*COMMON, *SMALL_DEVICE, "--dtype", "bfloat16", "--hicache-mem-layout", "layer_first",
             *file_l3_flags(str(tmp_path / backend), backend)]
    rng = random.Random(5)
    first = [rng.randrange(3, 999) for _ in range(88)]  # page-aligned: a state checkpoint at its end
    params = {"max_new_tokens": 8, **GREEDY}
    with launch_server_process(qwen3_next, *flags) as srv:
        out = srv.generate(input_ids=first, sampling_params=params)
        second = first + out["output_ids"] + [rng.randrange(3, 999) for _ in range(40)]
        # the first pass leaves a checkpoint at its prompt's last page (issue 28); the second resumes there,
        # as the restarted server will from L3
        srv.generate(input_ids=second, sampling_params=params)
        before = srv.generate(input_ids=second, sampling_params=params, return_logprob=True)
        assert wait_backed_up(srv) > 0
    with launch_server_process(qwen3_next, *flags) as srv:
        after = srv.generate(input_ids=second, sampling_params=params, return_logprob=True)
    hit_before = before["meta_info"]["cached_tokens_details"]
    hit_after = after["meta_info"]["cached_tokens_details"]
    assert hit_after["storage"] > 0 and sum(hit_after.values()) == sum(hit_before.values()), (hit_before, hit_after)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
