"""A bounded flush: ``reset`` waits at most ``flush_timeout_s`` for storage operations, so a hung
backend (the ``dynamic`` ScriptedFileBackend with ``hang_on``) cannot hang ``/flush_cache``.

What is still running is abandoned safely: the cache is empty and keeps serving, the host slots a
storage thread may still read (a backup) or write (a prefetch read) stay held until that thread
returns, the integrity check counts them, and ``reset`` raises ``HiCacheFlushIncomplete``. When
the backend comes back the slots are freed, and what the late backup stored is right."""

import time

import pytest
import torch
from storage_test_backends import scripted_extra
from tree_fixtures import assert_kv, kv_mamba_stack, make_hicache, start_request

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.controller.storage_ops import HiCacheFlushIncomplete, PrefetchState
from sglang.srt.mem_cache.controller.storage_settings import split_extra_config
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

T = list(range(100, 108))  # four pages of two tokens
U = list(range(200, 208))
FLUSH_TIMEOUT_S = 0.3
DEADLINE_S = 20


def cache(tmp_path, **script):
    extra = {**scripted_extra(tmp_path / "l3", **script), "flush_timeout_s": FLUSH_TIMEOUT_S, "prefetch_threshold": 2}
    store = {"storage_backend": "dynamic", "model_name": "tiny", "storage_backend_extra_config": extra}
    return make_hicache(page_size=2, device_pages=16, host_pages=16, storage=store, prefetch_policy="wait_complete")


def serve(h, tokens):
    r = start_request(h, tokens)
    h.cache_finished_req(r)
    h.cache_controller.synchronize()
    h.check_hicache_events()  # the host copy is acknowledged: its L3 backup is queued
    return r


def timed_reset(h):
    """A flush while a backend call hangs: it gives up (on its timeout) with the call still held."""
    with pytest.raises(HiCacheFlushIncomplete) as err:
        h.reset()
    assert h.cache_controller.storage_backend.hanging_now() >= 1, "the flush waited for the hung call"
    return err.value


def wait_for(h, cond, what):
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        h.check_hicache_events()
        time.sleep(0.005)


def is_free(h, slots) -> torch.Tensor:
    return h.cache_controller.mem_pool_host.allocator.is_free(slots)


def test_a_hung_backup_is_abandoned_its_slots_quarantined_until_it_returns(tmp_path):
    h = cache(tmp_path, hang_on=["set"])
    backend, host = h.cache_controller.storage_backend, h.cache_controller.mem_pool_host
    serve(h, T)
    assert backend.wait_hanging(DEADLINE_S)
    quarantined = h.match_prefix(MatchPrefixParams(key=RadixKey(T))).last_device_node.host_value.clone()
    err = timed_reset(h)
    assert err.pending == {"backups": 1, "reads": 0, "queries": 0} and "1 backups" in str(err)
    assert h.match_prefix(MatchPrefixParams(key=RadixKey(T))).device_indices.numel() == 0  # the cache is empty
    assert host.available_size() == host.size - len(T) and not is_free(h, quarantined).any()
    h.check_integrity()  # quarantined slots count as held
    serve(h, U)  # it keeps serving; no new host copy lands on a quarantined slot
    u_host = h.match_prefix(MatchPrefixParams(key=RadixKey(U))).last_device_node.host_value
    assert not torch.isin(u_host, quarantined).any()
    assert h.cache_controller.get_stats()["l3"]["flush_abandoned_backups"] == 1
    backend.release_hangs()
    h.storage.synchronize()
    h.check_hicache_events()
    assert is_free(h, quarantined).all() and h.cache_controller.held_host_indices() == []
    h.reset()  # nothing hangs any more: a complete flush
    assert host.available_size() == host.size
    assert h.prefetch_from_storage("r", h.root_node, T) == len(T)  # what the late backup stored
    wait_for(h, lambda: h.check_prefetch_progress("r"), "the prefetch")
    r = start_request(h, T)
    assert r.loaded == len(T)
    assert_kv(h.token_to_kv_pool_allocator.get_kvcache(), r.kv_indices, T)
    h.cache_finished_req(r)
    h.reset()
    h.cache_controller.close()


