"""NIXL FILE capacity and several directories: a byte budget kept by evicting whole page groups
(every object of a page hash, sidecar pools included), least recently used first; and
``storage_dirs``, each page group in one directory chosen by a stable hash, found after reopen."""

import os

import pytest
import torch
from conftest import fill_random, host_pool, page_keys, pages_of, slots, storage_config

from sglang.srt.mem_cache.hicache_storage import PoolTransfer
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry, PoolName
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.storage.nixl.nixl_config import parse_nixl_options
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

BUDGET = 256 << 10
PAGES = 8  # per batch: the host pool holds 16 pages


def kv_and_indexer():
    kv = host_pool(PoolKind.MHA, "page_first_direct")
    indexer = host_pool(PoolKind.DSA_INDEXER, "page_first_direct", size=kv.size)
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv, kv.device_pool, is_primary_index_anchor=True),
                           PoolEntry(PoolName.INDEXER, indexer, indexer.device_pool, shares_anchor_slots=True)])
    return group, kv, indexer


def nixl(group, **extra):
    return StorageBackendFactory.create_backend("nixl", storage_config(group.anchor_pool, extra), group)


def both(kv, keys, first_page):
    idx = slots(kv, first_page, len(keys))
    return [PoolTransfer(PoolName.KV, idx, keys), PoolTransfer(PoolName.INDEXER, idx, keys)]


def stored(roots) -> dict[str, int]:
    """name -> size of every object file under ``roots``."""
    out = {}
    for root in roots:
        for bucket in os.listdir(root):
            if len(bucket) == 2:
                for name in os.listdir(os.path.join(root, bucket)):
                    out[name] = os.path.getsize(os.path.join(root, bucket, name))
    return out


def test_writing_four_times_the_budget_stays_within_it(tmp_path):
    group, kv, indexer = kv_and_indexer()
    root = str(tmp_path / "store")
    store = nixl(group, storage_dir=root, capacity_gb=BUDGET / (1 << 30), high_watermark=90, low_watermark=60)
    page_bytes = sum(s.nbytes + 4096 for c in store.codecs.values() for s in c.segments)
    batches = 4 * BUDGET // (page_bytes * PAGES) + 1
    written = 0
    try:
        for b in range(batches):
            for pool in (kv, indexer):
                fill_random(pool, seed=100 + b)
            keys = page_keys(PAGES, salt=f"batch-{b}")
            assert store.batch_set_v2(both(kv, keys, 0)) == {PoolName.KV: [True] * PAGES, PoolName.INDEXER: [True] * PAGES}
            written += PAGES * page_bytes
            assert sum(stored([root]).values()) <= BUDGET
        assert written >= 4 * BUDGET
        # every page hash is whole (all its KV and indexer objects) or gone, never half evicted
        names = stored([root])
        groups = {}
        for name in names:
            groups.setdefault(name.split(".")[0], []).append(name)
        assert groups and all(len(objs) == 4 for objs in groups.values())  # _k, _v, _indexer_k, _indexer_v
        stats = store.get_stats()
        assert stats["groups_evicted"] * page_bytes == stats["bytes_evicted"] > 0
        assert stats["groups_evicted"] + len(groups) == batches * PAGES
        # the newest batch reads back bit for bit; the oldest is gone
        want_kv, want_idx = pages_of(kv, 0, PAGES), pages_of(indexer, 0, PAGES)
        assert store.batch_get_v2(both(kv, keys, 8)) == {PoolName.KV: [True] * PAGES, PoolName.INDEXER: [True] * PAGES}
        assert all(torch.equal(a, b) for a, b in zip(pages_of(kv, 8, PAGES), want_kv))
        assert all(torch.equal(a, b) for a, b in zip(pages_of(indexer, 8, PAGES), want_idx))
        assert store.batch_exists(page_keys(PAGES, salt="batch-0")) == 0
    finally:
        store.close()
    # a reopened store books what is there and keeps the budget from the first write on
    again = nixl(group, storage_dir=root, capacity_gb=BUDGET / (1 << 30), high_watermark=90, low_watermark=60)
    try:
        assert again.capacity.used_bytes == sum(stored([root]).values())
        assert again.batch_exists(keys) == PAGES
        for b in range(3):
            keys = page_keys(PAGES, salt=f"again-{b}")
            assert all(again.batch_set_v2(both(kv, keys, 0))[PoolName.KV])
            assert sum(stored([root]).values()) <= BUDGET
    finally:
        again.close()


