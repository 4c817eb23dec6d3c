"""DeepSeek-V2 / V3 (MLA pool, MoE) and V3.2 (MLA + DSA indexer sidecar) served with HiCache and
file L3, against a reference server and HF (the shared checks of ``model_e2e.py``).

A multi-turn workload whose working set is larger than the HiCache server's device pool: prefixes
are evicted to host and loaded back (host hits in ``meta_info``), written to the file backend, and
after ``/flush_cache`` served from it (storage hits). Greedy tokens and logprobs equal the
reference server's (device pool holding everything) bit for bit, and the tokens equal HF
``generate`` on the same input ids. For V3.2 the indexer keys move with the latent (one
HostPoolGroup) between tiers and through L3; its prompts (88+ tokens) are past index_topk (16),
so attention is sparse. The NIXL / TP=2 / layout-matrix variants are in
test_deepseek_e2e_nightly.py.
"""

from __future__ import annotations

import os

import pytest
from hicache_workload import tier_totals
from model_e2e import (
    assert_cell_refused,
    assert_equal_hf_generate,
    check_host_then_storage,
    run_reference,
)
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=45, suite="nightly-cpu")


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def model(request, tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="module")
def reference(model):
    return run_reference(model)


def _device_pool_is_small(srv) -> None:
    info = srv.get("/get_server_info").json()
    assert info["scheduler"]["pools"]["device"]["capacity_tokens"] == 512


def test_hicache_file_l3_matches_reference_and_hf(model, reference, tmp_path):
    l3 = tmp_path / "l3"
    check_host_then_storage(model, reference, str(l3), check_server=_device_pool_is_small)
    assert tier_totals(reference)["host"] == 0
    # Every stored page has its latent object, and (V3.2) its indexer object beside it.
    names = [n for _, _, files in os.walk(l3) for n in files]
    indexer = [n for n in names if "_indexer" in n]
    assert len(names) > len(indexer) > 0 if "v32" in model else not indexer, sorted(names)[:6]
    if indexer:
        assert len(indexer) == len(names) - len(indexer)
    assert_equal_hf_generate(model, reference)


def test_unsupported_layout_cell_is_refused_naming_the_mla_cells(tmp_path):
    model = make_tiny_model(str(tmp_path / "v2"), "deepseek_v2")  # one architecture is enough for a refusal
    assert_cell_refused(model, PoolKind.MLA, "page_head", "kernel", "layer_first+direct")
