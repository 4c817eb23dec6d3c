"""Two TP ranks in two processes over gloo, with different host pressure on each.

They must report identical hit lengths and tree states after every step (and issue the same
number of collectives); a transfer failure on one rank raises on both at the same step; a rank
that dies makes the other raise instead of hang. A single-process control shows that without
the agreement the same workload does drive the two host sizes apart.
"""

import os
import time
import traceback
from datetime import timedelta

import pytest
from tree_fixtures import make_hicache, start_request

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.controller.transfer_lane import HiCacheTransferError
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_ranks

register_cpu_ci(est_time=15, suite="per-commit-cpu")

HOST_PAGES = (3, 16)  # rank 0 has far less host memory than rank 1
SEQS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 11, 12], [9, 9, 9, 9, 3, 3],
        [13, 14, 13, 14, 13, 14], [7, 7]]
GROUP_TIMEOUT_S = 10
JOIN_TIMEOUT_S = 120


class FailingBackupHost(MHATokenToKVPoolHost):
    """A real host pool whose third backup fails."""

    calls = 0

    def backup_from_device_all_layer(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls == 3:
            raise OSError("injected backup failure")
        super().backup_from_device_all_layer(*args, **kwargs)


def workload(h, die_at: int | None = None) -> list[tuple]:
    """The same request stream on every rank; one record per step."""
    records = []
    for step, tokens in enumerate(SEQS * 3):
        if step == die_at:
            os._exit(3)
        r = start_request(h, tokens)
        hit = (r.prefix_indices.numel(), r.host_hit_length, r.loaded) if r is not None else None
        if r is not None:
            h.cache_finished_req(r)
        h.check_hicache_events()  # no synchronize: local progress differs, the agreed MIN does not
        if step % 3 == 2:
            h.evict(EvictParams(num_tokens=6))
        records.append((step, hit, tuple(h.tree_signature()), h.agreement.num_calls))
    return records


def _worker(rank: int, port: int, scenario: str, out) -> None:
    import torch.distributed as dist

    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        kwargs = dict(page_size=2, device_pages=8, host_pages=HOST_PAGES[rank], tp_rank=rank, tp_size=2,
                      tp_cache_group=group)
        if scenario == "agree":
            h = make_hicache(**kwargs)
            result["records"] = workload(h)
            h.reset()
            result["device_free"] = h.token_to_kv_pool_allocator.available_size()
            h2 = make_hicache(host_cls=FailingBackupHost if rank == 1 else MHATokenToKVPoolHost, **kwargs)
            try:
                workload(h2)
                result["failure"] = None
            except HiCacheTransferError:
                result["failure"] = h2.agreement.num_calls
        else:  # "die": rank 1 exits abruptly before its step-4 collectives
            h = make_hicache(**kwargs)
            start = time.monotonic()
            try:
                workload(h, die_at=4 if rank == 1 else None)
                result["error"] = None
            except Exception as exc:  # noqa: BLE001 - whatever gloo raises, it must not hang
                result["error"] = type(exc).__name__
            result["elapsed"] = time.monotonic() - start
    except BaseException:
        result["crash"] = traceback.format_exc()
    out.put(result)


def run_pair(scenario: str, expect: int = 2) -> dict[int, dict]:
    return run_ranks(_worker, scenario, timeout_s=JOIN_TIMEOUT_S, expect=expect)


def test_ranks_agree_under_different_host_pressure():
    results = run_pair("agree")
    assert sorted(results) == [0, 1], results
    for res in results.values():
        assert "crash" not in res, res["crash"]
    r0, r1 = results[0]["records"], results[1]["records"]
    assert len(r0) == len(r1) == len(SEQS) * 3
    for a, b in zip(r0, r1):
        assert a == b, f"ranks diverged at step {a[0]}"
    assert any(rec[1] is not None and rec[1][1] > 0 for rec in r0), "no host hit was exercised"
    assert results[0]["device_free"] == results[1]["device_free"] == 16
    # the failed backup on rank 1 raised on both ranks, after the same number of collectives
    assert results[0]["failure"] is not None
    assert results[0]["failure"] == results[1]["failure"]


def test_dead_rank_makes_the_other_raise_not_hang():
    results = run_pair("die", expect=1)
    assert 0 in results and "crash" not in results[0], results
    assert results[0]["error"] is not None
    assert results[0]["elapsed"] < GROUP_TIMEOUT_S + 20


def test_without_agreement_the_workload_drives_host_sizes_apart():
    lone = [workload(make_hicache(page_size=2, device_pages=8, host_pages=n)) for n in HOST_PAGES]
    assert any(a[2] != b[2] for a, b in zip(*lone))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
