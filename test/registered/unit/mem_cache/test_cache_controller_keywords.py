"""The controllers with upstream's constructor keywords: the coordinates a caller hands over
(``pp_rank``/``pp_size``/``attn_cp_rank``/``attn_cp_size`` as numbers, or ``pp_group``/``attn_cp_group``
as gloo groups) land in the controller's CacheInitParams and, from there, in the storage config
its L3 backend gets; the other keywords (``load_cache_event``, ``prefetch_threshold``,
``host_memory_mode``, ``transfer_layer_num``) do what upstream's callers rely on; upstream's
``HiCacheAck`` / ``LayerDoneCounter`` / ``CacheInitParams`` shapes."""

import threading
import traceback
from datetime import timedelta

import pytest
import torch

from sglang.srt.managers.cache_controller import (
    HiCacheAck,
    HiCacheController,
    L2Transfer,
    LayerDoneCounter,
    StorageOperation,
    Tier,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams, ParallelCoords
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_mamba_hybrid_stack, build_nsa_hybrid_stack
from sglang.srt.mem_cache.memory_pool import DSAIndexerPool, MambaPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_ranks

register_cpu_ci(est_time=12, suite="per-commit-cpu")

PAGE, LAYERS = 2, 2
COORDS = dict(pp_rank=1, pp_size=2, attn_cp_rank=1, attn_cp_size=3)
COORD_FIELDS = ("tp_rank", "tp_size", *COORDS)
KV = PoolName.KV


def mha_parts(page_size=PAGE, slots=16):
    pool = MHATokenToKVPool(slots, page_size, torch.float32, 1, 2, LAYERS)
    alloc = PagedTokenToKVPoolAllocator(pool.size, page_size, kvcache=pool)
    host = MHATokenToKVPoolHost(pool, size=2 * slots, layout="layer_first", io_backend="direct")
    return alloc, host


def file_storage(tmp_path, **extra):
    return dict(storage_backend="file", model_name="tiny-model",
                storage_backend_extra_config={"storage_dir": str(tmp_path), **extra})


def coords_of(obj) -> dict:
    return {f: getattr(obj, f) for f in COORD_FIELDS}


EXPECTED = dict(tp_rank=0, tp_size=1, **COORDS)


def test_plain_controller_with_upstream_keywords_carries_them_into_params_and_storage_config(tmp_path):
    alloc, host = mha_parts()
    event = threading.Event()
    ctl = HiCacheController(
        token_to_kv_pool_allocator=alloc, mem_pool_host=host, page_size=PAGE, tp_group=None, load_cache_event=event,
        write_policy="write_through", io_backend="", prefetch_threshold=64, enable_storage_metrics=True,
        host_memory_mode="cache", **file_storage(tmp_path), **COORDS,
    )
    try:
        assert coords_of(ctl.params) == EXPECTED
        assert ctl.parallel_coords() == ParallelCoords(**EXPECTED)
        assert ctl.get_attn_cp_rank_and_size() == (1, 3)
        assert ctl.storage_config is ctl.storage_backend.config  # the backend got exactly this config
        assert coords_of(ctl.storage_config) == EXPECTED
        assert ctl.storage.settings.prefetch_threshold == 64 and ctl.storage_config.enable_storage_metrics
        assert ctl.write_policy.value == "write_through" and ctl.io_backend is None  # "": each pool's own
        assert ctl.load_cache_event is event
    finally:
        ctl.close()


def test_hybrid_controller_with_upstream_keywords_carries_them_into_params_and_storage_config(tmp_path):
    mla = MLATokenToKVPool(16, PAGE, torch.bfloat16, 4, 2, LAYERS)
    params = CacheInitParams(page_size=PAGE,
                             token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(16, PAGE, kvcache=mla))
    stack = build_nsa_hybrid_stack(params, DSAIndexerPool(16, PAGE, 4, LAYERS - 1), HiCacheConfig(io_backend="direct"))
    stack.cache_controller.close()
    ctl = HybridCacheController(
        params.token_to_kv_pool_allocator, stack.host_pool_group, PAGE, tp_group=None, load_cache_event=None,
        write_policy="write_through", io_backend="direct", prefetch_threshold=2, transfer_layer_num=LAYERS + 3,
        **file_storage(tmp_path), **COORDS,
    )
    try:
        assert coords_of(ctl.params) == EXPECTED
        assert coords_of(ctl.storage_config) == EXPECTED
        assert ctl.storage_config is ctl.storage_backend.config
        assert ctl.mem_pool_host is stack.host_pool_group and ctl.storage.side_pools == [PoolName.INDEXER]
        assert ctl.layer_num == ctl.layer_done_counter.num_layers == LAYERS + 3
    finally:
        ctl.close()
    with pytest.raises(ValueError, match="below the deepest pool's 2 layers"):
        HybridCacheController(params.token_to_kv_pool_allocator, stack.host_pool_group, PAGE, transfer_layer_num=1)
    with pytest.raises(ValueError, match="name one count; give one"):
        HybridCacheController(params.token_to_kv_pool_allocator, stack.host_pool_group, PAGE,
                              transfer_layer_num=4, transfer_layer_id_max=5)


def test_builders_hand_params_over_through_the_keywords_and_take_upstreams_builder_keywords(tmp_path):
    kv = MHATokenToKVPool(16, PAGE, torch.float32, 1, 2, LAYERS)
    params = CacheInitParams(page_size=PAGE,
                             token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(16, PAGE, kvcache=kv), **COORDS)
    event = threading.Event()
    config = HiCacheConfig(io_backend="direct", **file_storage(tmp_path))
    mamba = MambaPool(4, [(2, 3)], (2, 2), LAYERS + 1, conv_dtype=torch.bfloat16)
    stack = build_mamba_hybrid_stack(params, mamba, config, load_cache_event=event, prefetch_threshold=6)
    ctl = stack.cache_controller
    try:
        assert ctl.params is not params and ctl.params.parallel_coords == params.parallel_coords
        assert coords_of(ctl.storage_config) == EXPECTED
        assert ctl.load_cache_event is event and ctl.storage.settings.prefetch_threshold == 6
        assert ctl.storage.state_pool is PoolName.MAMBA
    finally:
        ctl.close()


def test_extra_config_prefetch_threshold_wins_over_the_keyword_and_is_validated(tmp_path):
    alloc, host = mha_parts()
    ctl = HiCacheController(alloc, host, PAGE, prefetch_threshold=64, **file_storage(tmp_path, prefetch_threshold=8))
    assert ctl.storage.settings.prefetch_threshold == 8
    ctl.close()
    alloc, host = mha_parts()
    with pytest.raises(ValueError, match="'prefetch_threshold' must be >= 0, got -1"):
        HiCacheController(alloc, host, PAGE, prefetch_threshold=-1, **file_storage(tmp_path))


def test_bad_keywords_are_refused_naming_the_value():
    alloc, host = mha_parts()
    with pytest.raises(ValueError, match="host_memory_mode 'buffer_only' is not supported; allowed: cache"):
        HiCacheController(alloc, host, PAGE, host_memory_mode="buffer_only")
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, pp_size=2\), got 2"):
        HiCacheController(alloc, host, PAGE, pp_rank=2, pp_size=2)
    with pytest.raises(ValueError, match="unknown io_backend 'dma'"):
        HiCacheController(alloc, host, PAGE, io_backend="dma")
    with pytest.raises(ValueError, match="token_to_kv_pool_allocator is required"):
        HiCacheController(None, host, PAGE)


