"""MooncakeStore against a real mooncake_master on 127.0.0.1 (sglang.test.mooncake_master).

Round trips v1 and v2 (and without Mooncake's session API), the MLA rank-0 writer, integrity (a
corrupt, short, grown or foreign object is a removed miss), a page evicted between exists and get
or stored after the size query, a torn write revoked, two clients sharing one master, a peer that
stops answering, and a master killed and restarted under a live backend.
"""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import fill_random, host_pool, page_keys, pages_of, slots, storage_config

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry, PoolName
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.mooncake_master import MooncakeMaster, mooncake_or_skip

register_cpu_ci(est_time=52, suite="nightly-cpu")

mooncake_or_skip()
from sglang.srt.mem_cache.storage.mooncake_store import batch_plan, mooncake_store  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.store_client import KEY_PREFIX  # noqa: E402

TIMEOUT_S = 3.0  # transfer_timeout_s of every backend here
# A call against a dead master returns at once or after Mooncake's reconnect attempt (~4.5 s).
DEAD_MASTER_BOUND_S = 10.0


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster() as m:
        yield m


@pytest.fixture
def make_store(master, request):
    """make_store(host, on=master, segment=64 MiB, salt=test name, **ranks): a backend on a
    master, in a key namespace of this test (closed after it)."""
    made = []

    def make(host, on=None, segment=64 << 20, salt=None, **ranks):
        m = on or master
        extra = m.extra_config(global_segment_size=segment, transfer_timeout_s=TIMEOUT_S,
                               namespace_salt=salt or request.node.name)
        store = StorageBackendFactory.create_backend("mooncake", storage_config(host, extra, **ranks), host)
        made.append(store)
        return store

    yield make
    # Together (Mooncake's close waits 1-2 s for its threads), and before the next test: a
    # closing client takes the pages in its segment with it, whichever client wrote them.
    with ThreadPoolExecutor(max(1, len(made))) as pool:
        list(pool.map(lambda store: store.close(), made))


def stored_key(store, key, pool=PoolName.KV) -> str:
    return KEY_PREFIX + store.codec(pool).object_names(key)[0]


def equal_pages(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_v1_round_trip_is_byte_exact(make_store, layout):
    host = host_pool(PoolKind.MHA, layout)
    fill_random(host, seed=1)
    store = make_store(host)
    keys = page_keys(6)
    want = pages_of(host, 0, 6)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys[:4], slots(host, 0, 4)) == [True] * 4
    assert store.batch_exists(keys) == 4
    assert store.batch_get_v1(keys, slots(host, 8, 6)) == [True] * 4 + [False] * 2
    assert equal_pages(pages_of(host, 8, 4), want[:4])
    stats = store.get_stats()
    assert (stats["pages_written"], stats["pages_hit"], stats["pages_missed"]) == (4, 4, 2)
    assert stats["bytes_written"] == stats["bytes_read"] == 4 * host.page_bytes
    assert (stats["failures"], stats["corruptions"]) == (0, 0)


def hybrid_group():
    kv = host_pool(PoolKind.MHA, "page_first_direct")
    mamba = host_pool(PoolKind.MAMBA, "layer_first")
    indexer = host_pool(PoolKind.DSA_INDEXER, "page_first_direct", size=kv.size)
    for i, pool in enumerate((kv, mamba, indexer)):
        fill_random(pool, seed=10 + i)
    return HostPoolGroup([
        PoolEntry(PoolName.KV, kv, kv.device_pool, is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, mamba, mamba.device_pool),
        PoolEntry(PoolName.INDEXER, indexer, indexer.device_pool, shares_anchor_slots=True),
    ])


