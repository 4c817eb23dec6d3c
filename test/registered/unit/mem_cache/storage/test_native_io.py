"""The native batch paths of the file and NIXL POSIX backends (``native_io``, ``nixl/batch_path``):
that they are the paths taken, agree byte for byte with the Python paths, and hand every
unusual page (absent, corrupt, unwritable) to the per-object paths, which classify it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from conftest import fill_random, host_pool, page_keys, slots
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.storage import native_io
from sglang.srt.mem_cache.storage.nixl import batch_path
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

HAVE_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None


def test_native_helper_is_built_where_a_compiler_exists():
    """The install builds it (python/setup.py) and binds the xxhash package's XXH3; an optional
    build that failed must not pass unnoticed on a machine that could build it."""
    if HAVE_COMPILER:
        assert native_io.AVAILABLE and native_io.HASH, "reinstall: pip install -e python"


needs_native = pytest.mark.skipif(not native_io.HASH and not HAVE_COMPILER,
                                  reason="native file helper not built: no C compiler on this machine")


def _iov(arrays: list[list[np.ndarray]]) -> native_io.Iovecs:
    addrs = [a.ctypes.data for obj in arrays for a in obj]
    lens = [a.nbytes for obj in arrays for a in obj]
    starts = np.concatenate(([0], np.cumsum([len(obj) for obj in arrays]))).astype(np.int64)
    return native_io.Iovecs(np.array(addrs, dtype=np.int64), np.array(lens, dtype=np.int64), starts)


@needs_native
def test_hash_matches_the_xxhash_package():
    rng = np.random.default_rng(0)
    objs = [[rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] for sizes in ([1], [70000], [3, 5000, 1], [])]
    got = native_io.hash_objects(_iov(objs)).tolist()
    want = [xxhash.xxh3_64_intdigest(b"".join(a.tobytes() for a in obj)) for obj in objs]
    assert got == want


@needs_native
def test_read_and_write_files_report_errno_per_object(tmp_path):
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(3)]
    finals = [str(tmp_path / f"o{i}") for i in range(3)]
    finals[2] = str(tmp_path / "missing-dir" / "o2")  # its temporary file cannot be created
    tmps = [f + ".tmp" for f in finals]
    errs = native_io.write_files(tmps, finals, 0, _iov([[d] for d in data]))
    assert errs.tolist() == [0, 0, native_io.ENOENT]
    assert not any(os.path.exists(t) for t in tmps)
    assert Path(finals[0]).read_bytes() == data[0].tobytes()

    os.truncate(finals[1], 4000)  # short: not a whole object
    out = [np.zeros(4096 - 64, dtype=np.uint8) for _ in range(3)]
    tails = np.zeros((3, 65), dtype=np.uint8)
    counts, sums = native_io.read_files(finals, os.O_RDONLY, _iov([[o] for o in out]), tails, 64)
    assert counts.tolist() == [4096, 4000, native_io.ENOENT]
    assert out[0].tobytes() == data[0].tobytes()[:4032] and tails[0, :64].tobytes() == data[0].tobytes()[4032:]
    assert sums[0] == xxhash.xxh3_64_intdigest(out[0]) and sums[1] == 0


@needs_native
def test_layout_arguments_are_checked():
    with pytest.raises(ValueError, match="starts"):
        native_io.hash_objects(native_io.Iovecs(np.zeros(2, np.int64), np.zeros(2, np.int64), np.array([0, 1], np.int64)))
    with pytest.raises(TypeError, match="64-bit"):
        native_io._nf.hash_iovs(np.zeros(1, np.int32), np.zeros(1, np.int64), np.array([0, 1], np.int64),
                                np.zeros(1, np.uint64))


@needs_native
def test_with_tails_and_subset_keep_objects_in_order():
    base = native_io.Iovecs(np.array([10, 20, 30], np.int64), np.array([1, 2, 3], np.int64), np.array([0, 2, 3], np.int64))
    tails = np.zeros((2, 8), dtype=np.uint8)
    t = base.with_tails(tails)
    assert t.starts.tolist() == [0, 3, 5]
    assert t.addrs.tolist() == [10, 20, tails.ctypes.data, 30, tails.ctypes.data + 8]
    assert t.lens.tolist() == [1, 2, 8, 3, 8]
    layout = native_io.BatchLayout(base, ["a", "b"], np.array([3, 3], np.int64), [1, 1], np.array([0, 1], np.int64))
    sub = layout.subset(np.array([False, True]))
    assert sub.names == ["b"] and sub.iov.addrs.tolist() == [30] and sub.object_index.tolist() == [1]


def _count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_native
@pytest.mark.parametrize("backend_name", ["file", "nixl_posix"])
@pytest.mark.parametrize("kind,layout", [(PoolKind.MHA, "page_first_direct"), (PoolKind.MHA, "layer_first"),
                                         (PoolKind.MLA, "page_first")])
def test_native_and_python_paths_store_the_same_bytes(backend_name, kind, layout, make_backend, monkeypatch):
    """Pages written by the native path read back by the Python path and vice versa, bit-exact,
    and the native path is the one taken where it applies."""
    host = host_pool(kind, layout)
    fill_random(host, seed=3)
    native = make_backend(backend_name, host, share="s")
    python = make_backend(backend_name, host, share="s")
    keys = page_keys(6)
    native_writes = _count_calls(monkeypatch, native_io, "hash_objects")
    assert native.batch_set_v1(keys[:3], slots(host, 0, 3)) == [True] * 3
    expect_native = backend_name == "file" or native.contexts[PoolName.KV].is_zero_copy
    assert bool(native_writes) == expect_native
    monkeypatch.setattr(native_io, "HASH", False)
    assert python.batch_set_v1(keys[3:], slots(host, 3, 3)) == [True] * 3
    assert python.batch_get_v1(keys[:3], slots(host, 8, 3)) == [True] * 3
    monkeypatch.setattr(native_io, "HASH", True)
    assert native.batch_get_v1(keys[3:], slots(host, 11, 3)) == [True] * 3
    for i in range(6):
        assert torch.equal(host.get_data_page((8 + i) * host.page_size), host.get_data_page(i * host.page_size))


@needs_native
def test_nixl_batch_read_hands_absent_and_corrupt_pages_to_the_object_path(make_backend, monkeypatch):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=5)
    store = make_backend("nixl_posix", host)
    keys = page_keys(6)
    assert store.batch_set_v1(keys, slots(host, 0, 6)) == [True] * 6
    names = store.codecs[PoolName.KV].object_names
    os.unlink(store.side.get_file_path(names(keys[1])[1]))  # page 1 lost its V object
    victim = store.side.get_file_path(names(keys[4])[0])
    raw = bytearray(Path(victim).read_bytes())
    raw[10] ^= 0xFF  # page 4's K payload flipped
    Path(victim).write_bytes(raw)
    batches = _count_calls(monkeypatch, batch_path, "read_chunk")
    assert store.batch_get_v1(keys, slots(host, 8, 6)) == [True, False, True, True, False, True]
    assert batches, "the batch path was not taken"
    for i in (0, 2, 3, 5):
        assert torch.equal(host.get_data_page((8 + i) * host.page_size), host.get_data_page(i * host.page_size))
    assert int(host.get_data_page(12 * host.page_size).count_nonzero()) == 0  # read, failed, wiped
    stats = store.get_stats()
    assert stats["corruptions"] == 1 and stats["pages_missed"] == 2 and not os.path.exists(victim)


@needs_native
@pytest.mark.parametrize("backend_name", ["file", "nixl_posix"])
def test_a_removed_bucket_directory_is_recreated_by_the_fallback(backend_name, make_backend):
    host = host_pool(PoolKind.MLA, "page_first_direct")
    fill_random(host, seed=6)
    store = make_backend(backend_name, host)
    keys = page_keys(4)
    name = store.codecs[PoolName.KV].object_names(keys[2])[0]
    path = store.files.path(name) if backend_name == "file" else store.side.get_file_path(name)
    shutil.rmtree(os.path.dirname(path))
    assert store.batch_set_v1(keys, slots(host, 0, 4)) == [True] * 4
    assert store.batch_get_v1(keys, slots(host, 8, 4)) == [True] * 4
    assert torch.equal(host.get_data_page(10 * host.page_size), host.get_data_page(2 * host.page_size))
    assert not [f for f in os.listdir(os.path.dirname(path)) if ".tmp." in f]


@needs_native
def test_file_capacity_evicts_within_one_native_batch(make_backend):
    """A batch larger than the cap: the oldest objects of the batch itself are not written, the
    newest are, and the books match the disk."""
    host = host_pool(PoolKind.MLA, "page_first_direct")
    fill_random(host, seed=9)
    page = host.page_bytes + 64
    store = make_backend("file", host, {"capacity_gb": 3 * page / (1 << 30)})
    keys = page_keys(5)
    assert store.batch_set_v1(keys, slots(host, 0, 5)) == [False, False, True, True, True]
    on_disk = sum(len([f for f in os.listdir(e.path) if f.endswith(".bin")]) for e in os.scandir(store.files.root) if e.is_dir())
    assert on_disk == len(store.files.evictor) == 3 and store.files.evictor.used_bytes == 3 * page
    assert store.batch_get_v1(keys[2:], slots(host, 8, 3)) == [True] * 3


@needs_native
def test_file_native_batches_of_small_pages_run_on_the_io_threads(make_backend, monkeypatch):
    """With the native helper, batches of pages from 32 KiB are split over ``io_threads`` (its
    slices hold the GIL only for their bookkeeping); the slices run on the worker threads and
    every page reads back as written."""
    import threading

    from sglang.srt.mem_cache.storage.file.page_files import PageFiles
    from sglang.srt.mem_cache.storage.page_workers import NATIVE_PARALLEL_MIN_PAGE_BYTES

    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=13)
    store = make_backend("file", host, {"io_threads": 2})
    assert store.files.workers.min_page_bytes == NATIVE_PARALLEL_MIN_PAGE_BYTES < (1 << 20)
    assert store.files.workers.parallel(64 << 10) and not store.files.workers.parallel(16 << 10)
    store.files.workers.min_page_bytes = 0  # the test's pages are small
    seen = {"read": [], "write": []}
    for op, name in (("read", "_read_native"), ("write", "_write_native")):
        real = getattr(PageFiles, name)

        def spy(self, pages, layout, real=real, op=op):
            seen[op].append((len(pages), threading.current_thread().name))
            return real(self, pages, layout)

        monkeypatch.setattr(PageFiles, name, spy)
    keys = page_keys(6)
    assert store.batch_set_v1(keys, slots(host, 0, 6)) == [True] * 6
    assert store.batch_get_v1(keys, slots(host, 8, 6)) == [True] * 6
    for i in range(6):
        assert torch.equal(host.get_data_page((8 + i) * host.page_size), host.get_data_page(i * host.page_size))
    for op in ("read", "write"):  # one slice per thread (a pool thread may take both)
        assert sorted(n for n, _ in seen[op]) == [3, 3], seen
        assert all(t.startswith("hicache-file") for _, t in seen[op]), seen


@needs_native
def test_nixl_file_reads_run_two_lanes_with_their_own_agents(make_backend, monkeypatch):
    """Several chunks of zero-copy file pages: every other chunk is read and verified on the
    reader thread through the second agent into the second get area, the rest here through the
    first; a bad page in either lane is a miss, wiped, the rest intact."""
    import threading

    from sglang.srt.mem_cache.storage.nixl import hicache_nixl

    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=14)
    store = make_backend("nixl_posix", host)
    assert store.io_alt is not None and store.io_alt.agent is not store.io.agent
    keys = page_keys(8)
    assert store.batch_set_v1(keys, slots(host, 0, 8)) == [True] * 8
    names = store.codecs[PoolName.KV].object_names
    for i in (2, 5):  # one page in a chunk of each lane (chunks of two pages below)
        victim = store.side.get_file_path(names(keys[i])[0])
        raw = bytearray(Path(victim).read_bytes())
        raw[7] ^= 0x01
        Path(victim).write_bytes(raw)
    page_size = host.page_bytes + 2 * hicache_nixl.TRAILER_BYTES  # K and V objects with their trailers
    monkeypatch.setattr(hicache_nixl, "CHUNK_BYTES", 2 * page_size)  # four chunks of two pages
    calls, real = [], batch_path.read_chunk

    def spy(backend, pages, alt, io=None):
        calls.append((alt, io is store.io_alt, threading.current_thread() is threading.main_thread()))
        return real(backend, pages, alt, io)

    monkeypatch.setattr(batch_path, "read_chunk", spy)
    flags = store.batch_get_v1(keys, slots(host, 8, 8))
    assert flags == [True, True, False, True, True, False, True, True]
    assert sorted(calls) == [(False, False, True)] * 2 + [(True, True, False)] * 2, calls
    for i in (0, 1, 3, 4, 6, 7):
        assert torch.equal(host.get_data_page((8 + i) * host.page_size), host.get_data_page(i * host.page_size))
    for i in (2, 5):
        assert int(host.get_data_page((8 + i) * host.page_size).count_nonzero()) == 0  # read, failed, wiped
    stats = store.get_stats()
    assert stats["corruptions"] == 2 and stats["pages_missed"] == 2


@needs_native
def test_nixl_file_writes_run_two_lanes_with_their_own_agents(make_backend, monkeypatch):
    """Several chunks of zero-copy file pages: every other chunk is written on the writer thread
    through the second agent and set area; every page reads back bit-exact, also through the
    per-object path, and the flags keep the batch's order."""
    import threading

    from sglang.srt.mem_cache.storage.nixl import hicache_nixl

    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=15)
    store = make_backend("nixl_posix", host)
    page_size = host.page_bytes + 2 * hicache_nixl.TRAILER_BYTES
    monkeypatch.setattr(hicache_nixl, "CHUNK_BYTES", 2 * page_size)  # four chunks of two pages
    calls, real = [], batch_path.write_chunk

    def spy(backend, pages, alt=False, io=None):
        calls.append((alt, io is store.io_alt, threading.current_thread() is threading.main_thread()))
        return real(backend, pages, alt, io)

    monkeypatch.setattr(batch_path, "write_chunk", spy)
    keys = page_keys(8)
    assert store.batch_set_v1(keys, slots(host, 0, 8)) == [True] * 8
    assert sorted(calls) == [(False, False, True)] * 2 + [(True, True, False)] * 2, calls
    monkeypatch.setattr(native_io, "HASH", False)  # read back by the per-object path
    assert store.batch_get_v1(keys, slots(host, 8, 8)) == [True] * 8
    for i in range(8):
        assert torch.equal(host.get_data_page((8 + i) * host.page_size), host.get_data_page(i * host.page_size))
    assert store.get_stats()["corruptions"] == 0
