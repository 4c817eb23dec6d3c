"""HostPoolGroup on upstream's constructor: entries in order, one anchor, named side pools."""

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry, PoolName
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_device_pool, make_host_pool

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def pools(kind, size=None, page_size=4):
    dev = make_device_pool(kind, torch.float32, page_size=1 if kind is PoolKind.MAMBA else page_size)
    return make_host_pool(dev, "page_first_direct", "direct", size=size), dev


def test_the_marked_entry_is_the_anchor_wherever_it_stands():
    kv, kv_dev = pools(PoolKind.MHA)
    mamba, mamba_dev = pools(PoolKind.MAMBA)
    indexer, idx_dev = pools(PoolKind.DSA_INDEXER, size=kv.size)
    group = HostPoolGroup([
        PoolEntry(PoolName.MAMBA, mamba, mamba_dev),
        PoolEntry(PoolName.INDEXER, indexer, idx_dev, shares_anchor_slots=True),
        PoolEntry(PoolName.KV, kv, kv_dev, is_primary_index_anchor=True),
    ])
    assert group.anchor_entry.name is PoolName.KV and group.anchor_pool is kv
    assert (group.size, group.page_size, group.layout) == (kv.size, 4, kv.layout)
    assert [e.name for e in group.entries] == [PoolName.MAMBA, PoolName.INDEXER, PoolName.KV]
    assert group.get_entry() is group.anchor_entry and group.get_pool(PoolName.MAMBA) is mamba
    assert group.entry_map[PoolName.INDEXER].host_pool is indexer
    assert [e.name for e in group.sidecars()] == [PoolName.INDEXER]
    assert group.get_size_per_token() == kv.get_size_per_token() + indexer.get_size_per_token()
    assert group.alloc(8).tolist() == list(range(8))  # from the anchor
    assert group.alloc(2, pool=PoolName.MAMBA).tolist() == [0, 1]
    assert group.available_size(PoolName.MAMBA) == mamba.size - 2
    with pytest.raises(ValueError, match="'indexer' uses the anchor's slots; allocate from 'kv'"):
        group.alloc(4, pool=PoolName.INDEXER)
    with pytest.raises(KeyError, match="no pool 'dsv4_state' in this group"):
        group.get_entry(PoolName.DSV4_STATE)
    group.clear()
    assert group.available_size() == kv.size and group.available_size(PoolName.MAMBA) == mamba.size


def test_without_a_mark_the_first_entry_anchors():
    kv, kv_dev = pools(PoolKind.MLA)
    mamba, mamba_dev = pools(PoolKind.MAMBA)
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv, kv_dev), PoolEntry(PoolName.MAMBA, mamba, mamba_dev)])
    assert group.anchor_entry.host_pool is kv


def test_bad_groups_are_refused():
    kv, kv_dev = pools(PoolKind.MHA)
    other, other_dev = pools(PoolKind.MLA)
    small, small_dev = pools(PoolKind.DSA_INDEXER, size=kv.size // 2)
    with pytest.raises(ValueError, match="at least one pool entry"):
        HostPoolGroup([])
    with pytest.raises(ValueError, match="names must be unique"):
        HostPoolGroup([PoolEntry(PoolName.KV, kv, kv_dev), PoolEntry(PoolName.KV, other, other_dev)])
    with pytest.raises(ValueError, match="at most one anchor"):
        HostPoolGroup([PoolEntry(PoolName.KV, kv, kv_dev, is_primary_index_anchor=True),
                       PoolEntry(PoolName.MAMBA, other, other_dev, is_primary_index_anchor=True)])
    with pytest.raises(ValueError, match=f"sidecar 'indexer' has {kv.size // 2} slots"):
        HostPoolGroup([PoolEntry(PoolName.KV, kv, kv_dev),
                       PoolEntry(PoolName.INDEXER, small, small_dev, shares_anchor_slots=True)])
    with pytest.raises(ValueError, match="cannot share another pool's slots"):
        HostPoolGroup([PoolEntry(PoolName.INDEXER, small, small_dev, shares_anchor_slots=True)])
