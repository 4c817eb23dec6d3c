"""The same controller and tree code on a GPU: copies run on CUDA streams, events are CUDA
events, and attention's wait for layer i is a stream wait. Byte round trips through both io
backends, the layer-wise overlap with a deliberately slow (spinning) copy, and a tree
storyline device -> host -> device."""

import pytest

from sglang.test.cuda import require_cuda

require_cuda()  # collect-safe on CPU: the module skips where CUDA is absent

import torch  # noqa: E402
from tree_fixtures import assert_kv, expected_kv, make_hicache, start_request  # noqa: E402

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.controller.transfer_lane import StreamLane  # noqa: E402
from sglang.srt.mem_cache.radix.tree_node import RadixKey  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

register_cuda_ci(est_time=40, suite="per-commit-1-gpu")

LAYERS = 4


class SpinningHost(MHATokenToKVPoolHost):
    """A real host pool whose per-layer load first spins the copy stream for a while."""

    def load_to_device_per_layer(self, *args, **kwargs):
        torch.cuda._sleep(int(2e8))
        super().load_to_device_per_layer(*args, **kwargs)


def settle(h):
    h.cache_controller.synchronize()
    h.check_hicache_events()


@pytest.mark.parametrize("layout, io_backend", [("layer_first", "direct"), ("page_first_direct", "direct"),
                                                ("layer_first", "kernel"), ("page_first", "kernel")])
def test_tree_round_trip_on_cuda(layout, io_backend):
    h = make_hicache(page_size=2, device_pages=4, host_pages=8, layout=layout, io_backend=io_backend, device="cuda")
    assert isinstance(h.cache_controller.write_lane, StreamLane)
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    tokens = [1, 2, 3, 4, 5, 6]
    h.cache_finished_req(start_request(h, tokens))
    settle(h)
    assert h.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6
    pool.clear()
    r = start_request(h, tokens + [7, 8])
    assert r.loaded == 6
    assert_kv(pool, r.kv_indices, tokens + [7, 8])
    h.cache_finished_req(r)
    settle(h)
    h.check_integrity()
    h.reset()
    assert h.token_to_kv_pool_allocator.available_size() == 8


def test_layer_zero_is_usable_before_the_last_layer_arrives_on_cuda():
    tokens = [1, 2, 3, 4]
    h = make_hicache(page_size=2, device_pages=8, host_pages=8, host_cls=SpinningHost, layer_num=LAYERS,
                     device="cuda")
    h.cache_finished_req(start_request(h, tokens))
    settle(h)
    h.evict(EvictParams(num_tokens=100))
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    pool.clear()
    m = h.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    got = h.init_load_back(m.last_host_node, m.host_hit_length)
    producer = h.ready_to_load_host_cache()
    counter = h.cache_controller.layer_done_counter
    counter.set_consumer(producer)
    layer0 = pool.get_key_buffer(0)[got.cuda()]  # the compute stream waits for layer 0 only
    torch.cuda.current_stream().synchronize()
    assert not counter.events[producer].load_events[LAYERS - 1].query(), "layer 0 waited for the last layer"
    assert torch.equal(layer0.cpu(), expected_kv(tokens, layer_num=LAYERS)[0][0])
    pool.get_key_buffer(LAYERS - 1)
    torch.cuda.current_stream().synchronize()
    counter.set_consumer(-1)
    settle(h)
    assert_kv(pool, got, tokens)
    h.check_integrity()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
