"""Hybrid stacks through L3: every pool of the group (MLA KV + DSA indexer; the DeepSeek-V4
logical anchor + compressed state) is backed up, flushed from L1 and L2, prefetched and loaded
back bit-exact, through the file and the NIXL backends. (KV + Mamba: test_hi_mamba_storage.py.)"""

import time

import pytest
import torch
from tree_fixtures import STACKS, fill_random, snapshot

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

TOKENS = [3, 1, 4, 1, 5, 9, 2, 6]
PREFETCH_DEADLINE_S = 60


def config(tmp_path, backend, layout):
    return HiCacheConfig(io_backend="direct", mem_layout=layout, storage_backend=backend, model_name="tiny",
                         storage_backend_extra_config={"storage_dir": str(tmp_path / backend), "prefetch_threshold": 2},
                         prefetch_policy="wait_complete")


def wait_prefetch(tree, rid, deadline_s=PREFETCH_DEADLINE_S):
    """Drive the per-step agreement until prefetch ``rid`` ends; fail after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not tree.check_prefetch_progress(rid):
        assert time.monotonic() < deadline, f"prefetch {rid!r} did not end within {deadline_s} s"
        tree.check_hicache_events()
        time.sleep(0.005)


def settle(tree):
    tree.cache_controller.synchronize()
    tree.storage.synchronize()
    tree.check_hicache_events()
    tree.storage.synchronize()
    tree.check_hicache_events()


@pytest.mark.parametrize("backend", ["file", "nixl"])
@pytest.mark.parametrize("stack_name,layout", [("kv_dsa", "page_first_direct"), ("dsv4", "layer_first")])
def test_every_pool_round_trips_through_l3(tmp_path, backend, stack_name, layout):
    stack = STACKS[stack_name](config(tmp_path, backend, layout))
    tree, controller, gen = stack.tree_cache, stack.cache_controller, torch.Generator().manual_seed(3)
    assert controller.storage.side_pools == [e.name for e in stack.host_pool_group.sidecars()]
    pools = {name: entry.device_pool for name, entry in stack.host_pool_group.entry_map.items()}
    slots = stack.params.token_to_kv_pool_allocator.alloc(len(TOKENS))
    for pool in pools.values():
        for buf in pool.buffers.values():
            fill_random(buf, slots, gen)
    before = {name: snapshot(pool, slots) for name, pool in pools.items()}
    tree.insert(InsertParams(key=RadixKey(TOKENS), value=slots))
    settle(tree)
    tree.reset()  # flush L1 and L2
    for pool in pools.values():
        pool.clear()
    assert tree.prefetch_from_storage("r", tree.root_node, TOKENS) == len(TOKENS)
    wait_prefetch(tree, "r")
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(TOKENS)))
    assert m.host_hit_length == len(TOKENS)
    got = tree.init_load_back(m.last_host_node, m.host_hit_length)
    tree.ready_to_load_host_cache()
    settle(tree)
    for name, pool in pools.items():
        after = snapshot(pool, got)
        for comp in before[name]:
            assert torch.equal(after[comp], before[name][comp]), f"{name.value}/{comp} bytes differ"
    stats = controller.get_stats()["l3"]
    pages = len(TOKENS) // stack.params.page_size
    assert (stats["prefetch_pages_loaded"], stats["backup_pages_submitted"], stats["failures"]) == (pages, pages, 0)
    assert stats["pages_written"] == pages * len(pools)  # the backend counts each pool's page
    tree.check_integrity()
    tree.reset()
    controller.close()


def test_a_missing_sidecar_page_limits_the_hit(tmp_path):
    """The indexer page of page 3 is gone: only pages 1-2 are usable (ALL_PAGES policy)."""
    stack = STACKS["kv_dsa"](config(tmp_path, "file", "layer_first"))
    tree, backend = stack.tree_cache, stack.cache_controller.storage_backend
    slots = stack.params.token_to_kv_pool_allocator.alloc(len(TOKENS))
    tree.insert(InsertParams(key=RadixKey(TOKENS), value=slots))
    settle(tree)
    node = tree.match_prefix(MatchPrefixParams(key=RadixKey(TOKENS))).last_device_node
    tree.reset()
    name = backend.codec(PoolName.INDEXER).object_names(node.hash_value[2])[0]
    (tmp_path / "file" / name[:2] / f"{name}.bin").unlink()
    tree.prefetch_from_storage("r", tree.root_node, TOKENS)
    wait_prefetch(tree, "r")
    assert tree.match_prefix(MatchPrefixParams(key=RadixKey(TOKENS))).host_hit_length == 4
    tree.reset()
    stack.cache_controller.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
