"""A truncated, zero-length or bit-flipped stored page is a miss: detected, counted, removed,
and never loaded (the target host slots never hold a wrong byte)."""

import numpy as np
import pytest
import torch
from conftest import BACKENDS, fill_random, host_pool, page_keys, pages_of, s3_client, slots

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.storage.integrity import (
    Checksum,
    available,
    pack_trailer,
    page_digest,
    page_is_whole,
    payload_checksum,
    poison_trailer,
    read_trailer,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="per-commit-cpu")


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _zero_length(data: bytes) -> bytes:
    return b""


def _flip_payload(data: bytes) -> bytes:
    return _flip(data, 5)


def _flip(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 0x80]) + data[i + 1 :]


def _flip_trailer_padding(data: bytes) -> bytes:
    return _flip(data, len(data) - 50)  # the trailer's zero padding, just before its header


def _flip_trailer_header(data: bytes) -> bytes:
    return _flip(data, len(data) - 7)


def _append(data: bytes) -> bytes:
    return data + b"\0"


CORRUPTIONS = [_truncate, _zero_length, _flip_payload, _flip_trailer_padding, _flip_trailer_header, _append]


class StoredObject:
    """Read and replace one stored object, whatever the backend keeps it in."""

    def __init__(self, store, name):
        self.store, self.name = store, name
        side = getattr(store, "side", None)
        self.bucket = side.params["bucket"] if side is not None and hasattr(side, "params") else None
        if self.bucket is None:
            self.path = store.files.path(name) if hasattr(store, "files") else side.get_file_path(name)

    def _s3(self):
        return s3_client(self.store.options.plugin_params["endpoint_override"])

    def read(self) -> bytes:
        if self.bucket:
            return self._s3().get_object(Bucket=self.bucket, Key=self.name)["Body"].read()
        with open(self.path, "rb") as f:
            return f.read()

    def write(self, data: bytes) -> None:
        if self.bucket:
            self._s3().put_object(Bucket=self.bucket, Key=self.name, Body=data)
        else:
            with open(self.path, "wb") as f:
                f.write(data)

    def exists(self) -> bool:
        if self.bucket:
            listed = self._s3().list_objects_v2(Bucket=self.bucket, Prefix=self.name)
            return any(o["Key"] == self.name for o in listed.get("Contents", []))
        import os

        return os.path.exists(self.path)


CASES = [(b, c) for b in BACKENDS for c in CORRUPTIONS if (b, c) != ("nixl_obj", _append)]


@pytest.mark.parametrize("backend_name,corrupt", CASES, ids=lambda v: v if isinstance(v, str) else v.__name__.strip("_"))
def test_corrupted_page_is_a_counted_removed_miss(backend_name, corrupt, make_backend):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=7)
    store = make_backend(backend_name, host)
    keys = page_keys(3)
    assert all(store.batch_set_v1(keys, slots(host, 0, 3)))
    obj = StoredObject(store, store.codecs[PoolName.KV].object_names(keys[1])[0])
    obj.write(corrupt(obj.read()))
    before = pages_of(host, 8, 3)
    got = store.batch_get_v1(keys, slots(host, 8, 3))
    assert got == [True, False, True]
    assert torch.equal(host.get_data_page(8 * host.page_size), host.get_data_page(0))
    target = host.get_data_page(9 * host.page_size)
    assert torch.equal(target, before[1]) or int(target.count_nonzero()) == 0  # untouched or wiped
    stats = store.get_stats()
    assert stats["corruptions"] == 1 and stats["pages_missed"] == 1
    assert not obj.exists()
    assert store.batch_exists(keys) == 1
    # A fresh write repairs the page.
    assert store.batch_set_v1(keys[1:2], slots(host, 1, 1)) == [True]
    assert store.batch_get_v1(keys, slots(host, 8, 3)) == [True] * 3


def test_corruption_inside_a_batch_on_several_io_threads(make_backend):
    """With io_threads the file backend spreads the pages of a batch over several threads: each
    page still gets its own flag, and a bad one is wiped, counted and removed, the rest intact."""
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=12)
    store = make_backend("file", host, {"io_threads": 3})
    store.files.workers.min_page_bytes = 0  # the test's pages are small; thread them anyway
    keys = page_keys(6)
    assert store.batch_set_v1(keys, slots(host, 0, 6)) == [True] * 6
    names = store.codecs[PoolName.KV].object_names
    for i, corrupt in ((1, _flip_payload), (4, _truncate)):
        obj = StoredObject(store, names(keys[i])[0])
        obj.write(corrupt(obj.read()))
    assert store.batch_get_v1(keys, slots(host, 8, 6)) == [True, False, True, True, False, True]
    for i in (0, 2, 3, 5):
        assert torch.equal(host.get_data_page((8 + i) * host.page_size), host.get_data_page(i * host.page_size))
    for i in (1, 4):
        assert int(host.get_data_page((8 + i) * host.page_size).count_nonzero()) == 0  # read, failed, wiped
    stats = store.get_stats()
    assert (stats["pages_hit"], stats["pages_missed"], stats["corruptions"]) == (4, 2, 2)
    assert store.batch_exists(keys) == 1


