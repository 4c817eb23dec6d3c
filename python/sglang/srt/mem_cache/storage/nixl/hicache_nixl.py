"""HiCacheNixl: L3 pages through a NIXL agent (POSIX files or an S3-compatible OBJ bucket).

Every page of every registered pool is one object per component (``_k``/``_v``,
``_mamba_temporal``, ``_mamba_conv_<i>``, ``_indexer_k``/``_indexer_v``, ``_marker`` for the
logical anchor), each ``payload || 4096-byte integrity trailer``. A batch of pages, whatever
pools they belong to, moves in one NIXL transfer per direction (per chunk of at most
``bounce_pages`` pages and CHUNK_BYTES).
NIXL's result is all-or-nothing, so when a chunk fails it is retried page by page to find the
culprits: a wrong-sized object is a corruption (removed), anything else a counted failure.
Batches of several zero-copy file chunks run in two lanes, each with its own agent
(``_read_lanes``, ``_write_lanes``). See ``README.md`` beside this file.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PagedStorage, StorageBackendError
from sglang.srt.mem_cache.storage import batch_trailers
from sglang.srt.mem_cache.storage.integrity import page_is_whole
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.storage.nixl import batch_path
from sglang.srt.mem_cache.storage.nixl.bounded_calls import StorageUnavailable
from sglang.srt.mem_cache.storage.nixl.capacity import StoreCapacity, group_of
from sglang.srt.mem_cache.storage.nixl.nixl_config import StorageKind, parse_nixl_options
from sglang.srt.mem_cache.storage.nixl.nixl_io import NixlIO
from sglang.srt.mem_cache.storage.nixl.nixl_utils import NixlFileManager, NixlObjStore
from sglang.srt.mem_cache.storage.nixl.pool_context import NixlPoolContext, build_context
from sglang.srt.mem_cache.storage.nixl.transfer_plan import Item, Planned, SlotCounter, descriptors
from sglang.srt.mem_cache.storage.pool_codec import PageIO, PoolCodec

logger = logging.getLogger(__name__)

TRAILER_BYTES = 4096
# A chunk is verified after its transfer (by its lane, while the other lane moves the next one).
# Each chunk costs a fixed ~0.2 ms of planning, registration and verification: with the
# batch path, 32 MiB chunks read 1 MiB pages at 0.55-0.57x of plain preadv against 0.48x with 8 MiB
# ones (bench_storage.py).
CHUNK_BYTES = 32 << 20
# Whether a missing object must be ruled out before a READ (OBJ fails the whole transfer on one;
# for files, opening them tells).
PRECHECK_READS = {StorageKind.FILE: False, StorageKind.OBJ: True}
POSIX_ENGINES = ("use_uring", "use_aio", "use_posix_aio")


class HiCacheNixl(PagedStorage):
    """The NIXL backend. ``HiCacheNixl(storage_config, file_path=...)`` as upstream: the storage
    directories are the extra config's ``storage_dir`` / ``storage_dirs``, else
    ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR``, else ``file_path`` (comma-separated), else
    <tempdir>/hicache_storage-<uid> (private). Upstream's attribute names hold: ``agent`` (the NIXL agent),
    ``file_manager`` (None for OBJ), ``needs_page_alignment``, ``is_zero_copy`` (of the KV pool),
    ``_hybrid_pool_ctx`` (per pool, KV included), ``backup_skip``."""

    object_format = f"nixl-component/t{TRAILER_BYTES}"
    per_component = True

    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str | None = None):
        self.options = parse_nixl_options(storage_config.extra_config, file_path)
        kind = self.options.spec.kind
        if kind is StorageKind.FILE:
            dirs_key = "storage_dirs" if len(self.options.storage_dirs) > 1 else "storage_dir"
            self.file_manager = NixlFileManager(list(self.options.storage_dirs), self.options.use_direct_io, dirs_key)
            self.side = self.file_manager
        else:
            self.file_manager = None
            self.side = NixlObjStore(self.options)
        self.is_zero_copy = False  # the KV pool's mode, set when it registers
        self.grouped_names = kind is StorageKind.FILE  # page groups: one directory, evicted together
        self.precheck_reads = PRECHECK_READS[kind]
        self.io = NixlIO(self.options, self._preferred_params())
        # The second lanes' agent (_read_lanes, _write_lanes), made with the first zero-copy
        # pool: one agent serialises its transfers (two threads on one agent ran slower than
        # one), two agents copy in parallel.
        self.io_alt: NixlIO | None = None
        self.contexts: dict[PoolName, NixlPoolContext] = {}
        self._read_lock = threading.Lock()
        self._write_lock = threading.Lock()
        # the second lane of reads and of writes (threads start on first use)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-nixl-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-nixl-write")
        self.capacity = None
        super().__init__(storage_config)
        if kind is StorageKind.FILE:
            c = storage_config
            self.capacity = StoreCapacity(self.side, self.options, evicts=(c.tp_rank, c.pp_rank, c.attn_cp_rank) == (0, 0, 0),
                                          shared=c.tp_size * c.pp_size * c.attn_cp_size > 1, stats=self.stats)

    @property
    def agent(self):
        """The NIXL agent of the first lane (upstream's attribute)."""
        return self.io.agent

    @property
    def needs_page_alignment(self) -> bool:
        """O_DIRECT was asked for on a file plugin (upstream's flag; whether a pool uses it
        also depends on the filesystem and the pool's alignment: its context's ``direct``)."""
        return self.options.use_direct_io and self.file_manager is not None

    @property
    def _hybrid_pool_ctx(self) -> dict[PoolName, NixlPoolContext]:
        """Upstream's name of the per-pool contexts (ours include the KV pool's)."""
        return self.contexts

    def _preferred_params(self) -> tuple[dict, ...]:
        """With O_DIRECT possible and no I/O engine chosen, try io_uring first: the POSIX
        plugin's default (Linux AIO) writes new O_DIRECT files ~50x slower here."""
        params = self.options.plugin_params
        if self.side.use_direct_io and not set(params) & set(POSIX_ENGINES):
            return ({**params, "use_uring": "true"},)
        return ()

    def _on_register(self, codec: PoolCodec) -> None:
        ctx = build_context(codec, self.options, self.side.use_direct_io, TRAILER_BYTES)
        self.io.register_dram([a.tensor for a in (ctx.set_area, ctx.get_area, ctx.get_area_alt) if a is not None])
        if ctx.is_zero_copy:
            self.io.register_dram(codec.host_buffers())
            if self.options.spec.kind is StorageKind.FILE:  # what the second lanes move
                if self.io_alt is None:
                    self.io_alt = NixlIO(self.options, self._preferred_params())
                self.io_alt.register_dram([ctx.get_area_alt.tensor, ctx.set_area_alt.tensor, *codec.host_buffers()])
        self.contexts[codec.name] = ctx
        if codec.name is PoolName.KV:
            self.is_zero_copy = ctx.is_zero_copy

    def host_writes_settled(self) -> bool:
        """A zero-copy READ that timed out stays registered until NIXL reports it ended, and may
        write the host pool until then (``NixlIO.transfer``); bounce reads land in the get areas,
        which no call uses while one is overdue (``BoundedCalls``)."""
        if not any(ctx.is_zero_copy for ctx in self.contexts.values()):
            return True
        return not any(io.calls.unavailable for io in (self.io, self.io_alt) if io is not None)

    # ---- existence ----------------------------------------------------------------------
    def _exists_objects(self, codec: PoolCodec, names: list[str]) -> list[bool]:
        expected = [s.nbytes + TRAILER_BYTES for s in codec.segments] * (len(names) // len(codec.segments))
        out = []
        for name, size, want in zip(names, self.side.sizes(self.io, names), expected):
            if size is not None and size not in (-1, want):  # truncated, zero-length or grown
                self._drop(name)
                size = None
            out.append(size is not None)
        return out

    def _drop(self, name: str) -> None:
        self.stats.add(corruptions=1)
        logger.warning("HiCacheNixl: %s failed its integrity check; removed", name)
        self.side.remove(name)
        if self.capacity is not None:
            self.capacity.forget(name)

    # ---- moving planned pages -----------------------------------------------------------
    def _chunks(self, pages: list[PageIO]):
        """Consecutive runs of at most ``bounce_pages`` pages and, beyond one page, CHUNK_BYTES of
        buffered objects (O_DIRECT objects never pass through the CPU cache, and a large chunk
        keeps the device's queue full)."""
        chunk, nbytes = [], 0
        for page in pages:
            size = 0 if self.contexts[page.codec.name].direct else page.nbytes + TRAILER_BYTES * len(page.names)
            if chunk and (len(chunk) == self.options.bounce_pages or nbytes + size > CHUNK_BYTES):
                yield chunk
                chunk, nbytes = [], 0
            chunk.append(page)
            nbytes += size
        if chunk:
            yield chunk

    def _move(self, op: str, planned: list[Planned]) -> list[bool]:
        """One transfer for every planned page; on failure, page by page to isolate the bad ones
        (not when the endpoint is unavailable: every page would wait out the timeout again)."""
        if not planned:
            return []
        try:
            self.io.transfer(op, *descriptors(planned))
            return [True] * len(planned)
        except StorageUnavailable as exc:
            self.stats.add(failures=1, timeouts=1)
            logger.debug("HiCacheNixl: %s of %d pages: %s", op, len(planned), exc)
            return [False] * len(planned)
        except StorageBackendError as exc:
            if len(planned) > 1:
                logger.info("HiCacheNixl: %s of %d pages failed (%s); retrying page by page", op, len(planned), exc)
                return [self._move(op, [p])[0] for p in planned]
            self._explain_failure(op, planned[0][1], exc)
            return [False]

    def _explain_failure(self, op: str, items: list[Item], exc: Exception) -> None:
        if op == "READ":
            for item in items:
                size = self.side.stored_size(item.obj.name)
                if size is not None and size != item.stored_bytes:
                    self._drop(item.obj.name)
                    return
        self.stats.add(failures=1)
        logger.warning("HiCacheNixl: %s of %s failed: %s", op, items[0].obj.name if items else "?", exc)

    # ---- read ---------------------------------------------------------------------------
    def _read_pages(self, pages: list[PageIO]) -> list[bool]:
        """Chunk after chunk; with zero-copy pools only, two lanes: on files, each with its own
        agent and get area, reading and verifying every other chunk (``_read_lanes``); else the
        next chunk moves on a reader thread (NIXL releases the GIL while it copies) while this
        thread verifies the previous one, each in its own get area."""
        with self._read_lock:
            done: dict[int, bool] = {}
            chunks = list(self._chunks(pages))
            if len(chunks) < 2 or not all(c.get_area_alt is not None for c in self.contexts.values()):
                for chunk in chunks:
                    self._settle_any(self._read_any(chunk), done)
                return [done.get(id(p), False) for p in pages]
            if self.io_alt is not None and all(batch_path.usable(self, c) for c in chunks):
                self._read_lanes(chunks, done)
                return [done.get(id(p), False) for p in pages]
            reader = self._reader
            future = reader.submit(self._read_any, chunks[0], False)
            try:
                for k in range(len(chunks)):
                    result = future.result()
                    if k + 1 < len(chunks):
                        future = reader.submit(self._read_any, chunks[k + 1], k % 2 == 0)
                    self._settle_any(result, done)
            finally:
                future.exception()  # never return while a transfer still writes host memory
            return [done.get(id(p), False) for p in pages]

    def _read_lanes(self, chunks: list[list[PageIO]], done: dict[int, bool]) -> None:
        """Chunks 1, 3, 5... on the reader thread (second agent, second get area), 0, 2, 4...
        here, each lane reading a chunk and then verifying it, so both cores copy and hash at
        once (NIXL and the hash release the GIL). A chunk that needs the per-object path goes
        through the first agent (thread-safe, only slower). Returns when both lanes are done:
        no thread still writes host memory then."""
        def lane(first: int) -> None:
            alt = first == 1
            io = self.io_alt if alt else self.io
            for k in range(first, len(chunks), 2):
                self._settle_any(batch_path.read_chunk(self, chunks[k], alt, io), done)

        _two_lanes(self._reader, lane)

    def _read_any(self, pages: list[PageIO], alt: bool = False):
        """Read one chunk by the batch path when it can take it (``batch_path``), else object
        by object."""
        if batch_path.usable(self, pages):
            return batch_path.read_chunk(self, pages, alt)
        return self._transfer_read(pages, alt)

    def _settle_any(self, result, done: dict[int, bool]) -> None:
        if not isinstance(result, batch_path.ReadChunk):
            self._settle_chunk(*result, done)
            return
        verified = batch_path.settle(result).tolist()
        rest, touched = [], []
        for page, ok, moved in zip(result.pages, verified, result.moved.tolist()):
            if ok:
                done[id(page)] = True
                touched.append(page.names[0])
                continue
            if moved:
                page.zero()  # unverified bytes never stay in the host pool, whatever the re-read finds
            rest.append(page)
        if self.capacity is not None and touched:
            self.capacity.touched(touched)
        if rest:  # absent, wrong-sized, failed or unverified: the per-object path classifies them
            self._settle_chunk(*self._transfer_read(rest, result.alt), done)

    def _settle_chunk(self, planned: list[Planned], moved: list[bool], done: dict[int, bool]) -> None:
        """Verify a read chunk (batch check, then page by page for the pages that failed it)."""
        good = self._batch_verified([pi for pi, ok in zip(planned, moved) if ok])
        touched = []
        for (page, items), ok in zip(planned, moved):
            if ok and id(page) in good:
                for item in items:
                    item.unbounce()
                touched.append(items[0].obj.name)
                done[id(page)] = True
            else:
                done[id(page)] = self._check_page(page, items, ok)
        if self.capacity is not None and touched:
            self.capacity.touched(touched)

    @staticmethod
    def _batch_verified(planned: list[Planned]) -> set[int]:
        """ids of the pages whose every object matches its one valid trailer (checked for the
        whole chunk at once, ``batch_trailers``); the others go through :meth:`_check_page`."""
        items = [item for _, page_items in planned for item in page_items]
        if not items:
            return set()
        sums = batch_trailers.checksums([item.payload() for item in items])
        digests = batch_trailers.digests(sums, [len(page_items) for _, page_items in planned])
        expected = batch_trailers.build([i.obj.name for i in items], [i.obj.nbytes for i in items], sums, digests,
                                        TRAILER_BYTES)
        good = batch_trailers.matches(np.stack([item.trailer for item in items]), expected).tolist()
        out, i = set(), 0
        for page, page_items in planned:
            if all(good[i : i + len(page_items)]):
                out.add(id(page))
            i += len(page_items)
        return out

    def _absent(self, pages: list[PageIO]) -> set[str]:
        if not self.precheck_reads:
            return set()
        names = [o.name for p in pages for o in p.objects]
        return {n for n, size in zip(names, self.side.sizes(self.io, names)) if size is None}

    def _open_page(self, page: PageIO, absent: set[str], counter: SlotCounter) -> list[Item] | None:
        """Open every object of ``page`` for reading; None (all closed) when one is absent or
        has the wrong size (a corruption, dropped)."""
        ctx, items = self.contexts[page.codec.name], []
        for obj in page.objects:
            target, size = (None, None) if obj.name in absent else self.side.open_read(obj.name, ctx.direct)
            if target is not None and size not in (-1, obj.nbytes + TRAILER_BYTES):
                self.side.finish(target, commit=False)
                self._drop(obj.name)
                target = None
            if target is None:
                for item in items:
                    self.side.finish(item.target, commit=False)
                return None
            items.append(counter.item(obj, ctx, target, False, TRAILER_BYTES))
            items[-1].prepare_read()
        return items

    def _transfer_read(self, pages: list[PageIO], alt: bool = False) -> tuple[list[Planned], list[bool]]:
        """Open and read one chunk into the (``alt``: second) get area; (planned pages,
        whether each one's transfer succeeded)."""
        absent, counter, planned = self._absent(pages), SlotCounter(alt), []
        try:
            for page in pages:
                items = self._open_page(page, absent, counter)
                if items is not None:
                    planned.append((page, items))
            moved = self._move("READ", planned)
        finally:
            for _, items in planned:
                for item in items:
                    self.side.finish(item.target, commit=False)
        return planned, moved

    def _check_page(self, page: PageIO, items: list[Item], ok: bool) -> bool:
        """Verify one read page and unbounce it, or wipe what an unverified read left."""
        ok = ok and self._verify(items)
        if ok:
            for item in items:
                item.unbounce()
            if self.capacity is not None:
                self.capacity.touched([items[0].obj.name])
        elif self.contexts[page.codec.name].is_zero_copy:
            page.zero()  # no unverified byte stays in the host pool
        return ok

    def _verify(self, items: list[Item]) -> bool:
        """Every object verifies and all come from one page write; bad objects are dropped."""
        results = [item.read_result() for item in items]
        if page_is_whole(results):
            return True
        whole_objects = all(r is not None for r in results)  # then: torn between two page writes
        for item, result in zip(items, results):
            if result is None or whole_objects:
                self._drop(item.obj.name)
        return False

    # ---- write --------------------------------------------------------------------------
    def _write_pages(self, pages: list[PageIO]) -> list[bool]:
        if getattr(self.side, "read_only", False):
            return [False] * len(pages)
        with self._write_lock:
            chunks = list(self._chunks(pages))
            results: list[list[bool] | None] = [None] * len(chunks)
            if len(chunks) > 1 and self.io_alt is not None and all(batch_path.usable(self, c) for c in chunks):
                self._write_lanes(chunks, results)
            else:
                for k, chunk in enumerate(chunks):
                    results[k] = self._write_one(chunk)
            return [ok for written in results for ok in written]

    def _write_one(self, chunk: list[PageIO], alt: bool = False) -> list[bool]:
        """Room, then the chunk by the batch path (``alt``: the second agent and set area),
        else object by object (first agent), then the books."""
        if self.capacity is not None:
            self.capacity.make_room({group_of(p.names[0]) for p in chunk},
                                    sum(p.nbytes + TRAILER_BYTES * len(p.names) for p in chunk))
        written = None
        if batch_path.usable(self, chunk):
            written = batch_path.write_chunk(self, chunk, alt, self.io_alt if alt else self.io)
        if written is None:
            written = self._write_chunk(chunk)
        if self.capacity is not None:
            self.capacity.written([(name, s.nbytes + TRAILER_BYTES) for p, ok in zip(chunk, written) if ok
                                   for name, s in zip(p.names, p.codec.segments)])
        return written

    def _write_lanes(self, chunks: list[list[PageIO]], results: list) -> None:
        """Chunks 1, 3, 5... on the writer thread (second agent and set area), the rest here,
        as ``_read_lanes``. Returns when both lanes are done."""
        def lane(first: int) -> None:
            for k in range(first, len(chunks), 2):
                results[k] = self._write_one(chunks[k], first == 1)

        _two_lanes(self._writer, lane)

    def _write_chunk(self, pages: list[PageIO]) -> list[bool]:
        counter, planned = SlotCounter(), []
        try:
            for page in pages:
                ctx, items = self.contexts[page.codec.name], []
                planned.append((page, items))
                for obj in page.objects:
                    items.append(counter.item(obj, ctx, self.side.open_write(obj.name, ctx.direct), True, TRAILER_BYTES))
            _stage_chunk(planned)
            moved = self._move("WRITE", planned)
        except Exception:  # noqa: BLE001 - whatever failed, the temporaries below are closed and dropped
            self.stats.add(failures=1)
            logger.warning("HiCacheNixl: preparing a write of %d pages failed", len(pages), exc_info=True)
            moved = [False] * len(pages)
        with self.side.commit_lock() if any(moved) else contextlib.nullcontext():
            flags = [self._commit(items, ok) for (_, items), ok in zip(planned, moved)]
        return flags + [False] * (len(pages) - len(planned))

    def _commit(self, items: list[Item], ok: bool) -> bool:
        """Rename every written object of a page into place (the caller holds the commit lock,
        so two writers' renames of one page do not interleave), or drop the temporaries when
        ``ok`` is False."""
        for item in items:
            try:
                self.side.finish(item.target, commit=ok)
            except OSError:
                self.stats.add(failures=1)
                logger.warning("HiCacheNixl: committing %s failed", item.obj.name, exc_info=True)
                ok = False
        return ok

    # ---- lifecycle ----------------------------------------------------------------------
    def clear(self) -> None:
        self.side.clear()

    def _close(self) -> None:
        if self.capacity is not None:
            self.capacity.close()
        with self._read_lock, self._write_lock:
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            self.io.close()
            if self.io_alt is not None:
                self.io_alt.close()
            self.side.close()


def _two_lanes(pool: ThreadPoolExecutor, lane) -> None:
    """``lane(1)`` on ``pool``'s thread and ``lane(0)`` here; returns (or raises the first
    error) only once both have stopped, so no lane still touches host memory after it."""
    future = pool.submit(lane, 1)
    try:
        lane(0)
    finally:
        error = future.exception()  # waits for the other lane
    if error is not None:
        raise error


def _stage_chunk(planned: list[Planned]) -> None:
    """Payloads into their slots (bounce) and the trailers of a whole chunk, each bound by its
    page's digest (built at once, ``batch_trailers``)."""
    items = [item for _, page_items in planned for item in page_items]
    if not items:
        return
    sums = [item.stage_payload() for item in items]
    digests = batch_trailers.digests(sums, [len(page_items) for _, page_items in planned])
    trailers = batch_trailers.build([i.obj.name for i in items], [i.obj.nbytes for i in items], sums, digests,
                                    TRAILER_BYTES)
    for item, trailer in zip(items, trailers):
        item.trailer[:] = trailer
