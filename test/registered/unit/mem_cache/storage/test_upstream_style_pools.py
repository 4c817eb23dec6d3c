"""Pools with only upstream's HostKVCache surface, string keys and span mode, on the file and
NIXL POSIX backends: staged pools move through their flat pages and stay untouched by a read
that fails verification; pools that expose their buffers move zero-copy under upstream's object
names; a key of several host pages stores their bytes page after page; a v2 transfer that does
not fit fails only its own pool; no key reaches a path."""

import os

import numpy as np
import pytest
import torch
from conftest import fill_random, host_pool, page_keys

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage import native_io
from sglang.srt.mem_cache.storage.file.page_files import TRAILER_BYTES as FILE_TRAILER
from sglang.srt.mem_cache.storage.nixl.hicache_nixl import TRAILER_BYTES as NIXL_TRAILER
from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")


class RowPool:
    """An upstream-style pool of ``slots`` rows of ``width`` float16 values, page_size tokens a
    page; ``expose``: it also offers its rows as hybrid buffers (two halves) with their meta."""

    def __init__(self, slots=16, width=6, page_size=1, expose=False, aligned=True):
        self.page_size = page_size
        self.left = torch.randn(slots, width // 2).to(torch.float16)
        self.right = torch.randn(slots, width // 2).to(torch.float16)
        self._aligned = aligned
        if expose:
            self.get_hybrid_pool_buffer = lambda: [self.left, self.right]

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for slot in indices.tolist()[:: self.page_size]:
            for t in (self.left, self.right):
                rows = t[slot : slot + self.page_size]
                ptrs.append(rows.data_ptr())
                sizes.append(rows.numel() * rows.element_size())
        return ptrs, sizes

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.page_size * (self.left.shape[1] + self.right.shape[1]), dtype=torch.float16)

    def get_data_page(self, index, flat=True):
        rows = [t[index : index + self.page_size].reshape(-1) for t in (self.left, self.right)]
        return torch.cat(rows)

    def set_from_flat_data_page(self, index, data_page):
        half = self.page_size * self.left.shape[1]
        self.left[index : index + self.page_size] = data_page[:half].view(self.page_size, -1)
        self.right[index : index + self.page_size] = data_page[half:].view(self.page_size, -1)

    def is_stride_page_aligned(self, page_size_bytes=4096):
        return self._aligned


class KVBufferPool(RowPool):
    """An upstream-style MHA pool: ``kv_buffer`` (2, slots, heads, dim) under ``layout``."""

    def __init__(self, layout="page_first", slots=16, page_size=2, aligned=True):
        self.layout, self.page_size, self.size, self._aligned = layout, page_size, slots, aligned
        self.kv_buffer = torch.randn(2, slots, 2, 4)

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for slot in indices.tolist()[:: self.page_size]:
            for side in self.kv_buffer:
                page = side[slot : slot + self.page_size]
                ptrs.append(page.data_ptr())
                sizes.append(page.numel() * page.element_size())
        return ptrs, sizes

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.kv_buffer[:, : self.page_size].numel())

    def get_data_page(self, index, flat=True):
        return self.kv_buffer[:, index : index + self.page_size].flatten()

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[:, index : index + self.page_size] = data_page.view(2, self.page_size, 2, 4)


def make(backend, tmp_path, pools, **cfg):
    config = HiCacheStorageConfig(model_name="m", extra_config={"use_direct_io": False} if backend == "nixl" else None,
                                  **cfg)
    store = (HiCacheNixl if backend == "nixl" else HiCacheFile)(config, file_path=str(tmp_path / backend))
    for name, pool in pools.items():
        store.register_mem_host_pool_v2(pool, name)
    return store


def stored_files(root) -> dict[str, bytes]:
    return {f: open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(root) for f in fs
            if ".tmp." not in f and not d.endswith(".locks")}


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_staged_pool_round_trips_under_string_keys(backend, tmp_path):
    pool = RowPool()
    store = make(backend, tmp_path, {PoolName.MAMBA: pool})
    assert store.codecs[PoolName.MAMBA].shape.staged
    want = [pool.get_data_page(s).clone() for s in (3, 9)]
    t = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([3, 9]), keys=["alpha", "beta"])
    assert store.batch_set_v2([t]) == {PoolName.MAMBA: [True, True]}
    files = stored_files(tmp_path / backend)
    trailer = FILE_TRAILER if backend == "file" else NIXL_TRAILER
    assert sorted(v[:-trailer] for v in files.values()) == sorted(w.numpy().tobytes() for w in want)
    back = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=["alpha", "beta"])
    assert store.batch_get_v2([back]) == {PoolName.MAMBA: [True, True]}
    assert torch.equal(pool.get_data_page(0), want[0]) and torch.equal(pool.get_data_page(1), want[1])
    with pytest.raises(ValueError, match="pool 'kv' is not registered"):  # existence is gated by the KV pool
        store.batch_exists_v2(["alpha"], [back])
    store.close()


