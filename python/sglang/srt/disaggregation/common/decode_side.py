"""Decode half of PDKVManager: bootstrap lookup, registration, claims, requests, notifications.

Mixed into ``PDKVManager``; uses its ``_lock``, ``transport``, ``control``, ``args``, ``trust`` and
``lookups``. Mutates ``self.decode_rooms``, ``self.registered_prefill``, ``self.bootstrap_cache``
and ``self.staging_quarantine``.

A room's bootstrap address is checked against the trust policy before anything is sent there;
lookups run on ``lookups`` (one in flight per address, shared by every room waiting on it), and
when one resolves, every waiting room of that address gets its targets and CLAIMs them at once:
prefill then knows the room has a live decode (and fails it when that decode dies) long before
the REQUEST, which waits for memory. The staging range of a room that fails is quarantined like
the scheduler quarantines its pages (``heartbeat_timeout_s``): a WRITE prefill posted before it
heard of the failure may still land there, and must not land in another room's staging.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from sglang.srt.disaggregation.base.conn import IncompatiblePeerError, KVPoll
from sglang.srt.disaggregation.common.bootstrap_client import BootstrapClient
from sglang.srt.disaggregation.common.compat import PeerInfo, check_peer_compat
from sglang.srt.disaggregation.common.descriptors import page_run_count
from sglang.srt.disaggregation.common.messages import MalformedMessage, Message, MsgKind, Notif, NotifKind
from sglang.srt.disaggregation.common.rank_mapping import head_slice, plan_decode_rank, required_dst_info_num
from sglang.srt.disaggregation.common.staging import SliceLayout
from sglang.srt.disaggregation.common.trust import BootstrapAddr
from sglang.srt.disaggregation.common.status import DecodeRoom, DecodeTarget, StagedSlice, TransferStatus

logger = logging.getLogger(__name__)


class DecodeSideMixin:
    # ---- bootstrap ----------------------------------------------------------------------------

    def resolve_targets(self, addr: BootstrapAddr) -> list[DecodeTarget] | None:
        """Look up the prefill ranks this rank talks to and register with each (once per rank).

        Returns None while the bootstrap server is not complete; raises IncompatiblePeerError when
        the prefill side cannot be paired (UntrustedPeerError: not authenticated, or a rank
        address this rank may not register with), KVTransferError when the server is unreachable.
        Blocking HTTP; call without holding ``self._lock``.
        """
        client = BootstrapClient(addr, auth=self.trust.auth)
        with self._lock:
            info = self.bootstrap_cache.get(addr)
        if info is None:
            par = client.parallel_info()
            if par is None:
                return None
            try:
                prefill = PeerInfo.from_json(par.get("peer"))
            except ValueError as exc:
                raise IncompatiblePeerError(f"bootstrap server {addr} sent bad peer info: {exc}") from None
            check_peer_compat(prefill, self.peer_info)
            info = {"peer": prefill, "records": {}}
            with self._lock:
                self.bootstrap_cache[addr] = info
        prefill: PeerInfo = info["peer"]
        plans = plan_decode_rank(prefill.total_kv_head_num, prefill.tp_size, self.args.tp_size, self.args.tp_rank,
                                 self.args.is_mla, bool(self.args.state_data_ptrs))
        targets = []
        for plan in plans:
            record = info["records"].get(plan.prefill_rank) or client.rank_record(plan.prefill_rank)
            if record is None:
                return None
            if not self.trust.auth.enabled:  # an authenticated record is a peer's word; else loopback only
                self.trust.check_host(record["ip"], f"prefill tp_rank {plan.prefill_rank} address")
            info["records"][plan.prefill_rank] = record
            self._ensure_registered(record)
            targets.append(DecodeTarget(plan, record["agent_name"], record["engine_rank"]))
        return targets

    def _ensure_registered(self, record: dict) -> None:
        name = record["agent_name"]
        with self._lock:
            if name in self.registered_prefill:
                return
            self.registered_prefill[name] = record["engine_rank"]
            metadata = self.transport.local_metadata()
        a = self.args
        header = {"ip": self.config.host, "port": self.control.port, "engine_rank": a.engine_rank, "tp_rank": a.tp_rank,
                  "peer": self.peer_info.to_json(), "kv_ptrs": a.kv_data_ptrs, "kv_lens": a.kv_data_lens,
                  "aux_ptrs": a.aux_data_ptrs, "aux_lens": a.aux_data_lens, "state_ptrs": a.state_data_ptrs,
                  "state_lens": a.state_data_lens, "staging_ptr": self.staging.ptr if self.staging else 0,
                  "staging_len": self.staging.nbytes if self.staging else 0}
        self.control.add_peer(name, record["ip"], record["port"])
        self.control.send(name, MsgKind.REGISTER, header, [metadata])
        logger.info("%s registered with prefill %s (engine rank %d)", self.agent_name, name, record["engine_rank"])

    def _lookup_done(self, addr: BootstrapAddr, targets: list[DecodeTarget] | None, exc: Exception | None) -> None:
        """Hand a finished lookup to every room waiting on ``addr`` (lookup worker thread)."""
        with self._lock:
            waiting = [r for r in self.decode_rooms.values()
                       if r.bootstrap_addr == addr and r.targets is None and r.failure is None]
            for room in waiting:
                if isinstance(exc, IncompatiblePeerError):
                    self._fail_decode_room(room, str(exc), tell_prefill=False)
                elif exc is not None:  # not up yet, or gone: retried until the bootstrap timeout
                    room.bootstrap_error = str(exc) or type(exc).__name__
                elif targets is not None:
                    room.targets = list(targets)
                    self._claim(room)

    def _claim(self, room: DecodeRoom) -> None:
        for t in room.targets:
            header = {"room": room.room, "engine_rank": self.args.engine_rank, "tp_rank": self.args.tp_rank}
            if not self.control.send(t.agent_name, MsgKind.CLAIM, header):
                self._fail_decode_room(room, f"prefill {t.agent_name} unreachable")
                return

    # ---- rooms --------------------------------------------------------------------------------

    def decode_room(self, room_id: int, addr: BootstrapAddr | str) -> DecodeRoom:
        """Open room ``room_id`` fed by the bootstrap server at ``addr`` and start its lookup.
        Raises ValueError for a malformed address (UntrustedPeerError for one this rank may not
        contact) or a room id already open here."""
        addr = addr if isinstance(addr, BootstrapAddr) else BootstrapAddr.parse(addr)
        self.trust.check_host(addr.host)
        with self._lock:
            if room_id in self.decode_rooms:
                raise ValueError(f"room {room_id} already has a receiver on {self.agent_name}")
            room = self.decode_rooms[room_id] = DecodeRoom(room_id, addr)
        self.lookups.request(addr)
        return room

    def drop_decode_room(self, room_id: int) -> None:
        with self._lock:
            room = self.decode_rooms.pop(room_id, None)
            if room is not None:
                self._release_staging(room)

    def _fail_decode_room(self, room: DecodeRoom, reason: str, tell_prefill: bool = True) -> None:
        """Mark Failed, quarantine its staging and (unless the news came from prefill) ABORT
        every target. Idempotent."""
        if room.failure is not None:
            return
        room.failure = reason
        logger.warning("%s room %d failed: %s", self.agent_name, room.room, reason)
        self._release_staging(room, quarantine=True)
        if tell_prefill:
            for t in room.targets or ():
                self.control.send(t.agent_name, MsgKind.ABORT, {"room": room.room, "reason": reason})

    def send_requests(self, room_id: int, page_ids: np.ndarray, aux_index: int | None, state_slots: np.ndarray) -> None:
        """Send every target its REQUEST (destination page ids, state slots, aux row, duties)."""
        with self._lock:
            room = self.decode_rooms[room_id]
            has_aux = bool(self.args.aux_data_ptrs) and aux_index is not None
            has_state = state_slots.size > 0
            targets = room.targets
            aux_sender = next((t.engine_rank for t in targets if t.plan.send_aux), None) if has_aux else None
            room.status = TransferStatus.expecting(
                {t.engine_rank for t in targets if t.plan.send_kv},
                {t.engine_rank for t in targets if t.plan.send_state and has_state},
                aux_sender,
            )
            room.init_at, room.page_ids = time.monotonic(), page_ids
            prefill: PeerInfo = self.bootstrap_cache[room.bootstrap_addr]["peer"]
            for t in targets:
                header = {"room": room_id, "engine_rank": self.args.engine_rank, "tp_rank": self.args.tp_rank,
                          "required_dst_info_num": required_dst_info_num(prefill.tp_size, self.args.tp_size),
                          "send_kv": t.plan.send_kv, "send_state": t.plan.send_state and has_state,
                          "send_aux": t.engine_rank == aux_sender, "aux_index": aux_index or 0,
                          "staging_offset": self._reserve_staging(room, t, prefill) if t.plan.send_kv else -1}
                if not self.control.send(t.agent_name, MsgKind.REQUEST, header, [page_ids, state_slots]):
                    self._fail_decode_room(room, f"prefill {t.agent_name} unreachable")
                    return

    def _reserve_staging(self, room: DecodeRoom, target: DecodeTarget, prefill: PeerInfo) -> int:
        """Staging offset for a target whose KV should land in staging first, recorded in
        ``room.staged``; -1 to receive it straight into the pool (staging off or full, MLA, or
        long page runs that make direct descriptors cheaper than the copies staging adds)."""
        if self.staging is None or self.args.is_mla:
            return -1
        self._free_due_staging()
        a = self.args
        hs = head_slice(prefill.total_kv_head_num, prefill.tp_size, target.plan.prefill_rank, a.tp_size, a.tp_rank)
        if hs is None:
            return -1
        layout = SliceLayout.of_heads(a.kv_item_lens, hs.dst_heads, hs.dst_head_offset, hs.num_heads)
        nbytes = layout.nbytes(room.page_ids.size * a.page_size)
        if hs.num_heads == hs.dst_heads:  # our tokens arrive whole: direct is one descriptor per page run
            copies = 2 if hs.num_heads == hs.src_heads else 1  # (a cut source is gathered either way)
            direct = page_run_count(room.page_ids) * len(a.kv_data_ptrs)
            if direct * self.config.descriptor_cost_bytes <= copies * nbytes:
                return -1
        off = self.staging.alloc(nbytes)
        if off is None:
            logger.debug("%s: staging full (%d bytes wanted); direct descriptors", self.agent_name, nbytes)
            return -1
        room.staged.append(StagedSlice(target.engine_rank, off, nbytes, layout))
        return off

    def _release_staging(self, room: DecodeRoom, quarantine: bool = False) -> None:
        """Give the room's staging back; ``quarantine``: not before ``heartbeat_timeout_s`` from
        now (the room failed, and a WRITE prefill posted may still land in it)."""
        due = time.monotonic() + self.config.heartbeat_timeout_s
        for st in room.staged:
            if quarantine:
                self.staging_quarantine.append((due, st.offset, st.nbytes))
            else:
                self.staging.free(st.offset, st.nbytes)
        room.staged = []

    def _free_due_staging(self) -> None:
        """Free the quarantined staging ranges whose time is up (under ``self._lock``)."""
        if not self.staging_quarantine:
            return
        now, keep = time.monotonic(), []
        for due, offset, nbytes in self.staging_quarantine:
            if now >= due:
                self.staging.free(offset, nbytes)
            else:
                keep.append((due, offset, nbytes))
        self.staging_quarantine = keep

    @property
    def staging_quarantined_bytes(self) -> int:
        with self._lock:
            return sum(n for _, _, n in self.staging_quarantine)

    def _scatter_chunk(self, room: DecodeRoom, notif: Notif) -> None:
        """Move a staged KV chunk (request pages ``[first_page, +num_pages)``) into the pool."""
        st = next((s for s in room.staged if s.engine_rank == notif.engine_rank), None)
        if st is None or notif.kind is not NotifKind.KV or not notif.num_pages:
            return
        lo, hi, page_size = notif.first_page, notif.first_page + notif.num_pages, self.args.page_size
        self.copier(st.layout).scatter(room.page_ids[lo:hi], self.staging.tensor[st.offset:st.offset + st.nbytes],
                                       room.page_ids.size * page_size, lo * page_size)
        st.scattered_pages += notif.num_pages

    def drain_notifs(self) -> None:
        """File every new transport notification into its room; bad or unknown ones are logged and dropped."""
        with self._lock:
            try:
                notifs = self.transport.drain_notifs()
            except Exception as exc:
                logger.error("%s: reading notifications failed: %s", self.agent_name, exc)
                return
            for agent_name, messages in notifs.items():
                for raw in messages:
                    self._file_notif(agent_name, raw)

    def _file_notif(self, agent_name: str, raw: bytes) -> None:
        try:
            notif = Notif.parse(raw)
        except MalformedMessage as exc:
            logger.warning("%s dropped notification from %s: %s", self.agent_name, agent_name, exc)
            return
        room = self.decode_rooms.get(notif.room)
        if room is None or room.status is None or room.failure is not None:
            logger.debug("%s dropped %r: room not waiting", self.agent_name, raw)
            return
        sender = {t.engine_rank: t.agent_name for t in room.targets}.get(notif.engine_rank)
        if sender != agent_name:
            logger.warning("%s dropped %r from %s: engine rank %d belongs to %s", self.agent_name, raw, agent_name,
                           notif.engine_rank, sender)
            return
        if notif.first_page + notif.num_pages > room.page_ids.size:
            logger.warning("%s dropped %r: pages past the request's %d", self.agent_name, raw, room.page_ids.size)
            return
        try:
            room.status.record(notif)
        except ValueError as exc:
            logger.warning("%s dropped notification: %s", self.agent_name, exc)
            return
        self._scatter_chunk(room, notif)

    def poll_decode_room(self, room_id: int) -> KVPoll:
        """Drain notifications, then say where the room stands; applies the transfer timeout."""
        self.drain_notifs()
        with self._lock:
            self._free_due_staging()
            room = self.decode_rooms[room_id]
            if room.failure is not None:
                return KVPoll.Failed
            now = time.monotonic()
            if room.targets is None:
                self.lookups.request(room.bootstrap_addr)  # again, unless in flight or just tried
                if now - room.created > self.config.bootstrap_timeout_s:
                    self._fail_decode_room(room, f"prefill at {room.bootstrap_addr} not ready within "
                                                 f"{self.config.bootstrap_timeout_s}s (last error: "
                                                 f"{room.bootstrap_error or 'none, still registering'})")
                    return KVPoll.Failed
                return KVPoll.Bootstrapping
            if room.status is None:
                return KVPoll.WaitingForInput
            if room.status.is_done():
                short = [st.engine_rank for st in room.staged if st.scattered_pages != room.page_ids.size]
                if short:  # a sender's chunks did not name every page: its staged bytes never landed
                    self._fail_decode_room(room, f"staged KV from engine ranks {short} did not cover the request")
                    return KVPoll.Failed
                self._release_staging(room)
                return KVPoll.Success
            if now - room.init_at > self.config.transfer_timeout_s:
                self._fail_decode_room(room, f"transfer not done within {self.config.transfer_timeout_s}s; "
                                             f"missing {room.status.missing()}")
                return KVPoll.Failed
            return KVPoll.Transferring

    # ---- peer events --------------------------------------------------------------------------

    def _forget_prefill(self, name: str) -> None:
        self.registered_prefill.pop(name, None)
        for addr, info in list(self.bootstrap_cache.items()):
            if any(r["agent_name"] == name for r in info["records"].values()):
                del self.bootstrap_cache[addr]

    def _decode_peer_dead(self, name: str, reason: str) -> None:
        with self._lock:
            self._forget_prefill(name)
            for room in self.decode_rooms.values():
                done = room.status is not None and room.status.is_done()
                if not done and any(t.agent_name == name for t in room.targets or ()):
                    self._fail_decode_room(room, f"prefill peer lost: {reason}")

    def _handle_reject(self, msg: Message) -> None:
        name, room_id, reason = msg.header["agent_name"], msg.header["room"], msg.header["reason"]
        with self._lock:
            if room_id == -1:
                self._forget_prefill(name)
                self.control.remove_peer(name)
                rooms = [r for r in self.decode_rooms.values() if any(t.agent_name == name for t in r.targets or ())]
            else:
                rooms = [self.decode_rooms[room_id]] if room_id in self.decode_rooms else []
            for room in rooms:
                self._fail_decode_room(room, f"prefill {name} refused: {reason}")

    def _handle_notif(self, msg: Message) -> None:
        """A notification that came as a control message (transports without their own, e.g.
        Mooncake: sent after the WRITE it names completed)."""
        with self._lock:
            self._file_notif(msg.header["agent_name"], msg.header["tag"].encode())

    def _handle_decode_abort(self, msg: Message) -> None:
        with self._lock:
            room = self.decode_rooms.get(msg.header["room"])
            if room is not None and not (room.status is not None and room.status.is_done()):
                self._fail_decode_room(room, f"prefill {msg.header['agent_name']} aborted: {msg.header['reason']}")
