"""HiCacheNixl behaviours on a real NIXL agent (POSIX plugin): MLA skip, zero-copy existence,
hybrid pools, byte-exact bounce buffers, the logical anchor, one transfer per direction."""

import os

import pytest
import torch
from conftest import fill_random, host_pool, page_keys, pages_of, slots

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer, StorageBackendError
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry, PoolName
from sglang.srt.mem_cache.storage.nixl import nixl_io
from sglang.srt.mem_cache.storage.nixl.nixl_io import NixlIO
from sglang.srt.mem_cache.storage.nixl.pool_context import round_up
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="per-commit-cpu")

NIXL = "nixl_posix"


def stored_files(store) -> list[str]:
    root = store.side.root
    return sorted(f for d in os.listdir(root) if len(d) == 2 for f in os.listdir(os.path.join(root, d)))


def test_mla_backup_skip_on_nonzero_rank(make_backend):
    mla = host_pool(PoolKind.MLA)
    fill_random(mla, seed=2)
    rank1 = make_backend(NIXL, mla, share="mla", tp_rank=1, tp_size=2)
    rank0 = make_backend(NIXL, mla, share="mla", tp_rank=0, tp_size=2)
    assert rank1.backup_skip and not rank0.backup_skip
    keys = page_keys(3)
    assert rank1.batch_set_v1(keys, slots(mla, 0, 3)) == [True] * 3
    assert stored_files(rank1) == [] and rank1.get_stats()["pages_skipped"] == 3
    assert rank0.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, slots(mla, 0, 3)) == [True] * 3
    assert len(stored_files(rank0)) == 3  # one object per MLA page
    assert rank1.batch_exists(keys) == 3  # the same keys on every TP rank
    assert rank1.batch_get_v1(keys, slots(mla, 8, 3)) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(mla, 8, 3), pages_of(mla, 0, 3)))


@pytest.mark.parametrize("kind,objects_per_page", [(PoolKind.MLA, 1), (PoolKind.MHA, 2)])
def test_zero_copy_existence_counts_partial_hits(make_backend, kind, objects_per_page):
    host = host_pool(kind, "page_first_direct")
    store = make_backend(NIXL, host)
    assert store.contexts[PoolName.KV].is_zero_copy
    keys = page_keys(8)
    assert all(store.batch_set_v1(keys[:5], slots(host, 0, 5)))
    assert len(stored_files(store)) == 5 * objects_per_page
    assert store.batch_exists(keys) == 5
    if kind is PoolKind.MHA:  # a page with K but not V does not count
        store.side.remove(store.codecs[PoolName.KV].object_names(keys[3])[1])
        assert store.batch_exists(keys) == 3


def hybrid_group():
    kv = host_pool(PoolKind.MHA, "page_first_direct")
    mamba = host_pool(PoolKind.MAMBA, "layer_first", dtype=torch.bfloat16)
    indexer = host_pool(PoolKind.DSA_INDEXER, "page_first_direct", size=kv.size)
    for i, pool in enumerate((kv, mamba, indexer)):
        fill_random(pool, seed=10 + i)
    return HostPoolGroup([
        PoolEntry(PoolName.KV, kv, kv.device_pool, is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, mamba, mamba.device_pool),
        PoolEntry(PoolName.INDEXER, indexer, indexer.device_pool, shares_anchor_slots=True),
    ])


def transfers(group, keys, first_page, mamba_slot):
    kv = group.anchor_pool
    return [
        PoolTransfer(PoolName.KV, slots(kv, first_page, len(keys)), keys),
        PoolTransfer(PoolName.INDEXER, slots(kv, first_page, len(keys)), keys),
        PoolTransfer(PoolName.MAMBA, torch.tensor([mamba_slot]), keys[-1:], PoolHitPolicy.TRAILING_PAGES),
    ]


