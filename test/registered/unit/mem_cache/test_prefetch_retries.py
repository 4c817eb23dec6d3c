"""L3 check retries (``--hicache-storage-prefetch-retry-poll-interval`` / ``-max-attempts``):
the registry's rules (passes, the queue head, queue order, the cap, 0 disables), where the tree
arms a retry (agreed misses: nothing or too little found, no host room, best_effort stopped
before the answer; not a stop on a time budget, a hit or a prefetch too short to ask), that a
re-issued check finds pages stored after the first one, and that two TP ranks arm on the
agreed verdict (one rank finding the pages does not split them)."""

import traceback
from datetime import timedelta

import pytest
from storage_test_backends import scripted_extra
from tree_fixtures import make_hicache, start_request, wait_for

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.controller.storage_ops import PrefetchState
from sglang.srt.mem_cache.controller.storage_settings import PrefetchRetrySettings
from sglang.srt.mem_cache.hiradix.prefetch_retries import StoragePrefetchRetries
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_ranks

register_cpu_ci(est_time=6, suite="per-commit-cpu")

T = list(range(100, 116))  # 8 pages of 2 tokens
THRESHOLD = 4


def retries(interval=3, max_attempts=8) -> StoragePrefetchRetries:
    return StoragePrefetchRetries(PrefetchRetrySettings(interval, max_attempts))


# ---- the registry ----------------------------------------------------------------------------
def test_a_retry_is_due_poll_interval_passes_after_the_first_pass_that_saw_it():
    r = retries(interval=3)
    r.poll_miss("b")
    assert [r.pop_ready(["h", "b"]) for _ in range(4)] == [[], [], [], ["b"]]
    assert r.attempts("b") == 1 and not r.is_armed("b")
    assert r.pop_ready(["h", "b"]) == []  # disarmed until the next miss


def test_the_queue_heads_retry_is_dropped_the_others_go_in_queue_order():
    r = retries(interval=1)
    for rid in ("h", "c", "b"):
        r.poll_miss(rid)
    assert r.pop_ready(["h", "b", "c"]) == []
    assert not r.is_armed("h") and r.is_armed("b") and r.is_armed("c")
    assert r.pop_ready(["h", "b", "c"]) == ["b", "c"]
    assert r.attempts("h") == 0


def test_the_cap_counts_reissues_per_request():
    r = retries(interval=1, max_attempts=2)
    for _ in range(2):
        r.poll_miss("b")
        assert r.pop_ready(["h", "b"]) == [] and r.pop_ready(["h", "b"]) == ["b"]
    r.poll_miss("b")  # a third miss: past the cap, nothing is armed
    assert not r.is_armed("b") and r.attempts("b") == 2
    assert all(r.pop_ready(["h", "b"]) == [] for _ in range(5))
    r.forget("b")
    assert r.tracked() == 0


@pytest.mark.parametrize("interval,max_attempts", [(0, 8), (8, 0)])
def test_zero_disables_retries(interval, max_attempts):
    r = retries(interval, max_attempts)
    r.poll_miss("b")
    assert not r.is_armed("b") and r.tracked() == 0


def test_settings_are_validated_where_they_enter():
    with pytest.raises(ValueError, match="poll_interval"):
        PrefetchRetrySettings(-1, 8)
    with pytest.raises(ValueError, match="max_attempts"):
        HiCacheConfig(prefetch_retry_max_attempts=-1)
    assert HiCacheConfig().prefetch_retry == PrefetchRetrySettings(8, 8)  # upstream's defaults
    with pytest.raises(ValueError, match="--hicache-storage-prefetch-retry-poll-interval -1"):
        ServerArgs(model_path="m", hicache_storage_prefetch_retry_poll_interval=-1)


# ---- the tree --------------------------------------------------------------------------------
def cache(tmp_path, policy="wait_complete", interval=2, max_attempts=3, host_pages=32, controller_keys=None,
          **script):
    extra = {**scripted_extra(tmp_path / "l3", **script), "prefetch_threshold": THRESHOLD, **(controller_keys or {})}
    store = {"storage_backend": "dynamic", "model_name": "tiny", "storage_backend_extra_config": extra}
    h = make_hicache(page_size=2, device_pages=32, host_pages=host_pages, storage=store, prefetch_policy=policy)
    h.storage_prefetch_retries = StoragePrefetchRetries(PrefetchRetrySettings(interval, max_attempts))
    return h


def store_in_l3(tmp_path, tokens):
    """Another cache on the same storage writes ``tokens``' pages (a backup landing)."""
    other = cache(tmp_path)
    r = start_request(other, tokens)
    other.cache_finished_req(r)
    other.cache_controller.synchronize()
    other.check_hicache_events()
    other.storage.synchronize()
    other.check_hicache_events()
    other.reset()
    other.cache_controller.close()


def answered(h, rid):
    wait_for(h, lambda: h.ongoing_prefetch[rid].state is not PrefetchState.QUERYING, f"{rid}'s check")