def test_v2_hybrid_round_trip_and_hit_policies(make_store):
    group = hybrid_group()
    store = make_store(group)
    kv, mamba, indexer = (group.get_entry(n).host_pool for n in (PoolName.KV, PoolName.MAMBA, PoolName.INDEXER))
    keys = page_keys(6)
    put = [PoolTransfer(PoolName.KV, slots(kv, 0, 4), keys[:4]),
           PoolTransfer(PoolName.INDEXER, slots(kv, 0, 3), keys[:3]),
           PoolTransfer(PoolName.MAMBA, torch.tensor([1]), keys[2:3], PoolHitPolicy.TRAILING_PAGES)]
    assert store.batch_set_v2(put) == {PoolName.KV: [True] * 4, PoolName.INDEXER: [True] * 3, PoolName.MAMBA: [True]}
    asked = [PoolTransfer(PoolName.INDEXER), PoolTransfer(PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    result = store.batch_exists_v2(keys, asked)
    assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (4, {PoolName.INDEXER: 3, PoolName.MAMBA: 3})
    get = [PoolTransfer(PoolName.KV, slots(kv, 8, 3), keys[:3]),
           PoolTransfer(PoolName.INDEXER, slots(kv, 8, 3), keys[:3]),
           PoolTransfer(PoolName.MAMBA, torch.tensor([5]), keys[2:3], PoolHitPolicy.TRAILING_PAGES)]
    assert store.batch_get_v2(get) == {PoolName.KV: [True] * 3, PoolName.INDEXER: [True] * 3, PoolName.MAMBA: [True]}
    assert equal_pages(pages_of(kv, 8, 3), pages_of(kv, 0, 3))
    assert equal_pages(pages_of(indexer, 8, 3), pages_of(indexer, 0, 3))
    assert torch.equal(mamba.get_data_page(5), mamba.get_data_page(1))


def test_logical_anchor_markers_gate_the_state_pool(make_store):
    anchor = host_pool(PoolKind.DSV4_ANCHOR)
    state = host_pool(PoolKind.DSV4_STATE, size=anchor.size)
    fill_random(state, seed=4)
    group = HostPoolGroup([PoolEntry(PoolName.KV, anchor, anchor.device_pool, is_primary_index_anchor=True),
                           PoolEntry(PoolName.DSV4_STATE, state, state.device_pool, shares_anchor_slots=True)])
    store = make_store(group)
    keys = page_keys(6)
    assert store.batch_set_v1(keys[:4], slots(anchor, 0, 4)) == [True] * 4  # bare trailers
    assert all(store.batch_set_v2([PoolTransfer(PoolName.DSV4_STATE, slots(anchor, 0, 6), keys)])[PoolName.DSV4_STATE])
    assert store.batch_exists_v2(keys, [PoolTransfer(PoolName.DSV4_STATE)]).hit_pages == 4
    got = store.batch_get_v2([PoolTransfer(PoolName.DSV4_STATE, slots(anchor, 8, 4), keys[:4])])
    assert got == {PoolName.DSV4_STATE: [True] * 4}
    assert equal_pages(pages_of(state, 8, 4), pages_of(state, 0, 4))


def test_mla_is_written_by_tp_rank_0_only(make_store):
    mla = host_pool(PoolKind.MLA)
    fill_random(mla, seed=2)
    rank1 = make_store(mla, segment=0, tp_rank=1, tp_size=2)
    rank0 = make_store(mla, tp_rank=0, tp_size=2)
    keys = page_keys(3)
    assert rank1.batch_set_v1(keys, slots(mla, 0, 3)) == [True] * 3
    assert rank1.get_stats()["pages_skipped"] == 3 and rank1.get_stats()["pages_written"] == 0
    assert rank0.batch_exists(keys) == 0  # rank 1 stored nothing
    assert rank0.batch_set_v1(keys, slots(mla, 0, 3)) == [True] * 3
    assert rank1.batch_exists(keys) == 3  # one replicated namespace for every TP rank
    assert rank1.batch_get_v1(keys, slots(mla, 8, 3)) == [True] * 3
    assert equal_pages(pages_of(mla, 8, 3), pages_of(mla, 0, 3))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


CORRUPTIONS = {
    "payload_bit": lambda data, other: _flip(data, 7),
    "trailer_bit": lambda data, other: _flip(data, len(data) - 20),
    "short": lambda data, other: data[:-100],
    "grown": lambda data, other: data + b"\0" * 64,
    "foreign": lambda data, other: other,  # another key's whole object under this key
}


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in_place"])
def test_corrupt_objects_are_removed_misses(make_store, monkeypatch, staged):
    """One page per fault, read beside two whole pages in three Mooncake calls, through the
    staging area (small pages) or straight into the host pages with a trailer row."""
    monkeypatch.setattr(mooncake_store, "OBJECTS_PER_BATCH", 3)
    host = host_pool(PoolKind.MLA if staged else PoolKind.MHA)  # MLA: one chunk per page; MHA: K and V
    fill_random(host, seed=5)
    store = make_store(host)
    assert (store._get_stage is not None) == staged
    n = len(CORRUPTIONS)
    keys = page_keys(n + 2)
    assert store.batch_set_v1(keys, slots(host, 0, n + 2)) == [True] * (n + 2)
    raw = store.client.store
    other = raw.get(stored_key(store, keys[-1]))
    for key, corrupt in zip(keys[1:], CORRUPTIONS.values()):
        target = stored_key(store, key)
        bad = corrupt(raw.get(target), other)
        assert raw.remove(target, True) == 0 and raw.put(target, bad) == 0
    fill_random(host, seed=6)  # the destination slots hold other bytes before the read
    before = pages_of(host, 8, n + 2)
    assert store.batch_get_v1(keys, slots(host, 8, n + 2)) == [True] + [False] * n + [True]
    for got, old in zip(pages_of(host, 9, n), before[1:]):
        assert int(got.count_nonzero()) == 0 or torch.equal(got, old)  # no unverified byte stays
    assert store.get_stats()["corruptions"] == n
    assert [raw.is_exist(stored_key(store, k)) for k in keys] == [1] + [0] * n + [1]  # removed
    assert store.batch_set_v1(keys[1:2], slots(host, 1, 1)) == [True]  # the next backup rewrites it
    assert store.batch_get_v1(keys[1:2], slots(host, 9, 1)) == [True]
    assert torch.equal(pages_of(host, 9, 1)[0], pages_of(host, 1, 1)[0])


@pytest.mark.parametrize("kind", [PoolKind.MHA, PoolKind.MLA], ids=["in_place", "staged"])
def test_page_evicted_between_exists_and_get_is_a_miss(make_store, kind):
    host = host_pool(kind)
    fill_random(host, seed=7)
    store = make_store(host)
    keys = page_keys(2)
    assert store.batch_set_v1(keys, slots(host, 0, 2)) == [True] * 2
    assert store.batch_exists(keys) == 2
    assert store.client.store.remove(stored_key(store, keys[1]), True) == 0  # what eviction does
    before = pages_of(host, 9, 1)[0]
    assert store.batch_get_v1(keys, slots(host, 8, 2)) == [True, False]
    assert torch.equal(pages_of(host, 9, 1)[0], before)  # an absent page leaves its slots alone
    assert (store.get_stats()["corruptions"], store.get_stats()["failures"]) == (0, 0)


def test_staging_room_splits_a_batch(make_store, monkeypatch):
    """Small pages of one chunk go through the staging area; with room for two objects, six
    pages go in three calls each way."""
    page = host_pool(PoolKind.MLA).page_bytes
    monkeypatch.setattr(batch_plan, "STAGING_BYTES", 2 * (page + batch_plan.TRAILER_BYTES))
    host = host_pool(PoolKind.MLA)
    fill_random(host, seed=17)
    store = make_store(host)
    assert store._get_stage is not None and store._get_stage.nbytes == batch_plan.STAGING_BYTES
    calls = []
    get_into, put_from = store.client.get_into, store.client.put_from
    store.client.get_into = lambda names, ptrs, sizes: calls.append(("get", sizes)) or get_into(names, ptrs, sizes)
    store.client.put_from = lambda names, ptrs, sizes: calls.append(("set", sizes)) or put_from(names, ptrs, sizes)
    keys = page_keys(6)
    assert store.batch_set_v1(keys, slots(host, 0, 6)) == [True] * 6
    assert store.batch_get_v1(keys, slots(host, 8, 6)) == [True] * 6
    assert equal_pages(pages_of(host, 8, 6), pages_of(host, 0, 6))
    one = [[page + batch_plan.TRAILER_BYTES]] * 2  # each object one buffer: its payload and trailer
    assert calls == [("set", one)] * 3 + [("get", one)] * 3


def test_without_the_session_api(make_store):
    """A wheel without the session calls: batches go through the multi-buffer calls, same results."""
    host = host_pool(PoolKind.MHA)
    fill_random(host, seed=14)
    store = make_store(host)
    store.client.session_api = False
    keys = page_keys(3)
    assert store.batch_set_v1(keys[:2], slots(host, 0, 2)) == [True] * 2
    assert store.batch_get_v1(keys, slots(host, 8, 3)) == [True, True, False]
    assert equal_pages(pages_of(host, 8, 2), pages_of(host, 0, 2))


class _Wrapped:
    """The client's Mooncake store with some calls replaced (pybind objects take no setattr)."""

    def __init__(self, store, **calls):
        self._store, self._calls = store, calls

    def __getattr__(self, name):
        return self._calls.get(name) or getattr(self._store, name)


def test_a_torn_write_is_revoked_never_readable(make_store):
    """A put whose ranged write fails for one object (or raises) revokes that object's session:
    nothing readable is left under its key, and the next backup stores it."""
    host = host_pool(PoolKind.MHA)
    fill_random(host, seed=15)
    store = make_store(host)
    raw = store.client.store
    keys = page_keys(4)

    def lose_second(keys_, ptrs, sizes, offsets):  # the other objects are written, the second is not
        codes = raw.batch_put_from_multi_buffer_ranges(keys_[:1] + keys_[2:], ptrs[:1] + ptrs[2:],
                                                       sizes[:1] + sizes[2:], offsets[:1] + offsets[2:])
        return codes[:1] + [-800] + codes[1:]  # TRANSFER_FAIL

    def explode(*args):
        raise RuntimeError("the write raised")

    store.client.store = _Wrapped(raw, batch_put_from_multi_buffer_ranges=lose_second)
    assert store.batch_set_v1(keys[:3], slots(host, 0, 3)) == [True, False, True]
    store.client.store = _Wrapped(raw, batch_put_from_multi_buffer_ranges=explode)
    assert store.batch_set_v1(keys[3:], slots(host, 3, 1)) == [False]
    store.client.store = raw
    assert [raw.is_exist(stored_key(store, k)) for k in keys] == [1, 0, 1, 0]
    assert store.batch_set_v1(keys, slots(host, 0, 4)) == [True] * 4  # no reservation left behind
    assert store.batch_get_v1(keys, slots(host, 8, 4)) == [True] * 4
    assert equal_pages(pages_of(host, 8, 4), pages_of(host, 0, 4))


def test_a_page_stored_after_the_size_query_is_a_miss(make_store):
    """The size query (which answers {} when the master is gone) misses a key that the session
    start then finds: a miss that leaves its slots alone, without a failure."""
    host = host_pool(PoolKind.MHA)
    fill_random(host, seed=16)
    store = make_store(host)
    keys = page_keys(2)
    assert store.batch_set_v1(keys, slots(host, 0, 2)) == [True] * 2
    raw = store.client.store
    late = stored_key(store, keys[1])
    store.client.store = _Wrapped(raw, batch_get_replica_desc=lambda ks: {
        k: v for k, v in raw.batch_get_replica_desc(ks).items() if k != late})
    before = pages_of(host, 9, 1)[0]
    assert store.batch_get_v1(keys, slots(host, 8, 2)) == [True, False]
    assert torch.equal(pages_of(host, 9, 1)[0], before)
    store.client.store = raw
    assert store.batch_get_v1(keys[1:], slots(host, 9, 1)) == [True]  # its session was ended
    assert (store.get_stats()["corruptions"], store.get_stats()["failures"]) == (0, 0)


class FlatPool:
    """An upstream-style host pool (flat pages only, no buffer meta): moved staged."""

    def __init__(self, page_size=2, size=16, width=8, seed=0):
        self.page_size, self.size = page_size, size
        self.data = torch.randn(size, width, generator=torch.Generator().manual_seed(seed))

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.page_size * self.data.shape[1])

    def get_data_page(self, index, flat=True):
        return self.data[index : index + self.page_size].reshape(-1).clone()

    def set_from_flat_data_page(self, index, page):
        self.data[index : index + self.page_size] = page.reshape(self.page_size, -1)


def test_staged_upstream_style_pool_round_trips(make_store):
    kv = host_pool(PoolKind.MHA)
    store = make_store(kv)
    flat = FlatPool()
    store.register_mem_host_pool_v2(flat, PoolName.MAMBA)
    keys = page_keys(2)
    assert store.batch_set_v2([PoolTransfer(PoolName.MAMBA, torch.arange(0, 4), keys)]) == {PoolName.MAMBA: [True] * 2}
    assert store.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.arange(8, 12), keys)]) == {PoolName.MAMBA: [True] * 2}
    assert torch.equal(flat.data[8:12], flat.data[0:4])


