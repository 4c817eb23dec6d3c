"""DeepSeek, the longer stories:

* NIXL L3 for DeepSeek-V2 at TP=2: the MLA latent is replicated over the ranks, so only TP rank 0
  backs pages up (counted per rank through ``storage_per_rank``: rank 0 wrote every page and
  skipped none, rank 1 wrote none and skipped its backups; the store holds exactly one ``_k``
  object per page rank 0 wrote: no rank wrote under a key of its own); a TP=1 server then
  opens the same directory and serves the conversation from it (storage hits), token-identical
  to the reference.
  DeepSeek-V3.2 the same, its DSA indexer sidecar backed up with the latent (rank 0 only too).
* DeepSeek-V3 (q LoRA, noaux_tc router, YaRN) and V3.2 through HiCache on the MLA (+ DSA) host
  pool cells, with file L3 after a flush, token-identical to the reference server and to HF.
"""

from __future__ import annotations

import glob
import json
import os
import time

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals
from model_e2e import (
    COMMON,
    WORKLOAD,
    assert_equal_hf_generate,
    check_host_then_storage,
    run_reference,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process
from test_hicache_storage import storage_flags, wait_backed_up

register_cpu_ci(est_time=90, suite="nightly-cpu")

TP_LOGPROB_TOL = 1e-4  # TP=2 all-reduces in another order than TP=1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {arch: make_tiny_model(str(root / arch), arch) for arch in ("deepseek_v2", "deepseek_v3", "deepseek_v32")}


def storage_stats(server) -> dict:
    return server.get("/get_server_info").json()["scheduler"]["storage"]


def settled_per_rank(server, timeout: float = 30) -> list[dict]:
    """Each rank's L3 counters once rank 1's have stopped changing (its backups run on its own
    thread, so it may lag rank 0's by a moment)."""
    deadline, last, stable = time.monotonic() + timeout, None, 0
    while True:
        ranks = server.get("/get_server_info").json()["scheduler"]["storage_per_rank"]
        stable = stable + 1 if ranks == last and ranks[1].get("pages_skipped", 0) > 0 else 0
        if stable >= 5 or time.monotonic() > deadline:
            return ranks  # the assertions below report the counts
        last = ranks
        time.sleep(0.1)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v32"])
def test_nixl_tp2_rank0_writes_then_tp1_reads(models, tmp_path, arch):
    pytest.importorskip("nixl")
    model, store = models[arch], str(tmp_path / "nixl")
    ref = run_reference(model)
    with launch_server_process(model, *storage_flags("nixl", store), "--tp-size", "2") as srv:
        tp2 = run_workload(srv, **WORKLOAD)
        written = wait_backed_up(srv)
        stats = storage_stats(srv)
        rank0, rank1 = settled_per_rank(srv)
    assert_same_tokens(ref, tp2, logprob_tol=TP_LOGPROB_TOL)
    assert written > 0 and stats.get("pages_skipped", 0) == 0, stats  # rank 0 wrote every page itself
    assert rank0.get("pages_written") == written and rank0.get("pages_skipped", 0) == 0, rank0
    # rank 1 wrote nothing and skipped its backups (how many it attempted depends on when its own
    # existence checks saw rank 0's pages, so the count is not rank 0's)
    assert rank1.get("pages_written", 0) == 0 and rank1.get("pages_skipped", 0) > 0, rank1
    objects = [p for p in glob.glob(os.path.join(store, "**", "*"), recursive=True) if os.path.isfile(p)]
    by_suffix = {}
    for p in objects:
        suffix = os.path.basename(p).split(".", 1)[1][64:]  # <group>.<64 hex><suffix>
        by_suffix[suffix] = by_suffix.get(suffix, 0) + 1
    # MLA: one latent object per page; V3.2 also the indexer key and scale objects of each page
    # (pages_written counts the pages of every pool: the latent's and the indexer's).
    if arch == "deepseek_v2":
        want = {"_k": written}
    else:
        want = {"_k": written // 2, "_indexer_k": written // 2, "_indexer_v": written // 2}
    assert by_suffix == want, (by_suffix, written)

    with launch_server_process(model, *storage_flags("nixl", store)) as srv:  # TP=1, empty device and host
        tp1 = run_workload(srv, **WORKLOAD)
        read = storage_stats(srv)
    assert_same_tokens(ref, tp1, logprob_tol=TP_LOGPROB_TOL)
    assert tier_totals(tp1)["storage"] > 0, tier_totals(tp1)
    assert read.get("pages_hit", 0) > 0, read
    assert_equal_hf_generate(model, ref)


@pytest.mark.parametrize("layout, io_backend", [
    ("layer_first", "direct"),
    ("page_first_direct", "direct"),
    ("page_first", "kernel"),
])
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_hicache_cells_with_file_l3(models, tmp_path, layout, io_backend, arch):
    model = models[arch]
    ref = run_reference(model)
    check_host_then_storage(model, ref, str(tmp_path / "l3"), "--hicache-mem-layout", layout,
                            "--hicache-io-backend", io_backend)
    if layout == "layer_first":
        assert_equal_hf_generate(model, ref)


def test_config_missing_required_key_stops_startup(models, tmp_path):
    from sglang.test.server_utils import run_launcher

    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(models["deepseek_v2"]):
        src = os.path.join(models["deepseek_v2"], name)
        os.symlink(src, bad / name) if name != "config.json" else None
    with open(os.path.join(models["deepseek_v2"], "config.json")) as f:
        raw = json.load(f)
    raw.pop("kv_lora_rank")
    (bad / "config.json").write_text(json.dumps(raw))
    proc = run_launcher(str(bad), *COMMON)
    assert proc.returncode == 1 and "kv_lora_rank" in proc.stderr, proc.stderr[-2000:]
