"""L3 end to end at the cache level with 2 TP ranks (two processes over gloo).

Each scenario fills L3 through write-through backups, flushes L1 and L2, then serves the same
prompts again: match -> prefetch_from_storage -> check_prefetch_progress -> load back, and
checks every slot's bytes on every rank (MHA ranks hold different bytes; MLA ranks the same).
With storage failing on purpose (a backend that raises on one rank or on all, corrupted page
files, one slow rank under the timeout policy) requests still complete, as misses, without a
hang, and the counters show the failures; under wait_complete both ranks wait for the slow
one. MLA: only rank 0 writes. After each scenario a flush must return every device and host
slot (prefetch reservations included).
"""

import hashlib
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
from storage_test_backends import scripted_extra
from tree_fixtures import make_hicache, params_for, pattern_matches, start_request, write_pattern

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_ranks

register_cpu_ci(est_time=12, suite="per-commit-cpu")

PAGE = 2
PROMPTS = [list(range(10, 27)), list(range(10, 20)) + [5, 6, 7, 8, 9, 1, 2], [40, 41] * 7 + [3]]
THRESHOLD = 4
HANG_MAX_S = 60  # rank 1's reads in the timeout scenario are held until released (or this)
WAIT_GET_S = 0.4
GROUP_TIMEOUT_S = 30
PREFETCH_DEADLINE_S = 60
JOIN_TIMEOUT_S = 150


def storage(backend: str, extra: dict, policy_keys=None) -> dict:
    return {"storage_backend": backend, "model_name": "tiny",
            "storage_backend_extra_config": {**extra, "prefetch_threshold": THRESHOLD, **(policy_keys or {})}}


def mha_cache(rank, group, store, policy="wait_complete"):
    return make_hicache(page_size=PAGE, device_pages=16, host_pages=48, storage=store, prefetch_policy=policy,
                        tp_rank=rank, tp_size=2, tp_cache_group=group)


def mla_cache(rank, group, store):
    pool = MLATokenToKVPool(32, PAGE, torch.bfloat16, 6, 2, 2)
    params = params_for(pool, tp_rank=rank, tp_size=2, tp_cache_group=group)
    host = MLATokenToKVPoolHost(pool, size=48, layout="page_first_direct", io_backend="direct")
    controller = HiCacheController.from_params(params, host, write_policy="write_through", **store)
    return HiRadixCache(params, controller, 0, "wait_complete")


def settle(h):
    """Every host write acknowledged and every L3 backup finished and acknowledged (a fixed
    number of collectives on every rank)."""
    h.cache_controller.synchronize()
    h.storage.synchronize()
    h.check_hicache_events()
    h.storage.synchronize()
    h.check_hicache_events()


def serve(h, tokens, salt, rid) -> dict:
    """What the scheduler does for one request, L3 prefetch included; checks the bytes."""
    m = h.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    matched = m.device_indices.numel() + m.host_hit_length
    h.prefetch_from_storage(rid, m.last_host_node, tokens[matched:])
    deadline = time.monotonic() + PREFETCH_DEADLINE_S
    while not h.check_prefetch_progress(rid):
        assert time.monotonic() < deadline, f"prefetch {rid!r} did not end within {PREFETCH_DEADLINE_S} s"
        h.check_hicache_events()
        time.sleep(0.002)
    from_l3 = h.pop_prefetch_loaded_tokens(rid)
    r = start_request(h, tokens, writer=lambda pool, kv, toks, start: write_pattern(pool, kv, toks, salt, start))
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    ok = pattern_matches(pool, r.kv_indices, tokens, salt)
    digest = hashlib.sha256(pool.buffers[next(iter(pool.buffers))][:, r.kv_indices].contiguous()
                            .view(torch.uint8).numpy().tobytes()).hexdigest()
    h.cache_finished_req(r)
    return {"from_l3": from_l3, "loaded": r.loaded, "bytes_ok": ok, "digest": digest}


def fill_flush_serve(h, salt) -> dict:
    """Serve PROMPTS (filling L3), flush L1+L2, serve them again; the leak check at the end."""
    first = [serve(h, p, salt, f"fill-{i}") for i, p in enumerate(PROMPTS)]
    settle(h)
    h.reset()
    second = [serve(h, p, salt, f"again-{i}") for i, p in enumerate(PROMPTS)]
    settle(h)
    h.check_integrity()
    h.reset()
    host = h.cache_controller.mem_pool_host
    alloc = h.token_to_kv_pool_allocator
    return {"first": first, "second": second, "stats": h.cache_controller.get_stats()["l3"],
            "leak_free": alloc.available_size() == alloc.size and host.available_size() == host.size,
            "calls": h.agreement.num_calls}


