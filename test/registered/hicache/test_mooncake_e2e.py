"""Two servers sharing one Mooncake master (a real ``mooncake_master`` on 127.0.0.1): server B,
fresh, answers the conversation that only server A has served from the L3 pages A wrote
(``cached_tokens_details.storage > 0``), with the greedy tokens and logprobs of a server without
HiCache. Tiny Qwen3 (MHA pool). MLA, the hybrid model and the master killed / restarted under
running servers are in test_mooncake_e2e_nightly.py.
"""

from __future__ import annotations

import json

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals, wait_idle_check
from test_hicache_storage import wait_backed_up

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.mooncake_master import MooncakeMaster, mooncake_or_skip
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=25, suite="nightly-cpu")

COMMON = ["--page-size", "4", "--context-length", "2048"]
SMALL_DEVICE = ["--max-total-tokens", "512", "--enable-hierarchical-cache", "--hicache-ratio", "8"]
WORKLOAD = {"clients": 4, "rounds": 2}


def mooncake_l3_flags(master: MooncakeMaster, **extra) -> list[str]:
    """The L3 flags of a server on ``master`` (TCP, 64 MiB segment, prefetch waits for every page)."""
    config = master.extra_config(global_segment_size=64 << 20, prefetch_threshold=4, **extra)
    return ["--hicache-storage-backend", "mooncake", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(config)]


@pytest.fixture(scope="module")
def master():
    mooncake_or_skip()
    with MooncakeMaster() as m:
        yield m


@pytest.fixture(scope="module")
def reference(model):
    """The workload on a server without HiCache (its device pool holds everything)."""
    with launch_server_process(model, *COMMON, "--max-total-tokens", "16384") as srv:
        return run_workload(srv, **WORKLOAD)


def test_server_b_serves_from_pages_server_a_wrote(model, master, reference):
    flags = [*COMMON, *SMALL_DEVICE, *mooncake_l3_flags(master)]
    with launch_server_process(model, *flags) as a, launch_server_process(model, *flags) as b:
        first = run_workload(a, **WORKLOAD)
        assert_same_tokens(reference, first)
        assert tier_totals(first)["storage"] == 0, tier_totals(first)  # the store started empty
        assert wait_backed_up(a) > 0
        seen_by_b = run_workload(b, **WORKLOAD)
        assert_same_tokens(reference, seen_by_b)
        totals = tier_totals(seen_by_b)
        assert totals["storage"] > 0, totals
        assert seen_by_b[0].cached["storage"] > 0, seen_by_b[0].cached  # B's very first request
        assert wait_idle_check(b)["num_idle_checks"] > 0
        stats = b.get("/get_server_info").json()["scheduler"]["storage"]
        assert stats["pages_hit"] > 0 and stats["corruptions"] == 0, stats
