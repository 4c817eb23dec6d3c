"""PDKVManager: one rank's transport, control channel and room bookkeeping, whatever moves the
bytes. NixlKVManager (``nixl/manager.py``) is it over NIXL, MooncakeKVManager
(``mooncake/conn.py``) over Mooncake's transfer engine; only ``_make_transport`` differs: every
byte moves through ``self.transport`` (``base/transport.py``).

Prefill: registers with the bootstrap server, accepts decode REGISTER / REQUEST messages, and
writes KV with a transport WRITE + a notification tag (``send_kvcache`` / ``post_pieces`` and the routes
in ``kv_routes.py``, staged gathers on ``copy_thread``; ``send_state``, ``send_aux`` here).
Decode: resolves prefill ranks through the bootstrap server, registers its buffers with each,
files arriving notifications into per-room ``TransferStatus`` and scatters staged KV chunks as
they land. Either side fails every room of a
peer that stops heartbeating, and tells the other side (ABORT) when a room fails locally. All
room state is guarded by ``self._lock``; transport calls happen under it too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    DisaggregationMode,
    IncompatiblePeerError,
    KVArgs,
    KVTransferError,
    TransferConfig,
)
from sglang.srt.disaggregation.base.transport import KVTransport
from sglang.srt.disaggregation.common.bootstrap_client import BootstrapClient
from sglang.srt.disaggregation.common.bootstrap_lookup import AddrLookups
from sglang.srt.disaggregation.common.compat import PeerInfo
from sglang.srt.disaggregation.common.control import ControlChannel
from sglang.srt.disaggregation.common.descriptors import Descs, row_descs, state_descs
from sglang.srt.disaggregation.common.messages import Message, MsgKind, Notif
from sglang.srt.disaggregation.common.staging import PoolBuffers, SliceCopier, SliceLayout, StagingArea
from sglang.srt.disaggregation.common.trust import BootstrapAddr, TrustPolicy
from sglang.srt.disaggregation.common.decode_side import DecodeSideMixin
from sglang.srt.disaggregation.common.kv_routes import KVRoute, KVRoutesMixin
from sglang.srt.disaggregation.common.prefill_side import PrefillSideMixin
from sglang.srt.disaggregation.common.status import DecodeRoom, DstInfo, PrefillRoom, Transfer

logger = logging.getLogger(__name__)


class PDKVManager(PrefillSideMixin, KVRoutesMixin, DecodeSideMixin, BaseKVManager):
    """The transport-independent manager; subclasses name the transport (``_make_transport``).
    Construct one per rank. Prefill needs ``config.bootstrap_addr``; it blocks until the
    bootstrap server accepted this rank (IncompatiblePeerError when refused, KVTransferError when
    unreachable within ``bootstrap_timeout_s``). ValueError when ``config``'s trust settings are
    inconsistent (an allow-list off loopback without a secret)."""

    def __init__(self, args: KVArgs, mode: DisaggregationMode, config: TransferConfig = TransferConfig()):
        self.args, self.mode, self.config = args, DisaggregationMode(mode), config
        if self.mode is DisaggregationMode.PREFILL and not config.bootstrap_addr:
            raise ValueError(f"prefill {type(self).__name__} needs TransferConfig.bootstrap_addr ('host:port')")
        self.trust = TrustPolicy(config.allowed_bootstrap_hosts, config.secret)
        self.peer_info = PeerInfo.from_kv_args(args)
        self.agent_name = f"{self.mode.value}-{args.engine_rank}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self.transport: KVTransport = self._make_transport()
        self.pool = PoolBuffers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        self._copiers: dict[SliceLayout, SliceCopier] = {}
        # Prefill gathers the next staged piece here while the current one is on the wire.
        self.copy_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{self.agent_name}-copy")
        # decode: bootstrap lookups are blocking HTTP (up to the client timeout against a dead
        # prefill server); they run here, per address, so a receiver's poll never blocks the
        # scheduler loop and a bad host delays only the rooms that name it
        self.lookups = AddrLookups(self.resolve_targets, self._lookup_done, name=f"{self.agent_name}-lookup")
        self.staging = StagingArea(config.staging_bytes) if config.staging_bytes and not args.is_mla else None
        staging_region = [(self.staging.ptr, self.staging.nbytes)] if self.staging else []
        regions = [*zip(args.kv_data_ptrs + args.aux_data_ptrs + args.state_data_ptrs,
                        args.kv_data_lens + args.aux_data_lens + args.state_data_lens), *staging_region]
        self.transport.register_memory([(int(p), int(n)) for p, n in regions])
        self.prefill_rooms: dict[int, PrefillRoom] = {}
        self.failed_rooms: OrderedDict[int, str] = OrderedDict()  # prefill side: tombstones
        self.decode_rooms: dict[int, DecodeRoom] = {}
        self.decode_peers: dict[str, dict] = {}  # prefill side: agent name -> REGISTER header
        self.registered_prefill: dict[str, int] = {}  # decode side: prefill agent name -> engine rank
        self.bootstrap_cache: dict[BootstrapAddr, dict] = {}  # decode side: bootstrap addr -> prefill info
        self.staging_quarantine: list[tuple[float, int, int]] = []  # decode: (free-after, offset, bytes)
        self.route_counts: Counter[KVRoute] = Counter()  # prefill side
        self.control = ControlChannel(
            config.host, self.agent_name, self._on_message, self._on_peer_dead,
            config.heartbeat_interval_s, config.heartbeat_timeout_s, self._progress, auth=self.trust.auth,
        )
        if self.mode is DisaggregationMode.PREFILL:
            self._register_with_bootstrap()
        logger.info("%s %s: %d KV, %d aux, %d state buffers; control port %d", type(self).__name__, self.agent_name,
                    len(args.kv_data_ptrs), len(args.aux_data_ptrs), len(args.state_data_ptrs), self.control.port)

    def _make_transport(self) -> KVTransport:
        """This rank's transport, named ``self.agent_name`` (``self.config`` and ``self.args`` set)."""
        raise NotImplementedError

    # ---- control messages -------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        handler = {
            (DisaggregationMode.PREFILL, MsgKind.REGISTER): self._handle_register,
            (DisaggregationMode.PREFILL, MsgKind.CLAIM): self._handle_claim,
            (DisaggregationMode.PREFILL, MsgKind.REQUEST): self._handle_request,
            (DisaggregationMode.PREFILL, MsgKind.ABORT): self._handle_prefill_abort,
            (DisaggregationMode.DECODE, MsgKind.REJECT): self._handle_reject,
            (DisaggregationMode.DECODE, MsgKind.ABORT): self._handle_decode_abort,
            (DisaggregationMode.DECODE, MsgKind.NOTIF): self._handle_notif,
        }.get((self.mode, msg.kind))
        if handler is None:
            logger.warning("%s dropped %s from %s: not expected on this side", self.agent_name, msg.kind.value,
                           msg.header["agent_name"])
            return
        handler(msg)

    def _progress(self) -> None:
        """Background progress on every heartbeat tick, for when the scheduler is not polling:
        decode drains (and files) notifications; prefill checks its in-flight handles and
        progresses its transport (NIXL: the UCX worker, which a bare notification needs to go out)."""
        if self.mode is DisaggregationMode.DECODE:
            self.drain_notifs()
            with self._lock:
                self._free_due_staging()
            return
        with self._lock:
            for room in self.prefill_rooms.values():
                for transfer in room.handles:
                    self.check(transfer)
            try:
                stray = self.transport.drain_notifs()  # prefill expects none; reading progresses UCX
            except Exception as exc:
                logger.warning("%s: progressing the %s transport failed: %s", self.agent_name,
                               self.transport.backend, exc)
                return
            if stray:
                logger.debug("%s dropped notifications it does not expect: %s", self.agent_name, stray)

    def _on_peer_dead(self, name: str, reason: str) -> None:
        if self.mode is DisaggregationMode.PREFILL:
            self._prefill_peer_dead(name, reason)
        else:
            self._decode_peer_dead(name, reason)

    # ---- byte movement ----------------------------------------------------------------------

    def _post(self, remote: str, descs: Descs, notif: Notif | None, staging: tuple[int, int] | None = None):
        """WRITE ``descs`` to ``remote`` with ``notif`` (None: a WRITE without notification); a
        bare notification when there are no bytes. Returns a Transfer owning ``staging`` (None for
        a bare notification or nothing to do, whose staging is freed at once); raises
        KVTransferError after freeing ``staging``."""
        tag = b"" if notif is None else notif.encode()
        with self._lock:
            try:
                if len(descs) == 0:
                    if notif is not None:
                        self.transport.send_notif(remote, tag)
                    self._free_staging(staging)
                    return None
                handle = self.transport.post_write(remote, descs, tag)
            except KVTransferError:
                self._free_staging(staging)
                raise
            except Exception as exc:
                self._free_staging(staging)
                raise KVTransferError(f"{self.transport.backend} could not start {tag!r} to {remote}: "
                                      f"{exc!r}") from exc
            logger.debug("posted %s: %d descriptors, %d bytes", tag, len(descs), descs.total_bytes)
            return Transfer(remote, handle, staging)

    def copier(self, layout: SliceLayout) -> SliceCopier:
        """The staging copier of this rank's pool for ``layout`` (built once)."""
        copier = self._copiers.get(layout)
        if copier is None:
            copier = self._copiers[layout] = SliceCopier(self.pool, layout, self.args.page_size)
        return copier

    def _free_staging(self, staging: tuple[int, int] | None) -> None:
        if staging is not None:
            self.staging.free(*staging)

    def send_state(self, dst: DstInfo, peer: dict, src_slots: np.ndarray, notif: Notif):
        """Mamba state of the request slots, sliced along the TP-sharded dim when Tp != Td."""
        p = peer["peer"]
        descs = state_descs(
            self.args.state_data_ptrs, self.args.state_item_lens, self.args.state_dim_per_tensor,
            peer["state_ptrs"], p["state_item_lens"], p["state_dims"], src_slots, dst.state_slots, dst.state_slices,
        )
        return self._post(dst.agent_name, descs, notif)

    def send_aux(self, dst: DstInfo, peer: dict, aux_index: int, notif: Notif):
        descs = row_descs(self.args.aux_data_ptrs, peer["aux_ptrs"], self.args.aux_item_lens, aux_index, dst.aux_index)
        return self._post(dst.agent_name, descs, notif)

    def check(self, transfer: Transfer) -> str:
        """"DONE", "PROC" or "ERR" of a posted transfer."""
        with self._lock:
            try:
                return self.transport.check(transfer.handle)
            except Exception as exc:  # a disconnected peer surfaces as an exception
                logger.warning("%s: transfer state check failed: %r", self.agent_name, exc)
                return "ERR"

    def finish(self, transfer: Transfer) -> None:
        """Release the handle (the transport cancels or abandons it if still running) and its staging; idempotent,
        never raises."""
        with self._lock:
            if transfer.handle is not None:
                try:
                    self.transport.release(transfer.handle)
                except Exception as exc:
                    logger.warning("%s: releasing transfer handle failed: %s", self.agent_name, exc)
            self._free_staging(transfer.staging)
            transfer.handle = transfer.staging = None

    # ---- lifecycle --------------------------------------------------------------------------

    def num_active_rooms(self) -> int:
        with self._lock:
            return len(self.prefill_rooms) + len(self.decode_rooms)

    def close(self) -> None:
        """Stop the control channel and copy thread, release every handle and deregister memory."""
        self.control.close()
        self.copy_thread.shutdown(wait=True)
        self.lookups.shutdown()
        with self._lock:
            for room in self.prefill_rooms.values():
                for transfer in room.handles:
                    self.finish(transfer)
            self.prefill_rooms.clear()
            self.decode_rooms.clear()
            self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _register_with_bootstrap(self) -> None:
        record = {"engine_rank": self.args.engine_rank, "tp_rank": self.args.tp_rank, "ip": self.config.host,
                  "port": self.control.port, "agent_name": self.agent_name, "peer": self.peer_info.to_json()}
        client = BootstrapClient(BootstrapAddr.parse(self.config.bootstrap_addr), auth=self.trust.auth)
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        while True:
            try:
                client.register_rank(record)
                return
            except IncompatiblePeerError:
                self.close()
                raise
            except KVTransferError:
                if time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.1)