def test_two_clients_share_one_master(make_store):
    a_host, b_host = host_pool(PoolKind.MHA), host_pool(PoolKind.MHA)
    fill_random(a_host, seed=8)
    fill_random(b_host, seed=9)
    a = make_store(a_host, salt="shared")
    b = make_store(b_host, salt="shared", segment=0)  # B holds no segment: every page lives in A's
    keys = page_keys(4, salt="shared-pages")
    assert a.batch_set_v1(keys, slots(a_host, 0, 4)) == [True] * 4
    assert b.batch_exists(keys) == 4
    assert b.batch_get_v1(keys, slots(b_host, 8, 4)) == [True] * 4
    assert equal_pages(pages_of(b_host, 8, 4), pages_of(a_host, 0, 4))
    assert b.batch_set_v1(keys[:1], slots(b_host, 0, 1)) == [True]  # already stored: A's page stays
    assert a.batch_get_v1(keys[:1], slots(a_host, 8, 1)) == [True]
    assert torch.equal(pages_of(a_host, 8, 1)[0], pages_of(a_host, 0, 1)[0])


WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import fill_random, host_pool, page_keys, slots, storage_config
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
host = host_pool(PoolKind.MHA)
fill_random(host, seed=11)
store = StorageBackendFactory.create_backend("mooncake", storage_config(host, {extra!r}), host)
print(store.batch_set_v1(page_keys(4, salt="peer"), slots(host, 0, 4)), flush=True)
time.sleep(600)
"""


def test_silent_peer_is_a_bounded_miss(make_store):
    """The pages live in another process's segment; that process stops answering (SIGSTOP): a
    get misses within the transfer bound and leaves no byte behind. (Its own master: the dead
    peer's segment stays mounted until the master's client TTL passes.)"""
    with MooncakeMaster() as own:
        extra = own.extra_config(transfer_timeout_s=TIMEOUT_S, namespace_salt="peer")
        code = WRITER.format(tests=os.path.dirname(os.path.abspath(__file__)), extra=extra)
        peer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        try:
            assert peer.stdout.readline().strip() == str([True] * 4)
            host = host_pool(PoolKind.MHA)
            reader = make_store(host, on=own, salt="peer", segment=0)
            keys = page_keys(4, salt="peer")
            assert reader.batch_get_v1(keys[:1], slots(host, 8, 1)) == [True]
            fill_random(host, seed=12)
            before = pages_of(host, 9, 3)
            os.kill(peer.pid, signal.SIGSTOP)
            start = time.monotonic()
            flags = reader.batch_get_v1(keys[1:], slots(host, 9, 3))
            elapsed = time.monotonic() - start
            assert flags == [False] * 3 and elapsed < 4 * TIMEOUT_S, (flags, elapsed)
            for got, old in zip(pages_of(host, 9, 3), before):
                assert int(got.count_nonzero()) == 0 or torch.equal(got, old)
            assert reader.get_stats()["failures"] >= 1 and reader.get_stats()["corruptions"] == 0
            reader.close()  # while its master runs
        finally:
            os.kill(peer.pid, signal.SIGKILL)
            peer.wait(timeout=30)


def test_master_killed_then_restarted(make_store):
    with MooncakeMaster() as own:
        host = host_pool(PoolKind.MHA)
        fill_random(host, seed=13)
        store = make_store(host, on=own)
        keys = page_keys(4)
        assert store.batch_set_v1(keys[:2], slots(host, 0, 2)) == [True] * 2
        own.kill()
        for call in (lambda: store.batch_exists(keys), lambda: store.batch_get_v1(keys[:2], slots(host, 8, 2)),
                     lambda: store.batch_set_v1(keys[2:], slots(host, 2, 2)), lambda: store.batch_exists(keys)):
            start = time.monotonic()
            result = call()
            assert result in (0, [False, False]) and time.monotonic() - start < DEAD_MASTER_BOUND_S
        assert store.get_stats()["timeouts"] >= 1
        own.start()  # same ports, empty store: the client remounts its segment by itself
        deadline = time.monotonic() + 60
        while store.batch_set_v1(keys, slots(host, 0, 4)) != [True] * 4:
            assert time.monotonic() < deadline, "no recovery within 60 s of the master's restart"
            time.sleep(0.2)
        assert store.batch_exists(keys) == 4
        assert store.batch_get_v1(keys, slots(host, 8, 4)) == [True] * 4
        assert equal_pages(pages_of(host, 8, 4), pages_of(host, 0, 4))
        store.close()  # while its master runs (closing against a dead one waits out Mooncake's retries)
