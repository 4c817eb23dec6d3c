"""MooncakeStore: L3 pages in a Mooncake distributed store shared by many servers.

A key's page of one pool is one store object, ``flat page || 64-byte integrity trailer``
(``integrity.py``), named as every backend names it (``storage/keys.py``) under the client's
key prefix. Pages move zero-copy: the host pools' buffers are registered with Mooncake, and a
batch goes out in one put session (one ranged write of every object, gathered from its host
chunks plus its trailer in a registered trailer area) and comes back in one get session (one
ranged read, scattered into the same places; see ``store_client.py``), then every page is
verified at once (``batch_trailers.py``). Small pages of one host chunk travel through a
registered staging area instead, payload and trailer in one buffer (``batch_plan.py``). A page that fails verification (torn, corrupt, of
another length, written by a foreign writer) is a miss: zeroed in host memory, removed from the
store, counted. So is a page the store evicted between exists and get (Mooncake answers
OBJECT_NOT_FOUND, or a lease expired mid-read and the bytes fail their checksum). Upstream-style
pools without registered buffers (staged) go through Mooncake's local buffer instead.

Mooncake keeps the first write of a key: a set of a page that is already stored succeeds
without rewriting it (pages are named by their content's prefix, so both writes hold the same
bytes; a corrupt one is removed on read and rewritten by the next backup).
See ``README.md`` beside this file for configuration and failure handling.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from sglang.srt.mem_cache.hicache_storage import PagedStorage
from sglang.srt.mem_cache.storage import batch_trailers
from sglang.srt.mem_cache.storage.integrity import page_is_whole, read_trailer
from sglang.srt.mem_cache.storage import native_io
from sglang.srt.mem_cache.storage.mooncake_store import batch_plan
from sglang.srt.mem_cache.storage.mooncake_store.batch_plan import (
    TRAILER_BYTES,
    Batch,
    StagingArea,
    TrailerArea,
    plan,
    split,
    stages,
)
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_config import parse_mooncake_options
from sglang.srt.mem_cache.storage.mooncake_store.store_client import MooncakeClient, MooncakeUnavailable, Outcome
from sglang.srt.mem_cache.storage.pool_codec import PageIO, PoolCodec

logger = logging.getLogger(__name__)

# Objects per Mooncake call (rows of a trailer area). One call per batch: over TCP the transfer
# dominates (hashing a page costs ~5% of moving it), and splitting a batch into several calls
# to overlap hashing with the next call's transfer measured slower (each call pays the master's
# round trip and its own transfer setup).
OBJECTS_PER_BATCH = 512


def _zero_copy(page: PageIO) -> bool:
    return page.codec.is_marker or not page.codec.shape.staged


class MooncakeStore(PagedStorage):
    object_format = f"mooncake-page/t{TRAILER_BYTES}"
    per_component = False

    def __init__(self, storage_config, mem_pool_host=None):
        self.options = parse_mooncake_options(storage_config.extra_config)
        super().__init__(storage_config)
        c = storage_config
        segment = self.options.segment_bytes(c.tp_size, c.pp_size)
        self.client = MooncakeClient(self.options, segment, self.options.device_for(c.tp_rank))
        self._get_area, self._set_area = TrailerArea(OBJECTS_PER_BATCH), TrailerArea(OBJECTS_PER_BATCH)
        for area in (self._get_area, self._set_area):
            self.client.register(area.address, area.nbytes)
        self._get_stage: StagingArea | None = None  # allocated when a pool has objects to stage
        self._set_stage: StagingArea | None = None
        self._get_lock, self._set_lock = threading.Lock(), threading.Lock()
        logger.info("MooncakeStore: master %s (settings from %s), %s, segment %.2f GiB, transfer bound %.0fs",
                    self.options.master_server_address, self.options.source, self.options.protocol,
                    segment / (1 << 30), self.options.transfer_timeout_s)
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    def _on_register(self, codec: PoolCodec) -> None:
        for buf in codec.host_buffers():
            self.client.register(buf.data_ptr(), buf.numel() * buf.element_size())
        if (self._get_stage is None and native_io.HASH and not codec.is_marker and not codec.shape.staged
                and any(stages(s.nbytes, s.num_chunks * codec.pages_per_key) for s in codec.segments)):
            self._get_stage, self._set_stage = StagingArea(batch_plan.STAGING_BYTES), StagingArea(batch_plan.STAGING_BYTES)
            for area in (self._get_stage, self._set_stage):
                self.client.register(area.address, area.nbytes)

    # ---- existence ----------------------------------------------------------------------
    def _exists_objects(self, codec: PoolCodec, names: list[str]) -> list[bool]:
        outcomes = self.client.exists(names)
        if Outcome.UNAVAILABLE in outcomes:
            raise MooncakeUnavailable("Mooncake exists: master unreachable")
        if Outcome.FAILED in outcomes:
            self.stats.add(failures=1)
        return [o is Outcome.OK for o in outcomes]

    # ---- read ---------------------------------------------------------------------------
    def _read_pages(self, pages: list[PageIO]) -> list[bool]:
        done: dict[int, bool] = {}
        direct = [p for p in pages if _zero_copy(p)]
        with self._get_lock:
            stage = self._get_stage
            for run in split(direct, OBJECTS_PER_BATCH, stage.nbytes if stage else 0):
                batch = plan(run, self._get_area.rows, stage)
                batch.poison()  # a short read cannot leave an earlier valid header behind
                self._settle_read(batch, self.client.get_into(batch.names, batch.ptrs, batch.sizes), done)
        for page in pages:
            if not _zero_copy(page):
                done[id(page)] = self._read_staged(page)
        return [done[id(p)] for p in pages]

    def _settle_read(self, batch: Batch, outcomes: list[Outcome], done: dict[int, bool]) -> None:
        """Verify a batch read (one hash pass, one trailer comparison); deliver the staged objects
        of whole pages into host memory; settle failed pages."""
        moved = [o is Outcome.OK for o in outcomes]
        batch.take_trailers()
        good = [m and v for m, v in zip(moved, batch.verified(batch.checksums()))]
        flags = batch.page_flags(good)
        batch.deliver([ok for ok, n in zip(flags, batch.per_page) for _ in range(n)])
        i = 0
        for page, n, ok in zip(batch.pages, batch.per_page, flags):
            if not ok:
                self._settle_failed(page, batch.names[i : i + n], batch.nbytes[i : i + n], outcomes[i : i + n])
            done[id(page)] = ok
            i += n

    def _settle_failed(self, page: PageIO, names: list[str], nbytes: list[int], outcomes: list[Outcome]) -> None:
        """A page that did not verify: absent (a miss), corrupt or of another length (removed),
        or not moved (a failure). Whatever may have reached host memory is wiped."""
        if all(o is Outcome.ABSENT for o in outcomes):
            return  # nothing was written into host memory
        page.zero()
        bad = [n for n, out in zip(names, outcomes) if out is Outcome.OK]  # moved, failed the check
        # Mooncake refuses an object of another length than the buffers (INVALID_PARAMS when it is
        # longer, TRANSFER_FAIL when shorter): its stored size tells a foreign object from a failure.
        bad += [n for n, size, out in zip(names, nbytes, outcomes) if out in (Outcome.WRONG_SIZE, Outcome.FAILED)
                and self.client.size_of(n) not in (None, size + TRAILER_BYTES)]
        if bad:
            self._drop(bad)
        if any(out in (Outcome.FAILED, Outcome.UNAVAILABLE) for out in outcomes):
            self.stats.add(failures=1, timeouts=int(Outcome.UNAVAILABLE in outcomes))

    def _drop(self, names: list[str]) -> None:
        self.stats.add(corruptions=len(names))
        logger.warning("MooncakeStore: %d objects failed their integrity check; removed (first: %s)", len(names),
                       names[0])
        self.client.remove(names)

    def _read_staged(self, page: PageIO) -> bool:
        """A staged pool's page through Mooncake's local buffer, verified before the copy."""
        results, payloads = [], []
        for obj in page.objects:
            data = memoryview(self.client.get_bytes(obj.name))
            if len(data) == 0:
                return False  # absent
            whole = len(data) == obj.nbytes + TRAILER_BYTES
            payload = data[: obj.nbytes]
            results.append(read_trailer(data[obj.nbytes :], obj.name, [payload], obj.nbytes) if whole else None)
            payloads.append(payload)
        if not page_is_whole(results):
            self._drop([o.name for o in page.objects])
            return False
        for obj, payload in zip(page.objects, payloads):
            start = 0
            for view in obj.views:
                view[:] = np.frombuffer(payload[start : start + view.nbytes], dtype=np.uint8)
                start += view.nbytes
        return True

    # ---- write --------------------------------------------------------------------------
    def _write_pages(self, pages: list[PageIO]) -> list[bool]:
        done: dict[int, bool] = {}
        direct = [p for p in pages if _zero_copy(p)]
        with self._set_lock:
            stage = self._set_stage
            for run in split(direct, OBJECTS_PER_BATCH, stage.nbytes if stage else 0):
                batch = plan(run, self._set_area.rows, stage)
                if batch.staged is not None:
                    batch.staged.fill()  # the bytes hashed are the bytes sent
                batch.set_trailers(batch.trailers(batch.checksums()))
                outcomes = self.client.put_from(batch.names, batch.ptrs, batch.sizes)
                if any(o is not Outcome.OK for o in outcomes):
                    self.stats.add(failures=1, timeouts=int(Outcome.UNAVAILABLE in outcomes))
                for page, ok in zip(batch.pages, batch.page_flags([o is Outcome.OK for o in outcomes])):
                    done[id(page)] = ok
        for page in pages:
            if not _zero_copy(page):
                done[id(page)] = self._write_staged(page)
        return [done[id(p)] for p in pages]

    def _write_staged(self, page: PageIO) -> bool:
        objs = page.objects
        sums = batch_trailers.checksums([o.views for o in objs])
        trailers = batch_trailers.build([o.name for o in objs], [o.nbytes for o in objs], sums,
                                        batch_trailers.digests(sums, [len(objs)]), TRAILER_BYTES)
        outcomes = [self.client.put_parts(o.name, [*o.views, t.tobytes()]) for o, t in zip(objs, trailers)]
        if any(o is not Outcome.OK for o in outcomes):
            self.stats.add(failures=1, timeouts=int(Outcome.UNAVAILABLE in outcomes))
        return all(o is Outcome.OK for o in outcomes)

    # ---- lifecycle ----------------------------------------------------------------------
    def clear(self) -> None:
        """Remove every page of this fork from the store (every deployment sharing it)."""
        if not self._closed:
            self.client.clear()

    def _close(self) -> None:
        with self._get_lock, self._set_lock:
            self.client.close()
