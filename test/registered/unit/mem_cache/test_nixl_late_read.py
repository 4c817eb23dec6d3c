"""A zero-copy NIXL POSIX read that times out: the prefetch misses at once, but NIXL cannot cancel
the transfer, which may still write the host slots it targets. Those slots stay held (counted by
the integrity check, never handed to another page) until NIXL reports the transfer ended; then
they are freed and the same pages hit again.

The transfer is held "in progress" by gating the real agent's ``check_xfer_state`` (the POSIX
plugin moves the bytes inside those polls), so the timeout needs no timing window: it happens
while the gate is shut, and the late transfer lands when the test opens it."""

import threading

import torch
from tree_fixtures import assert_kv, make_hicache, start_request, wait_for

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.storage_ops import PrefetchState
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

T = list(range(100, 108))  # four pages of two tokens
U = list(range(200, 208))


class GatedAgent:
    """The real NIXL agent, except that while the gate is shut every transfer reports "PROC"."""

    def __init__(self, agent):
        self._agent = agent
        self.open = threading.Event()
        self.open.set()
        self.held_polls = 0

    def check_xfer_state(self, handle):
        if not self.open.is_set():
            self.held_polls += 1
            return "PROC"
        return self._agent.check_xfer_state(handle)

    def __getattr__(self, name):
        return getattr(self._agent, name)


def cache(tmp_path):
    extra = {"storage_dir": str(tmp_path / "nixl"), "prefetch_threshold": 2, "transfer_timeout_s": 0.05}
    store = {"storage_backend": "nixl", "model_name": "tiny", "storage_backend_extra_config": extra}
    return make_hicache(page_size=2, device_pages=16, host_pages=8, layout="page_first_direct", storage=store,
                        prefetch_policy="wait_complete")


def serve(h, tokens):
    r = start_request(h, tokens)
    h.cache_finished_req(r)
    h.cache_controller.synchronize()
    h.check_hicache_events()
    h.storage.synchronize()
    h.check_hicache_events()
    return r


def prefetch(h, rid):
    """Prefetch T; returns (the op, the host slots it reserved) once it ended."""
    assert h.prefetch_from_storage(rid, h.root_node, T) == len(T)
    op = h.ongoing_prefetch[rid]
    wait_for(h, lambda: op.state is not PrefetchState.QUERYING, "the existence check")
    slots = op.host_indices.clone()
    wait_for(h, lambda: h.check_prefetch_progress(rid), "the prefetch")
    return op, slots


def test_a_timed_out_zero_copy_read_keeps_its_slots_until_nixl_ends_it(tmp_path):
    h = cache(tmp_path)
    backend, host = h.cache_controller.storage_backend, h.cache_controller.mem_pool_host
    assert backend.is_zero_copy, "the read must target the host pool itself"
    serve(h, T)
    h.reset()  # T is in L3 only
    gated = backend.io.agent = GatedAgent(backend.io.agent)
    gated.open.clear()

    op, slots = prefetch(h, "r")
    assert op.completed_pages == 0 and op.failed and gated.held_polls > 0  # it timed out: a miss
    h.storage.reap()
    assert not host.allocator.is_free(slots).any(), "slots freed while the transfer may still write them"
    stats = h.cache_controller.get_stats()["l3"]
    assert stats["prefetch_reads_unsettled"] == 1 and stats["timeouts"] >= 1
    assert not backend.host_writes_settled()
    assert any(torch.equal(held, slots) for held in h.cache_controller.held_host_indices())
    h.check_integrity()

    # serving goes on; no new host copy lands on the held slots (the rest of the host pool is U's size)
    serve(h, U)
    u_host = h.match_prefix(MatchPrefixParams(key=RadixKey(U))).last_device_node.host_value
    assert not torch.isin(u_host, slots).any()
    h.check_integrity()

    gated.open.set()  # NIXL finishes the transfer: the late bytes land in the held slots, then they are free
    wait_for(h, backend.host_writes_settled, "the late transfer to end")
    h.storage.reap()
    assert host.allocator.is_free(slots).all() and h.cache_controller.held_host_indices() == []

    # U (host only now) loads back intact, and T hits L3 again
    assert h.evict(EvictParams(num_tokens=len(U))).num_tokens_evicted == len(U)
    r = start_request(h, U)
    assert r.loaded == len(U)
    assert_kv(h.token_to_kv_pool_allocator.get_kvcache(), r.kv_indices, U)
    h.cache_finished_req(r)
    h.reset()
    op, _ = prefetch(h, "r3")
    assert op.completed_pages == len(T) // 2
    r = start_request(h, T)
    assert r.loaded == len(T)
    assert_kv(h.token_to_kv_pool_allocator.get_kvcache(), r.kv_indices, T)
    h.cache_finished_req(r)
    h.reset()
    assert host.available_size() == host.size
    h.cache_controller.close()