def test_a_read_keeps_a_group_from_eviction(tmp_path):
    group, kv, indexer = kv_and_indexer()
    store = nixl(group, storage_dir=str(tmp_path / "s"), capacity_gb=BUDGET / (1 << 30))
    try:
        first = page_keys(PAGES, salt="first")
        assert all(store.batch_set_v2(both(kv, first, 0))[PoolName.KV])
        for b in range(BUDGET // (8 << 10) // PAGES + 2):  # a little over the budget
            assert store.batch_get_v2(both(kv, first[:1], 8))[PoolName.KV] == [True]  # keep first[0] in use
            assert all(store.batch_set_v2(both(kv, page_keys(PAGES, salt=f"fill-{b}"), 0))[PoolName.KV])
        assert store.get_stats()["groups_evicted"] > 0
        assert store.batch_exists(first[:1]) == 1  # used recently: kept
        assert store.batch_exists(first[1:2]) == 0  # the least recently used went first
    finally:
        store.close()


def test_storage_dirs_spread_page_groups_and_reopen_finds_them(tmp_path):
    group, kv, indexer = kv_and_indexer()
    for i, pool in enumerate((kv, indexer)):
        fill_random(pool, seed=7 + i)
    roots = [str(tmp_path / f"disk{i}") for i in range(3)]
    keys = page_keys(16)
    store = nixl(group, storage_dirs=roots)
    try:
        assert store.batch_set_v2(both(kv, keys[:8], 0))[PoolName.KV] == [True] * 8
        assert store.batch_set_v2(both(kv, keys[8:], 0))[PoolName.KV] == [True] * 8
    finally:
        store.close()
    per_root = [stored([r]) for r in roots]
    assert all(per_root)  # every directory holds pages
    for names in per_root:  # and each page group lives whole in one directory
        for other in per_root:
            if other is not names:
                assert not {n.split(".")[0] for n in names} & {n.split(".")[0] for n in other}
    assert sum(len(n) for n in per_root) == 16 * 4  # _k, _v, _indexer_k, _indexer_v per page
    want = pages_of(kv, 0, 8)
    again = nixl(group, storage_dirs=roots)
    try:
        assert again.batch_exists(keys) == 16
        assert again.batch_get_v2(both(kv, keys[8:], 8))[PoolName.KV] == [True] * 8
        assert all(torch.equal(a, b) for a, b in zip(pages_of(kv, 8, 8), want))
    finally:
        again.close()


@pytest.mark.parametrize("extra,message", [
    ({"storage_dir": "/tmp/a", "storage_dirs": ["/tmp/b"]}, "'storage_dir'.*'storage_dirs'.*not both"),
    ({"storage_dirs": []}, "'storage_dirs' is an empty list"),
    ({"storage_dirs": ["/tmp/a", "/tmp/b", "/tmp/a/"]}, "'storage_dirs' names /tmp/a more than once"),
    ({"storage_dirs": ["/tmp/a", 5]}, "'storage_dirs' must be a list of strings"),
    ({"storage_dirs": ["/tmp/a", ""]}, "'storage_dirs' has an empty entry"),
    ({"high_watermark": 60, "low_watermark": 70}, "'low_watermark'.*'high_watermark'"),
    ({"high_watermark": 101}, "'high_watermark'"),
    ({"high_watermark": 90, "l3_cleaner_high_watermark": 90}, "same setting"),
    ({"plugin": "obj", "plugin_params": {"bucket": "b"}, "capacity_gb": 1}, "'capacity_gb' applies to file plugins"),
])
def test_bad_directory_and_capacity_settings_are_refused_by_key(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_nixl_options(extra)


def test_directory_forms(monkeypatch):
    assert parse_nixl_options({"storage_dir": "/tmp/x"}).storage_dirs == ("/tmp/x",)
    assert parse_nixl_options({"storage_dirs": ["/tmp/x", "/tmp/y"]}).storage_dirs == ("/tmp/x", "/tmp/y")
    monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", "/tmp/e1,/tmp/e2")  # upstream's form
    assert parse_nixl_options({}).storage_dirs == ("/tmp/e1", "/tmp/e2")
    opts = parse_nixl_options({"l3_cleaner_high_watermark": 50, "l3_cleaner_low_watermark": 40, "capacity_gb": 2})
    assert (opts.high_watermark, opts.low_watermark, opts.capacity_bytes) == (50, 40, 2 << 30)
