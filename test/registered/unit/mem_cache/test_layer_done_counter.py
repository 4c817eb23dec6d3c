"""Layer-wise load-back: with host copies of layers >= 1 held at a gate, a reader of layer 0
(through the device pool, as attention reads it) returns while the other layers are still
waiting; a failed copy makes the waiter raise instead of hang; the event sets rotate."""

import threading

import pytest
from tree_fixtures import expected_kv, make_hicache, start_request

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.layer_done_counter import NUM_EVENT_SETS, LayerDoneCounter
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.controller.transfer_lane import HiCacheTransferError, ThreadLane
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

LAYERS = 4
GATE_DEADLINE_S = 60  # a gate never opened fails the copy instead of hanging the test


class GatedHost(MHATokenToKVPoolHost):
    """A real host pool whose loads of layers >= 1 wait until the test opens ``gate``; it records
    the order in which layers were copied."""

    gate = threading.Event()
    loaded: list[int] = []

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend=None):
        if layer_id > 0 and not self.gate.wait(GATE_DEADLINE_S):
            raise TimeoutError("the test never opened the gate")
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)
        self.loaded.append(layer_id)


class FailingHost(MHATokenToKVPoolHost):
    """A real host pool whose load of layer 1 fails."""

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend=None):
        if layer_id == 1:
            raise OSError("injected copy failure")
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)


def evicted_prefix(host_cls, tokens):
    h = make_hicache(page_size=2, device_pages=8, host_pages=8, host_cls=host_cls, layer_num=LAYERS)
    r = start_request(h, tokens)
    h.cache_finished_req(r)
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.evict(EvictParams(num_tokens=100)).num_tokens_evicted == len(tokens)
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    pool.clear()
    m = h.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    got = h.init_load_back(m.last_host_node, m.host_hit_length)
    return h, pool, got


def test_reader_of_layer_0_does_not_wait_for_the_last_layer():
    tokens = [1, 2, 3, 4, 5, 6]
    GatedHost.gate.clear()
    GatedHost.loaded = []
    h, pool, got = evicted_prefix(GatedHost, tokens)
    counter = h.cache_controller.layer_done_counter
    k, _ = expected_kv(tokens, layer_num=LAYERS)
    try:
        producer = h.ready_to_load_host_cache()
        counter.set_consumer(producer)
        layer0 = pool.get_key_buffer(0)[got]  # waits for layer 0 only: the others are gated
        events = counter.events[producer].load_events
        assert GatedHost.loaded == [0] and not any(e.query() for e in events[1:])
        assert (layer0 == k[0]).all()
        assert (pool.buffers["k"][1:, got] == 0).all()  # the gated layers have not arrived
        assert h.ready_to_load_host_cache() == producer  # nothing new: still name the running load
    finally:
        GatedHost.gate.set()
    pool.get_key_buffer(LAYERS - 1)  # now wait for the rest
    assert GatedHost.loaded == list(range(LAYERS))
    assert events[LAYERS - 1].query() and (pool.buffers["k"][:, got] == k).all()
    assert h.ready_to_load_host_cache() == -1  # nothing in flight
    counter.set_consumer(-1)
    h.check_hicache_events()
    h.check_integrity()
    h.cache_controller.close()


def test_failed_layer_copy_raises_in_the_waiter_and_on_check():
    h, pool, got = evicted_prefix(FailingHost, [1, 2, 3, 4])
    counter = h.cache_controller.layer_done_counter
    counter.set_consumer(h.ready_to_load_host_cache())
    pool.get_key_buffer(0)
    with pytest.raises(HiCacheTransferError, match="injected copy failure"):
        pool.get_key_buffer(1)
    with pytest.raises(HiCacheTransferError, match="failed on at least one TP rank"):
        h.check_hicache_events()
    counter.set_consumer(-1)
    h.cache_controller.close()


def test_event_sets_rotate_and_idle_waits_return():
    lane = ThreadLane("test-lane")
    counter = LayerDoneCounter(3, lane)
    counter.wait_until(2)  # no consumer: returns at once
    counter.set_consumer(1)
    counter.wait_until(2)  # a set never used is complete
    order = []
    for _ in range(NUM_EVENT_SETS + 1):
        order.append(counter.update_producer())
        for layer in range(3):  # what the load job does
            counter.events[order[-1]].complete(layer)
    assert order == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="consumer index"):
        counter.set_consumer(NUM_EVENT_SETS)
    with pytest.raises(ValueError, match="outside"):
        counter.wait_until(3)
    with pytest.raises(ValueError, match="num_layers"):
        LayerDoneCounter(0, lane)
    lane.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