def test_load_cache_event_is_set_when_a_load_batch_starts_and_acks_are_upstreams_tuples():
    alloc, host = mha_parts()
    event = threading.Event()
    ctl = HiCacheController(alloc, host, PAGE, load_cache_event=event, write_policy="write_through",
                            io_backend="direct")
    try:
        assert ctl.write_policy.value == "write_through"
        dev, hst = ctl.alloc(Tier.DEVICE, KV, 4), ctl.alloc(Tier.HOST, KV, 4)
        ctl.defer_writes = True
        ctl.write([L2Transfer(KV, hst, dev)], node_ids=[5])
        assert len(ctl.write_queue) == 1 and ctl.start_writing() == 1 and ctl.write_queue == []
        ctl.synchronize_writes()
        start_event, finish_event, node_ids = ctl.ack_write_queue[0]  # upstream's (start, finish, node_ids)
        assert isinstance(ctl.ack_write_queue, list) and isinstance(ctl.ack_write_queue[0], HiCacheAck)
        assert start_event is None and finish_event.query() and node_ids == [5]
        assert ctl.pop_write_acks(1)[0].node_ids == [5] and ctl.ack_write_queue == []
        ctl.load([L2Transfer(KV, hst, ctl.alloc(Tier.DEVICE, KV, 4))], node_ids=[6])
        assert not event.is_set()  # queued, not started
        assert ctl.start_loading() == 0 and event.is_set()
    finally:
        ctl.close()


def test_default_write_policy_is_upstreams():
    alloc, host = mha_parts()
    ctl = HiCacheController(alloc, host, PAGE)
    assert ctl.write_policy.value == "write_through_selective"
    ctl.close()