@pytest.mark.parametrize("backend_name", ["file", "nixl_posix"])
def test_short_file_is_caught_by_exists(backend_name, make_backend):
    host = host_pool(PoolKind.MLA, "page_first_direct")
    store = make_backend(backend_name, host)
    keys = page_keys(4)
    assert all(store.batch_set_v1(keys, slots(host, 0, 4)))
    obj = StoredObject(store, store.codecs[PoolName.KV].object_names(keys[2])[0])
    obj.write(_truncate(obj.read()))
    assert store.batch_exists(keys) == 2
    assert store.get_stats()["corruptions"] == 1 and not obj.exists()


def test_object_renamed_under_another_key_is_refused(make_backend):
    """The trailer binds an object to its name: a valid page copied to another key is a miss."""
    host = host_pool(PoolKind.MLA, "page_first_direct")
    fill_random(host, seed=8)
    store = make_backend("nixl_posix", host)
    keys = page_keys(2)
    assert all(store.batch_set_v1(keys, slots(host, 0, 2)))
    names = [store.codecs[PoolName.KV].object_names(k)[0] for k in keys]
    StoredObject(store, names[1]).write(StoredObject(store, names[0]).read())
    assert store.batch_get_v1(keys, slots(host, 8, 2)) == [True, False]
    assert store.get_stats()["corruptions"] == 1


def test_obj_bytes_after_a_valid_trailer_are_ignored(make_backend):
    """The OBJ plugin reports no object sizes, so bytes appended after a valid page cannot be
    seen; the page read is still exactly the verified one (never a wrong byte)."""
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=9)
    store = make_backend("nixl_obj", host)
    keys = page_keys(2)
    assert all(store.batch_set_v1(keys, slots(host, 0, 2)))
    obj = StoredObject(store, store.codecs[PoolName.KV].object_names(keys[1])[0])
    obj.write(_append(obj.read()))
    assert store.batch_get_v1(keys, slots(host, 8, 2)) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, 8, 2), pages_of(host, 0, 2)))


@pytest.mark.parametrize("backend_name", ["nixl_posix", "nixl_obj"])
def test_torn_page_from_two_writes_is_a_miss(backend_name, make_backend):
    """K from one write of a page and V from another write of it: each object is whole, the
    page is not. The page digest in every trailer catches it."""
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=10)
    store = make_backend(backend_name, host)
    key = page_keys(1)
    k_name = store.codecs[PoolName.KV].object_names(key[0])[0]
    assert store.batch_set_v1(key, slots(host, 0, 1)) == [True]
    k_of_first_write = StoredObject(store, k_name).read()
    assert store.batch_set_v1(key, slots(host, 1, 1)) == [True]
    StoredObject(store, k_name).write(k_of_first_write)
    before = host.get_data_page(8 * host.page_size)
    assert store.batch_get_v1(key, slots(host, 8, 1)) == [False]
    target = host.get_data_page(8 * host.page_size)
    assert torch.equal(target, before) or int(target.count_nonzero()) == 0  # untouched or wiped
    assert store.get_stats()["corruptions"] == 2  # both objects of the torn page removed
    assert store.batch_exists(key) == 0


@pytest.mark.parametrize("algo", list(Checksum), ids=lambda a: a.name)
def test_trailer_checks_every_byte_with_either_checksum(algo):
    if not available(algo):
        pytest.skip(f"{algo.name} needs the xxhash package")
    payload = [np.arange(300, dtype=np.uint8), np.arange(77, dtype=np.uint8)]
    checksum = payload_checksum(payload, algo)
    digest = page_digest([checksum])
    trailer = np.frombuffer(pack_trailer("obj_k", 377, checksum, digest, 4096, algo), dtype=np.uint8).copy()
    assert read_trailer(trailer, "obj_k", payload) == (checksum, digest)
    assert page_is_whole([(checksum, digest)]) and not page_is_whole([(checksum, digest + 1)])
    assert read_trailer(trailer, "obj_v", payload) is None  # bound to its name
    assert read_trailer(trailer, "obj_k", payload[:1]) is None  # bound to its length
    for i in (0, 2000, 4095):  # padding, padding, header
        flipped = trailer.copy()
        flipped[i] ^= 1
        assert read_trailer(flipped, "obj_k", payload) is None
    poisoned = trailer.copy()
    poison_trailer(poisoned)
    assert read_trailer(poisoned, "obj_k", payload) is None