def page_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".bin"))


# ---- scenarios: (rank, group, tmp) -> record ---------------------------------------------
def sc_file(rank, group, tmp):
    h = mha_cache(rank, group, storage("file", {"storage_dir": f"{tmp}/file"}))
    try:
        return fill_flush_serve(h, salt=1000.0 * rank)
    finally:
        h.cache_controller.close()


def sc_nixl(rank, group, tmp):
    h = mha_cache(rank, group, storage("nixl", {"storage_dir": f"{tmp}/nixl"}))
    try:
        return fill_flush_serve(h, salt=1000.0 * rank)
    finally:
        h.cache_controller.close()


def faulty(rank, group, tmp, script, prepare=None, policy="wait_complete", policy_keys=None):
    """Fill L3 with a healthy file backend, flush, then serve through a faulty one."""
    healthy = mha_cache(rank, group, storage("file", {"storage_dir": f"{tmp}/{script['tag']}"}))
    for i, p in enumerate(PROMPTS):
        serve(healthy, p, 1000.0 * rank, f"fill-{i}")
    settle(healthy)
    healthy.reset()
    healthy.cache_controller.close()
    if prepare is not None:
        if rank == 0:
            prepare(f"{tmp}/{script['tag']}")
        torch.distributed.barrier(group)
    extra = scripted_extra(f"{tmp}/{script['tag']}", **{k: v for k, v in script.items() if k != "tag"})
    h = mha_cache(rank, group, storage("dynamic", extra, policy_keys), policy)
    try:
        served = [serve(h, p, 1000.0 * rank, f"f-{i}") for i, p in enumerate(PROMPTS)]
        backend = h.cache_controller.storage_backend
        held = backend.hanging_now()  # reads still blocked (hang_on) when serving was done
        backend.release_hangs()
        settle(h)
        h.check_integrity()
        h.reset()
        alloc, host = h.token_to_kv_pool_allocator, h.cache_controller.mem_pool_host
        return {"second": served, "held_reads": held, "stats": h.cache_controller.get_stats()["l3"],
                "leak_free": alloc.available_size() == alloc.size and host.available_size() == host.size,
                "calls": h.agreement.num_calls}
    finally:
        h.cache_controller.close()


def corrupt_all(root):
    for path in page_files(root):
        with open(path, "r+b") as f:
            f.seek(8)
            byte = f.read(1)
            f.seek(8)
            f.write(bytes([byte[0] ^ 0xFF]))


def sc_get_raises_on_rank1(rank, group, tmp):
    return faulty(rank, group, tmp, {"tag": "get1", "raise_on": ["get"], "fault_rank": 1})


def sc_exists_raises_everywhere(rank, group, tmp):
    return faulty(rank, group, tmp, {"tag": "exists", "raise_on": ["exists"]})


def sc_malformed_get(rank, group, tmp):
    return faulty(rank, group, tmp, {"tag": "malformed", "malformed_on": ["get"]})


def sc_corrupted_files(rank, group, tmp):
    return faulty(rank, group, tmp, {"tag": "corrupt"}, prepare=corrupt_all)


def sc_slow_rank_timeout(rank, group, tmp):
    keys = {"prefetch_timeout_base": 0.3, "prefetch_timeout_per_ki_token": 0.0}
    return faulty(rank, group, tmp, {"tag": "slow", "hang_on": ["get"], "hang_max_s": HANG_MAX_S, "fault_rank": 1},
                  policy="timeout", policy_keys=keys)


def sc_slow_rank_wait_complete(rank, group, tmp):
    return faulty(rank, group, tmp, {"tag": "slow_wait", "delay_get_s": WAIT_GET_S, "fault_rank": 1})


def sc_mla(rank, group, tmp):
    h = mla_cache(rank, group, storage("file", {"storage_dir": f"{tmp}/mla"}))
    try:
        out = fill_flush_serve(h, salt=0.0)
        out["files"] = len(page_files(f"{tmp}/mla"))
        return out
    finally:
        h.cache_controller.close()


SCENARIOS = {name[3:]: fn for name, fn in globals().items() if name.startswith("sc_")}