def test_staged_read_that_fails_verification_leaves_the_pool_untouched(tmp_path):
    pool = RowPool()
    store = make("file", tmp_path, {PoolName.MAMBA: pool})
    assert store.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([2]), keys=["k"])]) == {
        PoolName.MAMBA: [True]}
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "file") for f in fs if f.endswith(".bin")]
    raw = bytearray(open(path, "rb").read())
    raw[1] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    before = pool.get_data_page(5).clone()
    got = store.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=["k"])])
    assert got == {PoolName.MAMBA: [False]} and torch.equal(pool.get_data_page(5), before)
    assert store.get_stats()["corruptions"] == 1 and not os.path.exists(path)
    store.close()


def test_exposed_pools_move_zero_copy_under_upstreams_object_names(tmp_path):
    exposed, hidden = RowPool(expose=True), RowPool(expose=False)
    store = make("nixl", tmp_path, {PoolName.MAMBA: exposed, PoolName.SWA: hidden})
    mamba, swa = store._hybrid_pool_ctx[PoolName.MAMBA], store._hybrid_pool_ctx[PoolName.SWA]
    assert mamba.is_zero_copy and mamba.host_pool is exposed and mamba.bounce_set is None
    assert not swa.is_zero_copy and swa.bounce_page_bytes == hidden.get_dummy_flat_data_page().numel() * 2
    assert swa.bounce_set.shape[0] == swa.bounce_get.shape[0] == store.options.bounce_pages
    names = store.codecs[PoolName.MAMBA].object_names("p0")
    assert [n.rpartition(".")[2][64:] for n in names] == ["_mamba_temporal", "_mamba_conv_0"]
    assert [n.rpartition(".")[2][64:] for n in store.codecs[PoolName.SWA].object_names("p0")] == ["_swa"]
    want = {n: p.get_data_page(4).clone() for n, p in ((PoolName.MAMBA, exposed), (PoolName.SWA, hidden))}
    put = [PoolTransfer(n, host_indices=torch.tensor([4]), keys=["p0"]) for n in want]
    assert store.batch_set_v2(put) == {PoolName.MAMBA: [True], PoolName.SWA: [True]}
    get = [PoolTransfer(n, host_indices=torch.tensor([7]), keys=["p0"]) for n in want]
    assert store.batch_get_v2(get) == {PoolName.MAMBA: [True], PoolName.SWA: [True]}
    assert torch.equal(exposed.get_data_page(7), want[PoolName.MAMBA])
    assert torch.equal(hidden.get_data_page(7), want[PoolName.SWA])
    store.close()


@pytest.mark.parametrize("layout, zero_copy, suffixes", [("page_first", True, ["_k", "_v"]), ("layer_first", False, [""])])
def test_kv_buffer_pool_by_layout(tmp_path, layout, zero_copy, suffixes):
    pool = KVBufferPool(layout)
    store = make("nixl", tmp_path, {})
    store.register_mem_pool_host(pool)
    assert store.is_zero_copy is zero_copy and store._hybrid_pool_ctx[PoolName.KV].is_zero_copy is zero_copy
    assert [n.rpartition(".")[2][64:] for n in store.codecs[PoolName.KV].object_names("page-a")] == suffixes
    want = [pool.get_data_page(s).clone() for s in (0, 2)]
    assert store.batch_set_v1(["page-a", "page-b"], torch.arange(4)) == [True, True]
    assert store.batch_get_v1(["page-a", "page-b"], torch.arange(8, 12)) == [True, True]
    assert torch.equal(pool.get_data_page(8), want[0]) and torch.equal(pool.get_data_page(10), want[1])
    store.close()


def test_unaligned_pool_keeps_zero_copy_without_o_direct(tmp_path):
    """Deliberate difference: upstream falls back to bounce buffers; here the pool stays
    zero-copy and only O_DIRECT is off for it."""
    pool = KVBufferPool("page_first", aligned=False)
    config = HiCacheStorageConfig(model_name="m", extra_config={"use_direct_io": True})
    store = HiCacheNixl(config, file_path=str(tmp_path))
    store.register_mem_pool_host(pool)
    ctx = store._hybrid_pool_ctx[PoolName.KV]
    assert store.needs_page_alignment and store.is_zero_copy and ctx.is_zero_copy and not ctx.direct
    store.close()