def test_hybrid_set_then_get_isolated_per_pool(make_backend):
    group = hybrid_group()
    store = make_backend(NIXL, group)
    assert set(store.codecs) == {PoolName.KV, PoolName.MAMBA, PoolName.INDEXER}
    kv, mamba, indexer = (group.get_entry(n).host_pool for n in (PoolName.KV, PoolName.MAMBA, PoolName.INDEXER))
    keys = page_keys(3)
    want = {"kv": pages_of(kv, 0, 3), "idx": pages_of(indexer, 0, 3), "mamba": mamba.get_data_page(1)}
    assert store.batch_set_v2(transfers(group, keys, 0, mamba_slot=1)) == {
        PoolName.KV: [True] * 3, PoolName.INDEXER: [True] * 3, PoolName.MAMBA: [True]}
    # Overwriting one pool's object for a key leaves the other pools' objects for that key alone.
    assert store.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([2]), keys[-1:])]) == {PoolName.MAMBA: [True]}
    got = store.batch_get_v2(transfers(group, keys, 8, mamba_slot=5))
    assert got == {PoolName.KV: [True] * 3, PoolName.INDEXER: [True] * 3, PoolName.MAMBA: [True]}
    assert all(torch.equal(a, b) for a, b in zip(pages_of(kv, 8, 3), want["kv"]))
    assert all(torch.equal(a, b) for a, b in zip(pages_of(indexer, 8, 3), want["idx"]))
    assert torch.equal(mamba.get_data_page(5), mamba.get_data_page(2))
    assert not torch.equal(mamba.get_data_page(5), want["mamba"])


def test_exists_v2_hit_policies(make_backend):
    group = hybrid_group()
    store = make_backend(NIXL, group)
    kv = group.anchor_pool
    keys = page_keys(8)
    assert all(store.batch_set_v1(keys[:6], slots(kv, 0, 6)))
    assert all(store.batch_set_v2([PoolTransfer(PoolName.INDEXER, slots(kv, 0, 4), keys[:4])])[PoolName.INDEXER])
    assert all(store.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([0]), [keys[2]])])[PoolName.MAMBA])
    asked = [PoolTransfer(PoolName.INDEXER), PoolTransfer(PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    result = store.batch_exists_v2(keys, asked)
    assert result.kv_hit_pages == 6
    assert result.extra_pool_hit_pages == {PoolName.INDEXER: 4, PoolName.MAMBA: 3}
    assert result.hit_pages == 3


def test_bf16_mamba_round_trips_bit_exact_through_bounce_buffers(make_backend):
    mamba = host_pool(PoolKind.MAMBA, "layer_first", dtype=torch.bfloat16)
    kv = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(mamba, seed=3)  # random bytes: NaN payloads, denormals, -0.0 all included
    store = make_backend(NIXL, kv)
    store.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    ctx = store.contexts[PoolName.MAMBA]
    assert not ctx.is_zero_copy and ctx.set_area.tensor.dtype == torch.uint8
    largest = max(s.nbytes for s in ctx.codec.segments)
    assert ctx.set_area.slot_bytes == round_up(largest + 4096)  # sized in bytes, not bf16 elements
    keys = page_keys(4)
    want = pages_of(mamba, 0, 4)
    assert store.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.arange(4), keys)]) == {PoolName.MAMBA: [True] * 4}
    assert store.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.arange(8, 12), keys)]) == {PoolName.MAMBA: [True] * 4}
    assert all(torch.equal(a, b) for a, b in zip(pages_of(mamba, 8, 4), want))


def test_logical_anchor_writes_markers_and_gates_side_pools(make_backend):
    anchor = host_pool(PoolKind.DSV4_ANCHOR)
    state = host_pool(PoolKind.DSV4_STATE, size=anchor.size)
    fill_random(state, seed=4)
    group = HostPoolGroup([PoolEntry(PoolName.KV, anchor, anchor.device_pool, is_primary_index_anchor=True),
                           PoolEntry(PoolName.DSV4_STATE, state, state.device_pool, shares_anchor_slots=True)])
    store = make_backend(NIXL, group)
    keys = page_keys(8)
    assert store.batch_set_v1(keys[:5], slots(anchor, 0, 5)) == [True] * 5
    markers = [f for f in stored_files(store) if f.endswith("_marker")]
    assert len(markers) == 5
    assert all(os.path.getsize(store.side.get_file_path(m)) == 4096 for m in markers)
    assert all(store.batch_set_v2([PoolTransfer(PoolName.DSV4_STATE, slots(anchor, 0, 8), keys)])[PoolName.DSV4_STATE])
    asked = [PoolTransfer(PoolName.DSV4_STATE)]
    assert store.batch_exists_v2(keys, asked).hit_pages == 5
    assert store.batch_get_v1(keys[:5], slots(anchor, 8, 5)) == [True] * 5
    for m in markers:
        os.unlink(store.side.get_file_path(m))
    gated = store.batch_exists_v2(keys, asked)
    assert (gated.kv_hit_pages, gated.extra_pool_hit_pages[PoolName.DSV4_STATE], gated.hit_pages) == (0, 0, 0)