def _worker(rank: int, port: int, tmp: str, out) -> None:
    import torch.distributed as dist

    results = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        for name, fn in SCENARIOS.items():
            try:
                results[name] = fn(rank, group, tmp)
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                results[name] = {"crash": traceback.format_exc()}
    except BaseException:
        results["crash"] = traceback.format_exc()
    out.put(results)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run every scenario on two ranks once; {rank: {scenario: record}}."""
    results = run_ranks(_worker, str(tmp_path_factory.mktemp("l3tp")), timeout_s=JOIN_TIMEOUT_S)
    assert sorted(results) == [0, 1], f"ranks reported {sorted(results)} (hang or crash)"
    for res in results.values():
        assert "crash" not in res, res["crash"]
    return results


def record(ranks, name):
    recs = [ranks[r][name] for r in (0, 1)]
    for rec in recs:
        assert "crash" not in rec, rec["crash"]
    assert recs[0]["calls"] == recs[1]["calls"], "ranks issued different numbers of collectives"
    assert recs[0]["leak_free"] and recs[1]["leak_free"], "slots leaked after the final flush"
    for a, b in zip(recs[0]["second"], recs[1]["second"]):
        assert (a["from_l3"], a["loaded"]) == (b["from_l3"], b["loaded"])
    return recs


@pytest.mark.parametrize("name", ["file", "nixl"])
def test_fill_flush_prefetch_load_back_bytes_identical(ranks, name):
    for rec in record(ranks, name):
        assert [s["from_l3"] for s in rec["first"]] == [0, 0, 0]
        # after the flush every whole page comes back from L3; prompt 2 finds its first 10 tokens
        # on device (prompt 1 just loaded them) and fetches the other 6
        assert [s["from_l3"] for s in rec["second"]] == [16, 6, 14]
        assert [s["loaded"] for s in rec["second"]] == [16, 6, 14]
        assert all(s["bytes_ok"] for s in rec["first"] + rec["second"])
        stats = rec["stats"]
        assert stats["prefetch_pages_loaded"] == 8 + 3 + 7 and stats["failures"] == 0
        assert stats["backup_pages_submitted"] == 8 + 3 + 7  # shared pages are stored once
        assert stats["bytes_read"] > 0 and stats["pages_hit"] == 8 + 3 + 7


@pytest.mark.parametrize("name,failing_ranks", [("get_raises_on_rank1", [1]), ("exists_raises_everywhere", [0, 1]),
                                                ("malformed_get", [0, 1])])
def test_failing_backend_gives_misses_not_hangs(ranks, name, failing_ranks):
    recs = record(ranks, name)
    for rank, rec in enumerate(recs):
        assert [s["from_l3"] for s in rec["second"]] == [0, 0, 0]  # misses on every rank
        assert all(s["bytes_ok"] for s in rec["second"])  # recomputed, correct
        assert (rec["stats"]["failures"] > 0) == (rank in failing_ranks), rec["stats"]


def test_corrupted_pages_are_detected_counted_and_never_loaded(ranks):
    for rec in record(ranks, "corrupted_files"):
        assert [s["from_l3"] for s in rec["second"]] == [0, 0, 0]
        assert all(s["bytes_ok"] for s in rec["second"])
        assert rec["stats"]["corruptions"] > 0


def test_one_slow_rank_stops_both_at_the_timeout(ranks):
    recs = record(ranks, "slow_rank_timeout")
    for rec in recs:
        assert [s["from_l3"] for s in rec["second"]] == [0, 0, 0]
        assert rec["stats"]["prefetch_timeouts"] == 3
        assert all(s["bytes_ok"] for s in rec["second"])
    assert recs[0]["held_reads"] == 0 and recs[1]["held_reads"] >= 1  # never waited for rank 1's held reads
    assert recs[0]["stats"]["pages_hit"] == 8 + 3 + 7  # rank 0 had every page: the MIN decided


def test_wait_complete_waits_for_the_slow_rank(ranks):
    for rec in record(ranks, "slow_rank_wait_complete"):
        assert [s["from_l3"] for s in rec["second"]] == [16, 6, 14]
        assert all(s["bytes_ok"] for s in rec["second"])
        assert rec["stats"]["prefetch_timeouts"] == 0  # the hits above needed rank 1's slow reads


def test_mla_rank0_writes_rank1_skips_and_both_load_the_same_bytes(ranks):
    r0, r1 = record(ranks, "mla")
    assert r0["stats"]["pages_written"] == 8 + 3 + 7 and r0["stats"]["pages_skipped"] == 0
    # rank 1 writes nothing: pages rank 0 already stored are not even offered, the rest is skipped
    # by the backend (the one MLA mechanism)
    assert r1["stats"]["pages_written"] == 0
    assert r1["stats"]["pages_skipped"] + r1["stats"]["backup_pages_existing"] == 8 + 3 + 7
    assert r0["files"] == 8 + 3 + 7  # one object per page, written once
    assert [s["from_l3"] for s in r1["second"]] == [16, 6, 14]
    assert [s["digest"] for s in r0["second"]] == [s["digest"] for s in r1["second"]]
    assert all(s["bytes_ok"] for s in r0["second"] + r1["second"])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