def test_attach_storage_backend_takes_upstreams_keywords_and_refuses_a_second_one(tmp_path):
    alloc, host = mha_parts()
    ctl = HiCacheController(alloc, host, PAGE, **COORDS)
    try:
        ctl.attach_storage_backend(storage_backend="file", prefetch_threshold=16, model_name="tiny-model",
                                   storage_backend_extra_config={"storage_dir": str(tmp_path)})
        assert ctl.storage.settings.prefetch_threshold == 16 and coords_of(ctl.storage_config) == EXPECTED
        with pytest.raises(RuntimeError, match="already attached"):
            ctl.attach_storage_backend("file", model_name="tiny-model")
        assert ctl.detach_storage_backend() and ctl.storage is None
    finally:
        ctl.close()


def test_storage_operation_is_the_backup():
    op = StorageOperation(node=None, keys=["k"], host_indices=torch.arange(2))
    assert not op.done and op.states == []


def test_layer_done_counter_upstream_one_argument_form():
    counter = LayerDoneCounter(3)
    producer = counter.update_producer()
    counter.set_consumer(producer)
    loading = counter.events[producer]
    assert not loading.finish_event.query()
    for layer in range(3):
        loading.complete(layer)
        counter.wait_until(layer)  # recorded: returns at once
    assert loading.finish_event is loading.load_events[-1] and loading.finish_event.query()


def test_cache_init_params_takes_upstreams_fields_in_upstreams_order():
    alloc, _ = mha_parts(page_size=4)
    params = CacheInitParams(False, None, alloc, 4, enable_kv_cache_events=True)
    assert (params.disable, params.token_to_kv_pool_allocator, params.page_size) == (False, alloc, 4)
    assert params.enable_kv_cache_events and params.parallel_coords == ParallelCoords(0, 1, 0, 1, 0, 1)
    assert (params.pp_cache_group, params.attn_cp_cache_group, params.attn_tp_cache_group) == (None, None, None)


def test_from_params_and_check_same_cache():
    alloc, host = mha_parts()
    params = CacheInitParams(page_size=PAGE, token_to_kv_pool_allocator=alloc, tp_rank=1, tp_size=2, **COORDS)
    ctl = HiCacheController.from_params(params, host, write_policy="write_through")
    try:
        params.check_same_cache(ctl.params)
        assert ctl.params.parallel_coords == ParallelCoords(1, 2, 1, 2, 1, 3)
        with pytest.raises(ValueError, match="parallel coordinates differ"):
            CacheInitParams(page_size=PAGE, token_to_kv_pool_allocator=alloc).check_same_cache(ctl.params)
        with pytest.raises(ValueError, match="token_to_kv_pool_allocator differs"):
            CacheInitParams(page_size=PAGE, token_to_kv_pool_allocator=mha_parts()[0]).check_same_cache(ctl.params)
    finally:
        ctl.close()
    with pytest.raises(TypeError, match="params must be a CacheInitParams"):
        HiCacheController.from_params(object(), host)


# ---- coordinates read from gloo groups, two ranks -------------------------------------------
def _group_worker(rank: int, port: int, storage_dir: str, out) -> None:
    import torch.distributed as dist

    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=20))
        group = dist.new_group(backend="gloo")
        alloc, host = mha_parts()
        ctl = HiCacheController(alloc, host, PAGE, tp_group=None, pp_group=group, attn_cp_group=group,
                                storage_backend="file", model_name="tiny-model",
                                storage_backend_extra_config={"storage_dir": f"{storage_dir}/{rank}"})
        result["params"] = coords_of(ctl.params)
        result["storage"] = coords_of(ctl.storage_config)
        result["cp"] = ctl.get_attn_cp_rank_and_size()
        ctl.close()
        ctl = HiCacheController(alloc, host, PAGE, pp_group=group, pp_rank=rank, pp_size=2)  # agreeing: fine
        ctl.close()
        errors = []
        for kwargs in (dict(pp_group=group, pp_rank=1 - rank), dict(attn_tp_group=group)):
            try:
                HiCacheController(alloc, host, PAGE, **kwargs).close()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        result["errors"] = errors
    except BaseException:
        result["crash"] = traceback.format_exc()
    out.put(result)


def test_coordinates_read_from_the_groups_reach_params_and_storage_config(tmp_path):
    results = run_ranks(_group_worker, str(tmp_path), timeout_s=120)
    assert sorted(results) == [0, 1], results
    for rank, res in results.items():
        assert "crash" not in res, res["crash"]
        expected = dict(tp_rank=0, tp_size=1, pp_rank=rank, pp_size=2, attn_cp_rank=rank, attn_cp_size=2)
        assert res["params"] == expected and res["storage"] == expected and res["cp"] == (rank, 2)
        mismatch, attn_tp = res["errors"]
        assert mismatch == (f"pp_cache_group has rank {rank} of 2 but pp_rank={1 - rank}, pp_size=None; "
                            "they must agree")
        assert "attn_tp_cache_group must be None or tp_cache_group itself" in attn_tp


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
