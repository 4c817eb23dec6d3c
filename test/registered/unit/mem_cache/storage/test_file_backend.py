"""File backend specifics (capacity cap, LRU order, leftovers) and a property round trip over
pool kinds and layouts for the file and NIXL POSIX backends."""

import os

import pytest
import torch
from conftest import fill_random, host_pool, page_keys, pages_of, slots, storage_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.storage.file.page_files import TRAILER_BYTES
from sglang.srt.mem_cache.storage.file.lru_evictor import LRUEvictor
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=12, suite="per-commit-cpu")


def file_store(host, root, **extra):
    return StorageBackendFactory.create_backend("file", storage_config(host, {"storage_dir": str(root), **extra}), host)


def test_lru_evictor_order():
    lru = LRUEvictor(30)
    assert lru.reserve("a", 10) == [] and lru.reserve("b", 10) == [] and lru.reserve("c", 10) == []
    lru.touch("a")
    assert lru.reserve("d", 10) == ["b"]
    assert lru.reserve("e", 20) == ["c", "a"]
    assert lru.reserve("huge", 31) is None
    assert lru.used_bytes == 30 and len(lru) == 2


def test_capacity_cap_evicts_least_recently_used_pages(tmp_path):
    host = host_pool(PoolKind.MLA)
    fill_random(host, seed=11)
    file_bytes = host.page_bytes + TRAILER_BYTES
    store = file_store(host, tmp_path, capacity_gb=3.5 * file_bytes / (1 << 30))  # room for 3 pages
    keys = page_keys(5)
    assert all(store.batch_set_v1(keys[:3], slots(host, 0, 3)))
    assert store.batch_get_v1(keys[:1], slots(host, 8, 1)) == [True]  # page 0 is now the newest
    assert all(store.batch_set_v1(keys[3:5], slots(host, 3, 2)))  # evicts pages 1 and 2
    hits = [store.batch_exists([k]) for k in keys]
    assert hits == [1, 0, 0, 1, 1]
    assert store.files.evictor.used_bytes == 3 * file_bytes
    store.close()


def test_restart_accounts_existing_files_and_drops_leftover_temporaries(tmp_path):
    host = host_pool(PoolKind.MLA)
    store = file_store(host, tmp_path)
    keys = page_keys(2)
    assert all(store.batch_set_v1(keys, slots(host, 0, 2)))
    store.close()
    bucket = next(p for p in tmp_path.iterdir() if p.is_dir())
    leftover = bucket / "deadbeef.bin.tmp.1.2.3"
    leftover.write_bytes(b"half a page")
    again = file_store(host, tmp_path)
    assert len(again.files.evictor) == 2 and not leftover.exists()
    assert again.batch_exists(keys) == 2
    again.clear()
    assert again.batch_exists(keys) == 0 and not any(f for d in tmp_path.iterdir() if d.is_dir() for f in d.iterdir())
    again.close()


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_a_removed_bucket_directory_is_recreated_on_write(backend, tmp_path):
    host = host_pool(PoolKind.MLA)
    fill_random(host, seed=13)
    store = StorageBackendFactory.create_backend(backend, storage_config(host, {"storage_dir": str(tmp_path)}), host)
    key = page_keys(1)
    bucket = tmp_path / store.codecs[next(iter(store.codecs))].object_names(key[0])[0][:2]
    assert bucket.is_dir()  # the 256 buckets exist from the start
    bucket.rmdir()
    assert store.batch_set_v1(key, slots(host, 0, 1)) == [True]
    assert store.batch_get_v1(key, slots(host, 8, 1)) == [True]
    assert torch.equal(host.get_data_page(8 * host.page_size), host.get_data_page(0))
    store.close()


CELLS = [
    (PoolKind.MHA, "layer_first"),
    (PoolKind.MHA, "page_first_direct"),
    (PoolKind.MHA, "page_first"),
    (PoolKind.MHA, "page_head"),
    (PoolKind.MLA, "page_first_direct"),
    (PoolKind.DSA_INDEXER, "layer_first"),
    (PoolKind.MAMBA, "page_first_direct"),
]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    built = {}

    def get(backend, kind, layout):
        if (backend, kind, layout) not in built:
            host = host_pool(kind, layout, dtype=torch.float16)
            root = tmp_path_factory.mktemp(f"{backend}-{kind.value}-{layout}")
            name = "file" if backend == "file" else "nixl"
            store = StorageBackendFactory.create_backend(name, storage_config(host, {"storage_dir": str(root)}), host)
            built[(backend, kind, layout)] = (host, store)
        return built[(backend, kind, layout)]

    yield get
    for _, store in built.values():
        store.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    backend=st.sampled_from(["file", "nixl_posix"]),
    cell=st.sampled_from(CELLS),
    seed=st.integers(0, 2**31 - 1),
    num_pages=st.integers(1, 4),
    src=st.integers(0, 4),
    dst=st.integers(8, 12),
)
def test_round_trip_any_pool_and_layout(stores, backend, cell, seed, num_pages, src, dst):
    host, store = stores(backend, *cell)
    fill_random(host, seed)
    keys = page_keys(num_pages, salt=str(seed))
    want = pages_of(host, src, num_pages)
    assert store.batch_set_v1(keys, slots(host, src, num_pages)) == [True] * num_pages
    assert store.batch_exists(keys) == num_pages
    assert store.batch_get_v1(keys, slots(host, dst, num_pages)) == [True] * num_pages
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst, num_pages), want))
    assert os.path.isdir(store.files.root if backend == "file" else store.side.root)