@pytest.mark.parametrize("backend", ["file", "nixl"])
@pytest.mark.parametrize("native", [True, False])
def test_a_span_key_stores_its_host_pages_page_after_page(backend, native, tmp_path, monkeypatch):
    if not native:
        monkeypatch.setattr(native_io, "HASH", False)
    host = host_pool(PoolKind.MHA, "page_first_direct")  # 4 tokens a page, 16 pages
    fill_random(host, seed=31)
    state = RowPool(slots=8)
    store = make(backend, tmp_path, {}, storage_page_size=8)
    store.register_mem_pool_host(host)
    store.register_mem_host_pool_v2(state, PoolName.MAMBA)
    assert (store.codecs[PoolName.KV].pages_per_key, store.codecs[PoolName.MAMBA].pages_per_key) == (2, 1)
    key_pages = [[5, 1], [2, 7]]  # a key's host pages need not be adjacent
    idx = torch.cat([torch.arange(p * 4, p * 4 + 4) for pages in key_pages for p in pages])
    keys = page_keys(2)
    put = [PoolTransfer(PoolName.KV, host_indices=idx, keys=keys),
           PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([3, 6]), keys=keys)]
    assert store.batch_set_v2(put) == {PoolName.KV: [True, True], PoolName.MAMBA: [True, True]}
    files = stored_files(tmp_path / backend)
    trailer = FILE_TRAILER if backend == "file" else NIXL_TRAILER
    for key, pages in zip(keys, key_pages):
        flat = [host.get_data_page(p * 4).view(2, -1) for p in pages]  # K then V of each page
        names = store.codecs[PoolName.KV].object_names(key)
        if backend == "file":
            want = [b"".join(f.numpy().tobytes() for f in flat)]
        else:
            want = [b"".join(f[c].numpy().tobytes() for f in flat) for c in (0, 1)]
        assert [files[n + (".bin" if backend == "file" else "")][:-trailer] for n in names] == want
    dst = torch.arange(40, 56)
    get = [PoolTransfer(PoolName.KV, host_indices=dst, keys=keys),
           PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=keys)]
    before_state = [state.get_data_page(s).clone() for s in (3, 6)]
    assert store.batch_get_v2(get) == {PoolName.KV: [True, True], PoolName.MAMBA: [True, True]}
    for i, p in enumerate(p for pages in key_pages for p in pages):
        assert torch.equal(host.get_data_page(40 + 4 * i), host.get_data_page(p * 4))
    assert all(torch.equal(state.get_data_page(i), b) for i, b in enumerate(before_state))
    store.close()


def test_span_must_be_whole_pages_and_misfit_transfers_fail_alone(tmp_path):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    store = make("file", tmp_path, {}, storage_page_size=6)
    with pytest.raises(ValueError, match="storage_page_size 6 is not a multiple of pool 'kv''s page_size 4"):
        store.register_mem_pool_host(host)
    store.close()
    state = RowPool(slots=8)
    store = make("file", tmp_path, {PoolName.KV: host, PoolName.MAMBA: state}, storage_page_size=8)
    keys = page_keys(2)
    short = PoolTransfer(PoolName.KV, host_indices=torch.arange(8), keys=keys)  # one page per key, not two
    fine = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 2]), keys=keys)
    assert store.batch_set_v2([short, fine]) == {PoolName.KV: [False, False], PoolName.MAMBA: [True, True]}
    assert store.get_stats()["failures"] == 1
    with pytest.raises(ValueError, match="2 keys need 16 host indices"):  # v1 keeps raising: the caller's bug
        store.batch_set_v1(keys, torch.arange(8))
    store.close()


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_no_key_reaches_a_path(backend, tmp_path):
    pool = RowPool()
    store = make(backend, tmp_path / "inner", {PoolName.MAMBA: pool})
    keys = ["../../escaped", "/abs/path", "a" * 300, "\x00nul"]
    t = PoolTransfer(PoolName.MAMBA, host_indices=torch.arange(4), keys=keys)
    assert store.batch_set_v2([t]) == {PoolName.MAMBA: [True] * 4}
    assert sorted(os.listdir(tmp_path)) == ["inner"]
    names = [f for _, _, fs in os.walk(tmp_path / "inner") for f in fs if ".tmp." not in f and f != "commit"]
    assert len(names) == 4
    assert all(np.all([c in "0123456789abcdef._" or c.isalpha() for c in n]) and len(n) < 160 for n in names)
    assert store.batch_get_v2([t]) == {PoolName.MAMBA: [True] * 4}
    store.close()