def test_a_miss_is_armed_and_the_reissued_check_finds_pages_stored_meanwhile(tmp_path):
    h = cache(tmp_path, interval=2)
    assert h.prefetch_from_storage("b", h.root_node, T) == 16
    answered(h, "b")
    assert h.storage_prefetch_retries.is_armed("b")  # nothing found: the pages may still land
    store_in_l3(tmp_path, T + [1])
    queue = ["h", "b"]
    assert h.pop_due_prefetch_retries(queue) == [] and h.pop_due_prefetch_retries(queue) == []
    assert h.pop_due_prefetch_retries(queue) == ["b"]
    assert "b" not in h.ongoing_prefetch  # the missed prefetch ended: a new one can start
    assert h.prefetch_from_storage("b", h.root_node, T) == 16
    wait_for(h, lambda: h.check_prefetch_progress("b"), "the re-issued prefetch")
    assert h.match_prefix(MatchPrefixParams(key=RadixKey(T))).host_hit_length == 16
    assert not h.storage_prefetch_retries.is_armed("b")
    h.check_integrity()
    h.cache_controller.close()


def test_too_little_found_and_no_host_room_are_armed_a_hit_is_not(tmp_path):
    store_in_l3(tmp_path, T + [1])
    h = cache(tmp_path, host_pages=4)  # 8 host slots: the 16 tokens found do not fit
    h.prefetch_from_storage("full", h.root_node, T)
    h.prefetch_from_storage("short", h.root_node, T[:2] + [7, 7, 7, 7])  # 1 page found < 4 tokens
    h.prefetch_from_storage("hit", h.root_node, T[:4])
    for rid in ("full", "short", "hit"):
        answered(h, rid)
    r = h.storage_prefetch_retries
    assert r.is_armed("full") and r.is_armed("short") and not r.is_armed("hit")
    assert h.prefetch_from_storage("tiny", h.root_node, T[:2]) == 0 and not r.is_armed("tiny")  # never asked
    stats = h.cache_controller.get_stats()["l3"]
    assert stats["prefetch_host_full"] == 1
    h.release_aborted_request("full")  # an abort forgets the retry
    assert not r.is_armed("full")
    for rid in ("short", "hit"):
        wait_for(h, lambda: h.check_prefetch_progress(rid), rid)
    h.check_integrity()
    h.cache_controller.close()


def test_best_effort_before_the_answer_is_armed_a_time_budget_stop_is_not(tmp_path):
    keys = {"prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0.0}
    h = cache(tmp_path / "b", policy="best_effort", hang_on=["exists"])
    t = cache(tmp_path / "t", policy="timeout", hang_on=["exists"], controller_keys=keys)
    try:
        h.prefetch_from_storage("b", h.root_node, T)
        assert h.check_prefetch_progress("b")  # best_effort: stops at once, the check unanswered
        assert h.storage_prefetch_retries.is_armed("b")
        t.prefetch_from_storage("t", t.root_node, T)
        wait_for(t, lambda: t.check_prefetch_progress("t"), "the time budget")
        assert t.cache_controller.get_stats()["l3"]["prefetch_timeouts"] == 1
        assert not t.storage_prefetch_retries.is_armed("t")
    finally:
        for c in (h, t):
            c.cache_controller.storage_backend.release_hangs()
    for c in (h, t):
        c.storage.synchronize()
        c.check_hicache_events()
        c.check_integrity()
        c.cache_controller.close()


# ---- two TP ranks ----------------------------------------------------------------------------
def _tp_worker(rank: int, port: int, tmp: str, out) -> None:
    import torch.distributed as dist

    res = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        # rank 1's existence checks fail (a miss there); rank 0's storage has every page
        extra = {**scripted_extra(f"{tmp}/l3", raise_on=["exists"], fault_rank=1), "prefetch_threshold": THRESHOLD}
        store = {"storage_backend": "dynamic", "model_name": "tiny", "storage_backend_extra_config": extra}
        h = make_hicache(page_size=2, device_pages=32, host_pages=32, storage=store, prefetch_policy="wait_complete",
                         tp_rank=rank, tp_size=2, tp_cache_group=group)
        h.storage_prefetch_retries = StoragePrefetchRetries(PrefetchRetrySettings(1, 8))
        r = start_request(h, T + [1])
        h.cache_finished_req(r)
        h.cache_controller.synchronize()
        for _ in range(2):
            h.storage.synchronize()
            h.check_hicache_events()
        h.reset()
        h.prefetch_from_storage("b", h.root_node, T)
        op = h.ongoing_prefetch["b"]
        while op.state is PrefetchState.QUERYING:  # agreed: both ranks leave the loop together
            h.check_hicache_events()
        res["local_hit_pages"] = op.local_hit_pages
        res["armed"] = h.storage_prefetch_retries.is_armed("b")
        res["passes"] = [h.pop_due_prefetch_retries(["h", "b"]) for _ in range(2)]
        h.cache_controller.close()
    except BaseException:
        res["crash"] = traceback.format_exc()
    out.put(res)


def test_tp_ranks_arm_on_the_agreed_miss(tmp_path):
    results = run_ranks(_tp_worker, str(tmp_path), timeout_s=90)
    assert sorted(results) == [0, 1], f"ranks reported {sorted(results)}"
    for res in results.values():
        assert "crash" not in res, res["crash"]
    assert results[0]["local_hit_pages"] == 8 and results[1]["local_hit_pages"] == 0
    for res in results.values():  # rank 0 found every page, yet both armed and re-issue together
        assert res["armed"] and res["passes"] == [[], ["b"]]