def test_a_hung_prefetch_read_keeps_its_slots_until_it_returns(tmp_path):
    h = cache(tmp_path, hang_on=["get"])
    backend, host = h.cache_controller.storage_backend, h.cache_controller.mem_pool_host
    serve(h, T)
    h.reset()  # the backup (set) does not hang: a complete flush
    h.prefetch_from_storage("r", h.root_node, T)
    op = h.ongoing_prefetch["r"]
    wait_for(h, lambda: op.state is PrefetchState.LOADING, "the read to start")
    assert backend.wait_hanging(DEADLINE_S)
    err = timed_reset(h)
    assert err.pending == {"backups": 0, "reads": 1, "queries": 0}
    (held,) = h.cache_controller.held_host_indices()
    assert held.numel() == len(T) and not is_free(h, held).any()
    h.check_integrity()
    r = serve(h, U)  # its host copy must survive the late read
    assert not torch.isin(h.match_prefix(MatchPrefixParams(key=RadixKey(U))).last_device_node.host_value, held).any()
    backend.release_hangs()
    h.storage.synchronize()
    h.check_hicache_events()
    assert is_free(h, held).all() and h.cache_controller.held_host_indices() == []
    # U now lives on host only: load it back and check it
    assert h.evict(EvictParams(num_tokens=len(U))).num_tokens_evicted == len(U)
    r = start_request(h, U)
    assert r.loaded == len(U)
    assert_kv(h.token_to_kv_pool_allocator.get_kvcache(), r.kv_indices, U)
    h.cache_finished_req(r)
    h.reset()
    assert host.available_size() == host.size
    h.cache_controller.close()


def test_a_hung_existence_check_is_reported_and_later_dropped(tmp_path):
    h = cache(tmp_path, hang_on=["exists"])
    backend = h.cache_controller.storage_backend
    h.prefetch_from_storage("r", h.root_node, T)
    assert backend.wait_hanging(DEADLINE_S)
    err = timed_reset(h)
    assert err.pending == {"backups": 0, "reads": 0, "queries": 1}
    assert h.check_prefetch_progress("r")  # the request no longer waits for it
    backend.release_hangs()
    h.storage.synchronize()
    h.check_hicache_events()  # the late answer is for a prefetch that ended: nothing reserved
    assert not h.storage.query_queue and h.cache_controller.held_host_indices() == []
    h.reset()
    h.cache_controller.close()


def test_a_hung_mamba_backup_quarantines_its_state_slot_too(tmp_path):
    extra = {**scripted_extra(tmp_path / "l3", hang_on=["set"]), "flush_timeout_s": FLUSH_TIMEOUT_S}
    stack = kv_mamba_stack(HiCacheConfig(io_backend="direct", storage_backend="dynamic", model_name="tiny",
                                         storage_backend_extra_config=extra))
    tree, controller = stack.tree_cache, stack.cache_controller
    mamba = stack.host_pool_group.get_entry(PoolName.MAMBA)
    slots = stack.params.token_to_kv_pool_allocator.alloc(len(T))
    tree.insert(InsertParams(key=RadixKey(T), value=slots, mamba_value=mamba.device_pool.alloc(1)))
    controller.synchronize()
    tree.check_hicache_events()
    assert controller.storage_backend.wait_hanging(DEADLINE_S)
    err = timed_reset(tree)
    assert err.pending["backups"] == 1
    (state,) = controller.held_host_indices(PoolName.MAMBA)
    assert state.numel() == 1 and mamba.host_pool.available_size() == mamba.host_pool.size - 1
    tree.check_integrity()  # the quarantined state slot counts as held
    controller.storage_backend.release_hangs()
    tree.storage.synchronize()
    tree.check_hicache_events()
    assert controller.held_host_indices(PoolName.MAMBA) == [] and mamba.host_pool.available_size() == mamba.host_pool.size
    assert controller.get_stats()["l3"]["backup_states_submitted"] == 1
    tree.reset()
    controller.close()


def test_flush_timeout_is_validated():
    with pytest.raises(ValueError, match="'flush_timeout_s' must be > 0"):
        split_extra_config({"flush_timeout_s": 0})
    assert split_extra_config({"flush_timeout_s": "2.5"})[0].flush_timeout_s == 2.5
    assert split_extra_config({})[0].flush_timeout_s == 5.0


def test_reset_timeout_argument(tmp_path):
    h = cache(tmp_path)
    with pytest.raises(ValueError, match="timeout_s must be >= 0"):
        h.reset(timeout_s=-1)
    serve(h, T)
    h.reset(timeout_s=10)  # a healthy backend: complete
    assert h.cache_controller.mem_pool_host.available_size() == h.cache_controller.mem_pool_host.size
    h.cache_controller.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