def test_several_pools_move_in_one_transfer_per_direction(make_backend):
    group = hybrid_group()
    store = make_backend(NIXL, group)
    calls = []
    real = store.io.transfer
    store.io.transfer = lambda op, *a: (calls.append(op), real(op, *a))[1]
    keys = page_keys(3)
    assert all(all(v) for v in store.batch_set_v2(transfers(group, keys, 0, 1)).values())
    assert all(all(v) for v in store.batch_get_v2(transfers(group, keys, 8, 5)).values())
    assert calls == ["WRITE", "READ"]


def test_direct_io_on_aligned_pool_round_trips(make_backend):
    host = host_pool(PoolKind.MHA, "page_first_direct", page_size=16, head_dim=64)  # 8 KiB per K page
    fill_random(host, seed=5)
    store = make_backend(NIXL, host)
    if not store.side.use_direct_io:
        pytest.skip("the test directory's filesystem refuses O_DIRECT")
    assert store.contexts[PoolName.KV].direct
    keys = page_keys(3)
    assert all(store.batch_set_v1(keys, slots(host, 0, 3)))
    assert store.batch_get_v1(keys, slots(host, 4, 3)) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, 4, 3), pages_of(host, 0, 3)))


def test_nixl_errors_surface_as_project_exception_then_miss(make_backend):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=6)
    store = make_backend(NIXL, host)
    keys = page_keys(2)
    assert all(store.batch_set_v1(keys, slots(host, 0, 2)))
    path = store.side.get_file_path(store.codecs[PoolName.KV].object_names(keys[0])[0])
    fd = os.open(path, os.O_RDONLY)
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    store.io.register_dram([buf])
    try:
        with pytest.raises(StorageBackendError, match="NIXL POSIX"):  # a read past the end of the file
            store.io.transfer("READ", [(buf.data_ptr(), 1 << 16)], [(0, 1 << 16, fd)], [(0, 0, fd, "")])
    finally:
        os.close(fd)
    real = store.io.transfer

    def failing(op, *args):
        real(op, *args)  # the bytes land in host memory, then the transfer reports failure
        raise StorageBackendError("injected")

    store.io.transfer = failing
    assert store.batch_get_v1(keys, slots(host, 8, 2)) == [False, False]
    assert store.get_stats()["failures"] == 2  # the chunk, retried page by page: two failed pages
    assert store.get_stats()["corruptions"] == 0  # the objects have the right size: not blamed
    assert all(int(p.count_nonzero()) == 0 for p in pages_of(host, 8, 2))  # no unverified byte kept


class _StubAgent:
    """check_xfer_state answers PROC ``busy`` times, then ``final``."""

    def __init__(self, busy: int, final: str = "DONE"):
        self.busy, self.final, self.polls = busy, final, 0

    def check_xfer_state(self, handle):
        self.polls += 1
        return "PROC" if self.polls <= self.busy else self.final


def _stub_io(agent, timeout_s: float) -> NixlIO:
    io = object.__new__(NixlIO)  # the wait policy alone, without an agent of the real library
    io.agent, io.timeout_s, io.backend = agent, timeout_s, "POSIX"
    return io


def test_wait_polls_back_to_back_before_yielding(monkeypatch):
    """The POSIX plugin moves buffered data inside the polls: a short transfer is waited for
    without giving the CPU away; a long one yields, and a stuck one times out."""
    sleeps = []
    monkeypatch.setattr(nixl_io.time, "sleep", sleeps.append)
    monkeypatch.setattr(nixl_io, "_SPIN_S", 60.0)  # inside the spin window (0.2 ms in service)
    _stub_io(_StubAgent(busy=50), 60.0)._wait("READ", None, "PROC")
    assert sleeps == []
    monkeypatch.setattr(nixl_io, "_SPIN_S", 0.0)
    with pytest.raises(StorageBackendError, match="timed out after 0.01s"):
        _stub_io(_StubAgent(busy=10**9), 0.01)._wait("READ", None, "PROC")
    assert sleeps and set(sleeps) <= {0, nixl_io._POLL_SLEEP_S}
    with pytest.raises(StorageBackendError, match="ended in state ERR"):
        _stub_io(_StubAgent(busy=1, final="ERR"), 60.0)._wait("WRITE", None, "PROC")

