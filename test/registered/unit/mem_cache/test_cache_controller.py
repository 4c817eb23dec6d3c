"""HiCacheController on its own: device -> host -> device through both io backends (the kernel
one under Triton's interpreter), ack ordering while a copy is still running, failures surfacing
as values, operation merging, lanes, and bad construction."""

import threading

import pytest
import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.managers.cache_controller import CacheOperation, HiCacheController, L2Transfer, Tier
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.controller.transfer_lane import HiCacheTransferError, ThreadLane
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

KV = PoolName.KV


class GatedHost(MHATokenToKVPoolHost):
    """A real host pool whose backups wait for ``gate`` and fail when ``fail`` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def backup_from_device_all_layer(self, *args, **kwargs):
        assert self.gate.wait(30)
        if self.fail:
            raise OSError("injected backup failure")
        super().backup_from_device_all_layer(*args, **kwargs)


def make_controller(layout="layer_first", io_backend="direct", host_cls=MHATokenToKVPoolHost, page_size=2):
    pool = MHATokenToKVPool(8 * page_size, page_size, torch.bfloat16, 2, 4, 3)
    alloc = PagedTokenToKVPoolAllocator(pool.size, page_size, kvcache=pool)
    host = host_cls(pool, size=8 * page_size, layout=layout, io_backend=io_backend)
    return HiCacheController(alloc, host, page_size), pool


@pytest.mark.parametrize("layout, io_backend", [("layer_first", "direct"), ("page_first_direct", "direct"),
                                                ("page_first", "kernel"), ("page_head", "kernel")])
def test_write_then_layerwise_load_round_trips_bytes(layout, io_backend):
    ctl, pool = make_controller(layout, io_backend)
    gen = torch.Generator().manual_seed(1)
    dev = ctl.alloc(Tier.DEVICE, KV, 4)
    for buf in pool.buffers.values():
        buf[:, dev] = torch.randn(buf[:, dev].shape, generator=gen).to(buf.dtype)
    before = {n: b[:, dev].clone() for n, b in pool.buffers.items()}
    host = ctl.alloc(Tier.HOST, KV, 4)
    ctl.write([L2Transfer(KV, host, dev)], node_ids=[7])
    ctl.write_lane.synchronize()
    assert ctl.local_progress() == [1, 0, 1]
    assert [a.node_ids for a in ctl.pop_write_acks(1)] == [[7]]
    pool.clear()
    target = ctl.alloc(Tier.DEVICE, KV, 4)
    ctl.load([L2Transfer(KV, host[:2], target[:2])], node_ids=[8])
    ctl.load([L2Transfer(KV, host[2:], target[2:])], node_ids=[9])
    producer = ctl.start_loading()
    assert producer == 0 and len(ctl.ack_load_queue) == 1  # one merged batch
    ctl.layer_done_counter.set_consumer(producer)
    for name, buf in pool.buffers.items():
        for layer in range(pool.layer_num):
            got = pool.layer_view(name, layer)[target]  # waits for this layer only
            assert torch.equal(got.view(torch.int16), before[name][layer].view(torch.int16))
    ctl.load_lane.synchronize()
    assert ctl.start_loading() == -1  # nothing queued, nothing in flight
    assert ctl.local_progress() == [0, 1, 1]
    assert ctl.pop_load_acks(1)[0].node_ids == [8, 9]
    ctl.close()


def test_acks_count_only_leading_finished_operations_and_failures_are_values():
    ctl, pool = make_controller(host_cls=GatedHost)
    host_pool = ctl.mem_pool_host
    dev, host = ctl.alloc(Tier.DEVICE, KV, 4), ctl.alloc(Tier.HOST, KV, 4)
    host_pool.gate.clear()
    ctl.write([L2Transfer(KV, host[:2], dev[:2])], [1])
    ctl.write([L2Transfer(KV, host[2:], dev[2:])], [2])
    assert ctl.local_progress() == [0, 0, 1]  # the first copy is still running
    host_pool.fail = True
    host_pool.gate.set()
    ctl.write_lane.synchronize()
    assert ctl.local_progress() == [2, 0, 0]
    assert isinstance(ctl.write_lane.error, OSError)
    with pytest.raises(HiCacheTransferError, match="injected backup failure"):
        ctl.ack_write_queue[0].finish_event.synchronize()
    ctl.close()


def test_merge_ops_concatenates_per_pool_in_order():
    t = lambda name, h, d: L2Transfer(name, torch.tensor(h), torch.tensor(d))  # noqa: E731
    merged = CacheOperation.merge_ops([
        CacheOperation([t(KV, [0, 1], [4, 5]), t(PoolName.MAMBA, [0], [2])], [1]),
        CacheOperation([t(KV, [6, 7], [8, 9])], [2, 3]),
    ])
    assert merged.node_ids == [1, 2, 3]
    kv, mamba = merged.transfers
    assert kv.name is KV and kv.host_indices.tolist() == [0, 1, 6, 7] and kv.device_indices.tolist() == [4, 5, 8, 9]
    assert mamba.name is PoolName.MAMBA and mamba.host_indices.tolist() == [0]


def test_thread_lane_runs_jobs_in_order_and_refuses_after_close():
    lane = ThreadLane("order")
    seen = []
    events = [lane.new_event() for _ in range(5)]
    for i, ev in enumerate(events):
        lane.submit(lambda i=i, ev=ev: (seen.append(i), ev.record()), [ev])
    lane.synchronize()
    assert seen == [0, 1, 2, 3, 4] and all(ev.query() for ev in events)
    lane.close()
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(lambda: None, [])


def test_bad_construction_and_unknown_pools():
    ctl, pool = make_controller()
    with pytest.raises(ValueError, match="token_to_kv_pool_allocator is required"):
        HiCacheController.from_params(CacheInitParams(page_size=2), ctl.mem_pool_host)
    with pytest.raises(ValueError, match="host pool page_size 2 != page_size 4"):
        HiCacheController(PagedTokenToKVPoolAllocator(16, 4), ctl.mem_pool_host, 4)
    with pytest.raises(ValueError, match="no pool 'mamba'|no pool <PoolName.MAMBA"):
        ctl.available(Tier.HOST, PoolName.MAMBA)
    assert ctl.alloc(Tier.HOST, KV, 18) is None  # a shortage is a value, not an error
    ctl.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
