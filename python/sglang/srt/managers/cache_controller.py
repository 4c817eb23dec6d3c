"""HiCacheController: moves KV pages between the device (L1) and host (L2) pools.

The tree decides which slots to move; the controller only moves them. Writes (device -> host,
all layers) start as soon as they are submitted; loads (host -> device) are queued and start
together, layer by layer, when the scheduler calls ``start_loading`` for the next batch. Both run
on transfer lanes (``transfer_lane.py``): CUDA streams on a GPU, worker threads elsewhere, with
the same code. Completion is reported through acks that the tree consumes in order.

The constructor takes upstream's keywords (``token_to_kv_pool_allocator, mem_pool_host,
page_size, tp_group, load_cache_event, attn_cp_group, attn_tp_group, pp_group, write_policy,
io_backend, storage_backend, prefetch_threshold, model_name, storage_backend_extra_config,
enable_storage_metrics, host_memory_mode``, and the ``pp_rank/pp_size/attn_cp_rank/attn_cp_size``
of upstream's hybrid controller) and builds ``self.params``, a CacheInitParams, from them: every
rank coordinate the controller and its storage config use is read back from there.
``from_params`` hands a tree's CacheInitParams over through those same keywords.

Pools are reached by ``PoolName`` through ``PoolBinding``s: the plain controller has one (``kv``);
``HybridCacheController`` binds every pool of a ``HostPoolGroup`` (sidecars move with the anchor).

Storage (L3): with ``storage_backend`` (a StorageBackendFactory name) the controller builds the
backend from ``_generate_storage_config()`` (coordinates from ``self.params`` only) and runs the
prefetch, IO and backup threads of ``storage_controller.py`` (``self.storage``; the backend is
``self.storage_backend``). ``held_host_indices()`` reports host slots held by in-flight
prefetches and by backups a bounded flush abandoned to the integrity check; ``get_stats()``
gives per-tier counters (pages and bytes as submitted), ``l2_metrics`` upstream's copy figures
(slots per pool, bytes and durations of copies once done, ``metrics/hicache_metrics.py``);
``close()`` stops every thread and closes the backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from sglang.srt.mem_cache.cache_init_params import CacheInitParams, ParallelCoords
from sglang.srt.mem_cache.controller.hicache_config import WritePolicy
from sglang.srt.mem_cache.controller.layer_done_counter import LayerDoneCounter, LayerLoadingEvent
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.pool_host.layout import IOBackend
from sglang.srt.mem_cache.controller.storage_ops import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.controller.storage_settings import parse_extra_config_arg, split_extra_config
from sglang.srt.mem_cache.controller.tier_counters import TierCounters
from sglang.srt.mem_cache.hiradix.tp_agreement import TPAgreement
from sglang.srt.mem_cache.controller.transfer_lane import make_lane
from sglang.srt.metrics.hicache_metrics import BACKUP, LOAD_BACK, CopyTiming, L2TransferMetrics

logger = logging.getLogger(__name__)

# upstream's names at upstream's path; the counters and the L3 operations live in controller/
__all__ = [
    "CacheOperation", "HiCacheAck", "HiCacheController", "L2Transfer", "LayerDoneCounter", "LayerLoadingEvent",
    "PoolBinding", "PrefetchOperation", "StorageOperation", "Tier",
]


class Tier(Enum):
    DEVICE = "device"
    HOST = "host"


@dataclass
class L2Transfer:
    """Paired slots of one pool: ``host_indices[i]`` <-> ``device_indices[i]`` (whole pages)."""

    name: PoolName
    host_indices: torch.Tensor
    device_indices: torch.Tensor


@dataclass
class CacheOperation:
    transfers: list[L2Transfer]
    node_ids: list[int] = field(default_factory=list)

    @staticmethod
    def merge_ops(ops: list["CacheOperation"]) -> "CacheOperation":
        """One operation with the transfers of ``ops`` concatenated per pool (order kept)."""
        by_name: dict[PoolName, list[L2Transfer]] = {}
        for op in ops:
            for t in op.transfers:
                by_name.setdefault(t.name, []).append(t)
        merged = [
            L2Transfer(name, torch.cat([t.host_indices for t in ts]), torch.cat([t.device_indices for t in ts]))
            for name, ts in by_name.items()
        ]
        return CacheOperation(merged, [nid for op in ops for nid in op.node_ids])


# (pages counter, bytes counter) of each direction of _count_l2
_L2_NAMES = {"written": ("pages_written", "bytes_written"), "loaded": ("pages_loaded", "bytes_loaded")}


class HiCacheAck(NamedTuple):
    """Completion of one submitted operation (upstream's fields and order): ``finish_event`` is
    recorded after its last copy; ``start_event`` is None here (no per-copy timing)."""

    start_event: object
    finish_event: object
    node_ids: list[int]


HOST_MEMORY_MODES = ("cache",)  # upstream's "buffer_only" (host rows as a staging buffer) is not built


@dataclass
class PoolBinding:
    """How to reach one named pool: the (host, device) pool pairs that move together, and the
    objects that hand out its host and device slots (``alloc``/``free``/``available_size``)."""

    pairs: list[tuple[object, object]]
    host_alloc: object
    device_alloc: object


class HiCacheController:
    """L1<->L2 queues and lanes for one tree, and optionally the L2<->L3 threads.

    Upstream's keywords: ``tp_group`` (the gloo group of the TP ranks sharing the tree; None for
    one rank) and ``pp_group`` / ``attn_cp_group`` give the coordinates, or ``pp_rank``,
    ``pp_size``, ``attn_cp_rank``, ``attn_cp_size`` (and our ``tp_rank`` / ``tp_size``) give them as
    numbers; both may be given and must agree. ``attn_tp_group``: None or ``tp_group`` itself
    (no attention data parallelism here). ``load_cache_event``: kept as ``self.load_cache_event``
    and set whenever ``start_loading`` starts a batch. ``io_backend``: ``""`` / None lets each host
    pool use its own. ``storage_backend`` (None: no L3), ``storage_backend_extra_config`` (dict or
    JSON string), ``prefetch_threshold`` (tokens; the extra config's ``prefetch_threshold`` key
    wins) and ``model_name`` take the server's flags as they are; a bad value raises ValueError
    naming the key. ``enable_storage_metrics`` is carried into the storage config (the counters
    of ``get_stats`` are always kept). ``host_memory_mode``: ``cache`` only.
    """

    def __init__(
        self,
        token_to_kv_pool_allocator,
        mem_pool_host,
        page_size: int,
        tp_group=None,
        load_cache_event=None,
        attn_cp_group=None,
        attn_tp_group=None,
        pp_group=None,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH_SELECTIVE,
        io_backend: IOBackend | str | None = "",
        storage_backend: str | None = None,
        prefetch_threshold: int = 256,
        model_name: str | None = None,
        storage_backend_extra_config: dict | str | None = None,
        enable_storage_metrics: bool = False,
        host_memory_mode: str = "cache",
        *,
        pp_rank: int | None = None,
        pp_size: int | None = None,
        attn_cp_rank: int | None = None,
        attn_cp_size: int | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        if token_to_kv_pool_allocator is None:
            raise ValueError("token_to_kv_pool_allocator is required for a HiCache controller")
        if host_memory_mode not in HOST_MEMORY_MODES:
            raise ValueError(f"host_memory_mode {host_memory_mode!r} is not supported; allowed: "
                             f"{', '.join(HOST_MEMORY_MODES)}")
        self.params = CacheInitParams(
            token_to_kv_pool_allocator=token_to_kv_pool_allocator, page_size=page_size,
            tp_cache_group=tp_group, attn_cp_cache_group=attn_cp_group, attn_tp_cache_group=attn_tp_group,
            pp_cache_group=pp_group, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
            attn_cp_rank=attn_cp_rank, attn_cp_size=attn_cp_size,
        )
        self.page_size = page_size
        self.mem_pool_device_allocator = token_to_kv_pool_allocator
        self.mem_pool_device = token_to_kv_pool_allocator.get_kvcache()
        self.mem_pool_host = mem_pool_host
        if mem_pool_host.page_size != page_size:
            raise ValueError(f"host pool page_size {mem_pool_host.page_size} != page_size {page_size}")
        self.write_policy = WritePolicy.parse(write_policy)
        self.io_backend = None if io_backend in ("", None) else IOBackend.parse(io_backend)
        self.load_cache_event = load_cache_event
        self.enable_storage_metrics = bool(enable_storage_metrics)
        self.host_memory_mode = host_memory_mode
        self.anchor_name, self.bindings = self._pool_bindings()
        if self.anchor_name not in self.bindings:
            raise ValueError(f"anchor pool {self.anchor_name.value!r} has no binding; "
                             f"bound: {[n.value for n in self.bindings]}")
        pairs = [p for b in self.bindings.values() for p in b.pairs]
        self.layer_num = self._transfer_layer_num(max(host.layer_num for host, _ in pairs))
        self.storage = None
        self.storage_backend = None
        self.storage_backend_name: str | None = None  # the StorageBackendFactory name (a metric label)
        self.storage_config = None
        if storage_backend is not None:  # before any thread starts: a bad hookup leaks nothing
            self._attach_storage(storage_backend, prefetch_threshold, model_name, storage_backend_extra_config)
        elif storage_backend_extra_config:
            raise ValueError("storage_backend_extra_config is set but storage_backend is None; set both or neither")
        # every rank holding the tree: the TP ranks of this stage, then the stages (PP)
        self.agreement = TPAgreement(self.params.tp_cache_group, self.params.pp_cache_group,
                                     self.params.attn_cp_cache_group)
        device = self.mem_pool_device.device
        self.write_lane = make_lane("hicache-write", device)
        self.load_lane = make_lane("hicache-load", device)
        self.layer_done_counter = LayerDoneCounter(self.layer_num, self.load_lane)
        for _, device_pool in pairs:
            device_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.load_queue: list[CacheOperation] = []
        self.defer_writes = False  # see write(); the scheduler turns it on
        # write()s waiting for the next start_writing (read by the tree's per-step flush)
        self.write_queue: list[tuple[CacheOperation, object]] = []
        self.ack_write_queue: list[HiCacheAck] = []
        self.ack_load_queue: list[HiCacheAck] = []
        self.l2_counters = TierCounters("pages_written", "pages_loaded", "bytes_written", "bytes_loaded", "failures")
        # upstream's hicache_backup_* / load_back_* figures, counted when each copy is done
        self.l2_metrics = L2TransferMetrics()
        self._cuda_lanes = torch.device(device).type == "cuda"
        self._slot_bytes_cache: dict[PoolName, int] = {}
        logger.info(
            "HiCacheController: pools %s, write_policy=%s, %d layers, lanes on %s, %s",
            [n.value for n in self.bindings], self.write_policy.value, self.layer_num, device,
            self.params.parallel_coords,
        )

    @classmethod
    def from_params(cls, params: CacheInitParams, mem_pool_host, **kwargs):
        """A controller for the tree built from ``params``: its allocator, page size, groups and
        coordinates handed over through the constructor's keywords (``kwargs``: the rest)."""
        if not isinstance(params, CacheInitParams):
            raise TypeError(f"params must be a CacheInitParams, got {type(params).__name__}")
        return cls(
            params.token_to_kv_pool_allocator, mem_pool_host, params.page_size, params.tp_cache_group,
            attn_cp_group=params.attn_cp_cache_group, attn_tp_group=params.attn_tp_cache_group,
            pp_group=params.pp_cache_group, tp_rank=params.tp_rank, tp_size=params.tp_size,
            pp_rank=params.pp_rank, pp_size=params.pp_size, attn_cp_rank=params.attn_cp_rank,
            attn_cp_size=params.attn_cp_size, **kwargs,
        )

    def _pool_bindings(self) -> tuple[PoolName, dict[PoolName, PoolBinding]]:
        """(anchor pool name, binding of every pool this controller moves): the plain controller
        moves one pool, ``kv``."""
        host = self.mem_pool_host
        return PoolName.KV, {PoolName.KV: PoolBinding([(host, self.mem_pool_device)], host,
                                                      self.mem_pool_device_allocator)}

    def _transfer_layer_num(self, deepest_pool_layers: int) -> int:
        """Layer events per load batch: one per layer of the deepest pool."""
        return deepest_pool_layers

    # ---- coordinates and slots ----------------------------------------------------------
    def parallel_coords(self) -> ParallelCoords:
        """tp/pp/attention-cp rank and size of this rank, from CacheInitParams only."""
        return self.params.parallel_coords

    def get_attn_cp_rank_and_size(self) -> tuple[int, int]:
        """(attention-CP rank, size) of this rank, from CacheInitParams."""
        return self.params.attn_cp_rank, self.params.attn_cp_size

    def _binding(self, name: PoolName) -> PoolBinding:
        try:
            return self.bindings[name]
        except KeyError:
            raise ValueError(f"no pool {name!r} in this controller; has {[n.value for n in self.bindings]}") from None

    def _allocator(self, tier: Tier, name: PoolName):
        b = self.bindings.get(name)
        if b is None:
            b = self._binding(name)  # raises, naming the pools there are
        return b.device_alloc if tier is Tier.DEVICE else b.host_alloc

    def available(self, tier: Tier, name: PoolName) -> int:
        """Free slots of pool ``name`` on ``tier``."""
        return self._allocator(tier, name).available_size()

    def alloc(self, tier: Tier, name: PoolName, num_slots: int) -> torch.Tensor | None:
        """``num_slots`` slots (whole pages) of pool ``name`` on ``tier``; None when short."""
        return self._allocator(tier, name).alloc(num_slots)

    def free(self, tier: Tier, name: PoolName, indices: torch.Tensor, trusted: bool = False) -> None:
        """Return slots; ValueError on a double free (nothing freed then). ``trusted``: slot
        lists the tree checked for whole pages when they entered it: the allocator skips that
        check (``PagedAllocator.free``; the pools pass it on to theirs)."""
        if not indices.numel():
            return
        self._allocator(tier, name).free(indices, trusted=trusted)

    def held_host_indices(self, name: PoolName | None = None) -> list[torch.Tensor]:
        """Host slots of pool ``name`` (default: the anchor) held by storage operations:
        in-flight prefetches (reserved, not yet in the tree or freed) and backups a bounded
        flush abandoned (quarantined until their thread returns)."""
        if self.storage is None:
            return []
        return self.storage.held_host_indices(self.anchor_name if name is None else name)

    # ---- storage (L3) ---------------------------------------------------------------------
    def _storage_host(self):
        """What the storage backend registers: the host pool (a HostPoolGroup in hybrids)."""
        return self.mem_pool_host

    def _storage_side_pools(self) -> list[PoolName]:
        """Pools moved with every anchor page through the v2 API (none: the v1 API)."""
        return []

    def _storage_state_pool(self) -> PoolName | None:
        """The pool of trailing states (one per cached prefix, own slots) L3 carries, or None."""
        return None

    def _generate_storage_config(self, model_name: str | None = None, storage_backend_extra_config: dict | None = None):
        """This rank's HiCacheStorageConfig: coordinates from ``self.params`` (nowhere else), the
        page format from the storage host pool, ``storage_backend_extra_config`` the backend's
        keys (the controller's own already taken out)."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

        return HiCacheStorageConfig.from_cache_params(self.params, self._storage_host(), model_name,
                                                      storage_backend_extra_config,
                                                      enable_storage_metrics=self.enable_storage_metrics)

    def _attach_storage(self, storage_backend: str, prefetch_threshold: int, model_name: str | None,
                        storage_backend_extra_config) -> None:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from sglang.srt.mem_cache.controller.storage_controller import StorageController

        extra = parse_extra_config_arg(storage_backend_extra_config, "storage_backend_extra_config")
        # the extra config's own key wins over the keyword (upstream read it from there too)
        settings, backend_extra = split_extra_config({"prefetch_threshold": prefetch_threshold, **extra})
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty string with storage_backend {storage_backend!r}, "
                             f"got {model_name!r}")
        side, state = self._storage_side_pools(), self._storage_state_pool()
        host = self._storage_host()
        config = self._generate_storage_config(model_name, backend_extra)
        backend = StorageBackendFactory.create_backend(storage_backend, config, host)
        self.storage = StorageController(backend, self.page_size, settings, side,
                                         lambda pool, idx: self.free(Tier.HOST, pool, idx), state)
        self.storage_backend, self.storage_config = backend, config
        self.storage_backend_name = storage_backend
        logger.info("HiCacheController: L3 backend %s, side pools %s, state pool %s, %s", storage_backend,
                    [p.value for p in side], state.value if state is not None else None, settings)

    def attach_storage_backend(self, storage_backend: str, prefetch_threshold: int = 256, model_name: str | None = None,
                               storage_backend_extra_config: dict | str | None = None) -> None:
        """Attach an L3 backend at runtime (the caller made sure no storage operation runs).
        RuntimeError when one is attached; ValueError when the name / config is bad; whatever
        the backend constructor raises propagates. On any error nothing changes here."""
        if self.storage is not None:
            raise RuntimeError(f"a storage backend ({type(self.storage_backend).__name__}) is already attached; "
                               "detach it first")
        self._attach_storage(storage_backend, prefetch_threshold, model_name, storage_backend_extra_config)

    def detach_storage_backend(self) -> bool:
        """Stop the L3 threads and close the backend (the caller made sure no storage operation
        runs). Returns False when none was attached."""
        if self.storage is None:
            return False
        storage, self.storage = self.storage, None
        self.storage_backend = self.storage_config = self.storage_backend_name = None
        storage.close()
        logger.info("HiCacheController: L3 backend detached")
        return True

    def get_stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters: ``l2`` (device<->host: pages, bytes, failures) and ``l3``
        (storage: the backend's get_stats() merged with the controller's; empty without L3)."""
        return {"l2": self.l2_counters.snapshot(), "l3": self.storage.stats() if self.storage is not None else {}}

    def _slot_bytes(self, name: PoolName) -> int:
        """Host bytes one slot of pool ``name`` moves (every pool of its binding), cached."""
        n = self._slot_bytes_cache.get(name)
        if n is None:
            n = self._slot_bytes_cache[name] = sum(host.get_size_per_token() for host, _ in self._binding(name).pairs)
        return n

    def _count_l2(self, transfers: list[L2Transfer], direction: str) -> tuple[dict[str, int], int]:
        """Count submitted pages and bytes; returns (slots per pool name, bytes) of ``transfers``."""
        pages = bytes_moved = 0
        slots_by_pool: dict[str, int] = {}
        for t in transfers:
            slots = t.host_indices.numel()
            if t.name is self.anchor_name:
                pages += slots // self.page_size
            bytes_moved += slots * self._slot_bytes(t.name)
            slots_by_pool[t.name.value] = slots_by_pool.get(t.name.value, 0) + slots
        self.l2_counters.add_pair(_L2_NAMES[direction], pages, bytes_moved)
        return slots_by_pool, bytes_moved

    def _counted(self, job):
        def run():
            try:
                job()
            except BaseException:
                self.l2_counters.add(failures=1)
                raise

        return run

    # ---- writes (device -> host) ----------------------------------------------------------
    def write(self, transfers: list[L2Transfer], node_ids: list[int], ack: bool = True):
        """Copy every layer of ``transfers`` device -> host; returns the finish event. With
        ``ack`` its completion is queued in ``ack_write_queue`` (consumed by the tree) and, with
        ``defer_writes``, the copy waits in ``write_queue`` for ``start_writing`` (the scheduler's
        one lane job a step). Without ``ack`` it starts now, after every deferred one; the caller
        waits."""
        finish = self.write_lane.new_event()
        op = CacheOperation(transfers, list(node_ids))
        timing = CopyTiming(self._cuda_lanes)
        self.l2_metrics.submitted(BACKUP, finish, timing, *self._count_l2(op.transfers, "written"))
        if ack and self.defer_writes:
            self.ack_write_queue.append(HiCacheAck(None, finish, op.node_ids))
            self.write_queue.append((op, finish, timing))
            return finish
        self.start_writing()
        self._submit_writes([(op, finish, timing)])
        if ack:
            self.ack_write_queue.append(HiCacheAck(None, finish, op.node_ids))
        return finish

    def start_writing(self) -> int:
        """Start the writes waiting in ``write_queue`` as one lane job (merged per pool);
        returns how many."""
        batch, self.write_queue = self.write_queue, []
        if batch:
            self._submit_writes(batch)
        return len(batch)

    def _submit_writes(self, batch: list[tuple[CacheOperation, object, CopyTiming]]) -> None:
        op = batch[0][0] if len(batch) == 1 else CacheOperation.merge_ops([o for o, _, _ in batch])
        events = [ev for _, ev, _ in batch]
        timing = batch[0][2]  # one merged copy, timed once

        def job():
            timing.start()
            for t in op.transfers:
                for host, device in self._binding(t.name).pairs:
                    host.backup_from_device_all_layer(device, t.host_indices, t.device_indices, self.io_backend)
            timing.stop()  # before the events: a done event means a finished timing
            for ev in events:
                ev.record()

        self.write_lane.submit(self._counted(job), events, short=True)

    def synchronize_writes(self) -> None:
        """Block until every write so far (deferred ones included) has run."""
        self.start_writing()
        self.write_lane.synchronize()

    # ---- loads (host -> device, layer by layer) -------------------------------------------
    def load(self, transfers: list[L2Transfer], node_ids: list[int]) -> None:
        """Queue a load; it starts at the next ``start_loading``."""
        self.load_queue.append(CacheOperation(transfers, list(node_ids)))

    def start_loading(self) -> int:
        """Start every queued load as one batch and return the LayerDoneCounter index the next
        forward must wait on: this batch's; with nothing queued, the latest load still in
        flight (loads run in order, so waiting for it covers every earlier one); else -1."""
        if not self.load_queue:
            latest = self.layer_done_counter.producer_index
            if latest >= 0 and not self.layer_done_counter.events[latest].finished():
                return latest
            return -1
        op = CacheOperation.merge_ops(self.load_queue)
        self.load_queue = []
        producer = self.layer_done_counter.update_producer()
        layer_events = self.layer_done_counter.events[producer]
        # the layer events are reused three batches on; the metrics wait on an event of their own
        timing, done = CopyTiming(self._cuda_lanes), self.load_lane.new_event()

        def job():
            timing.start()
            for layer in range(self.layer_num):
                for t in op.transfers:
                    for host, device in self._binding(t.name).pairs:
                        if layer < host.layer_num:
                            host.load_to_device_per_layer(
                                device, t.host_indices, t.device_indices, layer, self.io_backend
                            )
                layer_events.complete(layer)
            timing.stop()
            done.record()

        moved = self._count_l2(op.transfers, "loaded")
        try:
            self.load_lane.submit(self._counted(job), [*layer_events.load_events, done], short=True)
        except BaseException as exc:  # never leave armed events that nobody will record
            for ev in layer_events.load_events:
                ev.fail(exc)
            raise
        self.l2_metrics.submitted(LOAD_BACK, done, timing, *moved)
        self.ack_load_queue.append(HiCacheAck(None, layer_events.finish_event, op.node_ids))
        if self.load_cache_event is not None:
            self.load_cache_event.set()
        return producer

    # ---- completion -----------------------------------------------------------------------
    @staticmethod
    def _leading_done(acks: list[HiCacheAck]) -> tuple[int, bool]:
        done, ok = 0, True
        for ack in acks:
            if not ack.finish_event.query():
                break
            ok = ok and ack.finish_event.error is None
            done += 1
        return done, ok

    def local_progress(self) -> list[int]:
        """[finished writes, finished loads, 1 if none of them failed else 0], leading acks only."""
        writes, w_ok = self._leading_done(self.ack_write_queue) if self.ack_write_queue else (0, True)
        loads, l_ok = self._leading_done(self.ack_load_queue) if self.ack_load_queue else (0, True)
        return [writes, loads, int(w_ok and l_ok)]

    def pop_write_acks(self, n: int) -> list[HiCacheAck]:
        acks = self.ack_write_queue[:n]
        del self.ack_write_queue[:n]
        return acks

    def pop_load_acks(self, n: int) -> list[HiCacheAck]:
        acks = self.ack_load_queue[:n]
        del self.ack_load_queue[:n]
        return acks

    def synchronize(self) -> None:
        """Block until every submitted write and started load has run (queued loads start first)."""
        self.start_loading()
        self.synchronize_writes()
        self.load_lane.synchronize()

    def reset(self) -> None:
        """Wait for the lanes, then forget every queued operation and ack (slots are the tree's)."""
        self.synchronize_writes()
        self.load_lane.synchronize()
        self.load_queue = []
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        """Stop the lanes and, with storage, its threads and the backend; idempotent."""
        if self.storage is not None:
            self.storage.close()
        try:
            self.start_writing()
        except RuntimeError:  # a closed lane: nothing more will run
            self.write_queue = []
        self.write_lane.close()
        self.load_lane.close()
