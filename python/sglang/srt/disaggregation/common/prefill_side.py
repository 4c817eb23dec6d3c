"""Prefill half of PDKVManager: decode registrations, claims, requests, chunk sends and room
polling.

Mixed into ``PDKVManager``; uses its ``_lock``, ``transport``, ``control``, ``args`` and the
``send_*`` byte movers. Mutates ``self.decode_peers`` and ``self.prefill_rooms``.

A room waits for its decode destinations at most ``bootstrap_timeout_s`` (upstream's
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``: decode may wait that long for memory), but only
while a live decode rank claims it: a room no decode rank claimed within ``claim_timeout_s``
fails (its decode server never got the request: dead, or refused it), and so does every room a
decode peer claimed when that peer dies.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from sglang.srt.disaggregation.base.conn import IncompatiblePeerError, KVPoll, KVTransferError
from sglang.srt.disaggregation.common.compat import PeerInfo, check_peer_compat, split_segments
from sglang.srt.disaggregation.common.messages import Message, MsgKind, Notif, NotifKind
from sglang.srt.disaggregation.common.rank_mapping import head_slice, required_dst_info_num, state_row_slices
from sglang.srt.disaggregation.common.staging import SliceLayout
from sglang.srt.disaggregation.common.status import DstInfo, PrefillRoom

logger = logging.getLogger(__name__)

MAX_TOMBSTONES = 4096  # failed room ids remembered for late requests


def _rows(lens, item_lens) -> int:
    """Items every buffer can hold (0 when there are no buffers)."""
    return min((n // i for n, i in zip(lens, item_lens)), default=0)


def _check_ids(ids: np.ndarray, limit: int, what: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise ValueError(f"{what} must lie in [0, {limit}), got min {int(ids.min())} max {int(ids.max())}")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{what} name the same id twice")


class PrefillSideMixin:
    # ---- decode registration ------------------------------------------------------------------

    def _handle_register(self, msg: Message) -> None:
        h = msg.header
        name = h["agent_name"]
        try:
            peer = PeerInfo.from_json(h["peer"])
            check_peer_compat(self.peer_info, peer)
            if not 0 <= h["tp_rank"] < peer.tp_size:
                raise ValueError(f"tp_rank {h['tp_rank']} outside [0, tp_size={peer.tp_size})")
            for what, ptrs, lens, items in (("KV", "kv_ptrs", "kv_lens", peer.kv_item_lens),
                                            ("aux", "aux_ptrs", "aux_lens", peer.aux_item_lens),
                                            ("state", "state_ptrs", "state_lens", peer.state_item_lens)):
                if not len(h[ptrs]) == len(h[lens]) == len(items):
                    raise ValueError(f"{what} buffers: {len(h[ptrs])} pointers, {len(h[lens])} lengths, "
                                     f"{len(items)} item sizes")
            with self._lock:
                self.transport.add_peer(name, msg.blobs[0])  # ValueError on metadata it cannot use
        except (ValueError, IncompatiblePeerError) as exc:
            logger.error("%s refused decode %s (engine rank %s): %s", self.agent_name, name, h["engine_rank"], exc)
            self.control.send_to(h["ip"], h["port"], MsgKind.REJECT, {"room": -1, "reason": str(exc)})
            return
        kv_heads = None if self.args.is_mla else head_slice(
            self.args.effective_total_kv_head_num, self.args.tp_size, self.args.tp_rank, peer.tp_size, h["tp_rank"])
        record = dict(h, peer=peer.to_json(), head_slice=kv_heads,
                      max_pages=_rows(h["kv_lens"], [i * peer.page_size for i in peer.kv_item_lens]),
                      max_aux=_rows(h["aux_lens"], peer.aux_item_lens),
                      max_state=_rows(h["state_lens"], peer.state_item_lens))
        with self._lock:
            self.decode_peers[name] = record
        self.control.add_peer(name, h["ip"], h["port"])
        logger.info("%s accepted decode %s (tp %d/%d)", self.agent_name, name, h["tp_rank"], peer.tp_size)

    def _open_room(self, room_id: int, name: str) -> PrefillRoom | None:
        """The room a decode message names (opened sender-less if new); None, after answering
        with ABORT, when the room already failed."""
        failure = self.failed_rooms.get(room_id)
        room = self.prefill_rooms.get(room_id) if failure is None else None
        if room is None and failure is None:
            room = self.prefill_rooms[room_id] = PrefillRoom(room_id)
        failure = failure or room.failure
        if failure is not None:  # e.g. it timed out waiting for this very decode
            self.control.send(name, MsgKind.ABORT, {"room": room_id, "reason": failure})
            return None
        return room

    def _handle_claim(self, msg: Message) -> None:
        name, room_id = msg.header["agent_name"], msg.header["room"]
        with self._lock:
            if name not in self.decode_peers:
                logger.warning("%s dropped a claim of room %d from unregistered %s", self.agent_name, room_id, name)
                return
            room = self._open_room(room_id, name)
            if room is not None:
                room.claims.add(name)

    def _validate_request(self, msg: Message, peer: dict) -> DstInfo:
        """Check a REQUEST against the decode rank's registration; raise ValueError naming values."""
        h, p = msg.header, peer["peer"]
        page_ids, slots = msg.int64_blob(0).copy(), msg.int64_blob(1).copy()
        tp_rank, td, tp = h["tp_rank"], p["tp_size"], self.args.tp_size
        if tp_rank != peer["tp_rank"]:
            raise ValueError(f"request tp_rank {tp_rank} differs from registered tp_rank {peer['tp_rank']}")
        expected = required_dst_info_num(tp, td)
        if h["required_dst_info_num"] != expected:
            raise ValueError(f"required_dst_info_num {h['required_dst_info_num']} but tp {tp} -> {td} needs {expected}")
        _check_ids(page_ids, peer["max_pages"], "destination page ids")
        if h["send_state"]:
            _check_ids(slots, peer["max_state"], "destination state slots")
        if h["send_aux"] and not 0 <= h["aux_index"] < peer["max_aux"]:
            raise ValueError(f"aux_index must lie in [0, {peer['max_aux']}), got {h['aux_index']}")
        hs = None
        if h["send_kv"] and not self.args.is_mla:
            hs = peer["head_slice"]
            if hs is None:
                raise ValueError(f"asks prefill tp_rank {self.args.tp_rank} for KV it holds none of "
                                 f"(decode tp_rank {tp_rank})")
            hs = None if hs.is_whole_token else hs
        layout = None
        if h["send_kv"]:
            layout = (SliceLayout((0,) * len(self.args.kv_item_lens), tuple(self.args.kv_item_lens)) if hs is None
                      else SliceLayout.of_heads(self.args.kv_item_lens, hs.src_heads, hs.src_head_offset, hs.num_heads))
        staging_offset = h["staging_offset"]
        if staging_offset >= 0:
            need = layout.nbytes(page_ids.size * p["page_size"]) if layout else 0
            if layout is None or self.args.is_mla or staging_offset + need > peer["staging_len"]:
                raise ValueError(f"staging_offset {staging_offset} (+{need} bytes) unusable: staging holds "
                                 f"{peer['staging_len']} bytes, KV {'sent' if layout else 'not sent'}")
        state_slices = []
        if h["send_state"]:
            dst_segments = split_segments(p.get("state_segments", ()), p["state_dims"])
            state_slices = [state_row_slices(sp, sd, tp, self.args.tp_rank, td, tp_rank)
                            for sp, sd in zip(self.args.state_row_segments, dst_segments)]
        return DstInfo(h["agent_name"], h["engine_rank"], tp_rank, page_ids, slots, h["aux_index"], h["send_kv"],
                       h["send_state"], h["send_aux"], hs, state_slices, staging_offset, layout)

    def _handle_request(self, msg: Message) -> None:
        name, room_id = msg.header["agent_name"], msg.header["room"]
        with self._lock:
            peer = self.decode_peers.get(name)
            if peer is None:
                logger.warning("%s dropped request for room %d from unregistered %s", self.agent_name, room_id, name)
                return
            try:
                dst = self._validate_request(msg, peer)
            except (ValueError, IncompatiblePeerError) as exc:
                logger.error("%s refused room %d from %s: %s", self.agent_name, room_id, name, exc)
                self.control.send(name, MsgKind.REJECT, {"room": room_id, "reason": str(exc)})
                return
            room = self._open_room(room_id, name)
            if room is None:
                return
            room.claims.add(name)
            if name in room.dsts:
                logger.warning("%s dropped a second request for room %d from %s", self.agent_name, room_id, name)
                return
            room.required_dst_info_num = msg.header["required_dst_info_num"]
            room.dsts[name] = dst
        logger.debug("%s room %d: destination %s (%d pages)", self.agent_name, room_id, name, dst.page_ids.size)

    def _handle_prefill_abort(self, msg: Message) -> None:
        with self._lock:
            room = self.prefill_rooms.get(msg.header["room"])
            if room is not None:
                reason = f"decode {msg.header['agent_name']} aborted: {msg.header['reason']}"
                self._fail_prefill_room(room, reason)

    def _prefill_peer_dead(self, name: str, reason: str) -> None:
        with self._lock:
            for room in list(self.prefill_rooms.values()):  # failing may drop sender-less rooms
                if name in room.claims and not (room.last_posted and not room.handles):
                    self._fail_prefill_room(room, f"decode peer lost: {reason}")
            self.decode_peers.pop(name, None)
            self.transport.remove_peer(name)

    # ---- rooms --------------------------------------------------------------------------------

    def prefill_room(self, room_id: int) -> PrefillRoom:
        """The room a new sender drives: the one decode requests opened, else a fresh one (already
        Failed when the room id is a tombstone)."""
        with self._lock:
            room = self.prefill_rooms.get(room_id)
            if room is None:
                room = self.prefill_rooms[room_id] = PrefillRoom(room_id)
                room.failure = self.failed_rooms.pop(room_id, None)
            room.has_sender = True
            return room

    def drop_prefill_room(self, room_id: int) -> None:
        """Forget a finished room; a failed one leaves a tombstone so that a late REQUEST for it
        is answered with ABORT instead of opening a room nobody will serve."""
        with self._lock:
            room = self.prefill_rooms.pop(room_id, None)
            if room is not None and room.failure is not None:
                self.failed_rooms[room_id] = room.failure
                while len(self.failed_rooms) > MAX_TOMBSTONES:
                    self.failed_rooms.popitem(last=False)

    def _fail_prefill_room(self, room: PrefillRoom, reason: str) -> None:
        """Mark Failed, release in-flight handles, tell every destination (ABORT). Idempotent."""
        if room.failure is not None:
            return
        room.failure = reason
        logger.warning("%s room %d failed: %s", self.agent_name, room.room, reason)
        for transfer in room.handles:
            self.finish(transfer)
        room.handles = []
        for name in room.claims:  # every decode rank that claimed it (those that sent a request too)
            self.control.send(name, MsgKind.ABORT, {"room": room.room, "reason": reason})
        if not room.has_sender:  # opened by decode requests only: nobody will poll it
            self.drop_prefill_room(room.room)

    def send_chunk(self, room_id: int, src_pages: np.ndarray, state_slots: np.ndarray | None) -> None:
        """Post the next chunk of ``src_pages`` (page ids) to every destination; on the chunk that
        completes ``num_pages`` also state (``state_slots``, request slots) and aux. A transfer
        error fails the room; bad arguments raise ValueError."""
        with self._lock:
            room = self.prefill_rooms[room_id]
            if room.failure is not None:
                return
            if not room.ready or room.num_pages is None:
                raise ValueError(f"room {room_id}: send before the destinations arrived and init() was called")
            if room.last_posted or room.pages_sent + src_pages.size > room.num_pages:
                raise ValueError(f"room {room_id}: chunk of {src_pages.size} pages after {room.pages_sent} sent "
                                 f"exceeds num_kv_indices {room.num_pages}")
            _check_ids(src_pages, min(self.args.num_kv_pages), "source page ids")
            is_last = room.pages_sent + src_pages.size == room.num_pages
            try:
                self._process_kvcache_transfer(room, src_pages, state_slots, is_last)
            except KVTransferError as exc:
                self._fail_prefill_room(room, str(exc))
                return
            room.pages_sent += src_pages.size
            room.last_posted = is_last
            room.transfer_started = room.transfer_started or time.monotonic()

    def _process_kvcache_transfer(self, room: PrefillRoom, src_pages, state_slots, is_last: bool) -> None:
        """Post one chunk to every destination of ``room``: its KV (``send_kvcache``, request
        pages [pages_sent, +len(src_pages)) of each), and on the last chunk state and aux. Every
        notification names this rank's ENGINE rank (upstream's name for this step; it tagged KV
        with the pp rank until sglang PR #22145). Raises KVTransferError; the caller fails the room."""
        rank, lo, hi = self.args.engine_rank, room.pages_sent, room.pages_sent + src_pages.size
        dsts = sorted(room.dsts.values(), key=lambda d: d.tp_rank)
        for dst in dsts:  # check every destination before posting to any
            if dst.agent_name not in self.decode_peers:
                raise KVTransferError(f"decode {dst.agent_name} is gone")
            if dst.send_kv and dst.page_ids.size != room.num_pages:
                raise KVTransferError(f"decode {dst.agent_name} gave {dst.page_ids.size} pages, "
                                      f"prefill has {room.num_pages}")
        pieces = []  # staged KV of every destination, pipelined together
        for dst in dsts:
            if dst.send_kv:
                pieces += self.send_kvcache(room, dst, self.decode_peers[dst.agent_name], src_pages,
                                            dst.page_ids[lo:hi], lo, is_last)
        self.post_pieces(room, pieces)
        for dst in dsts:
            peer = self.decode_peers[dst.agent_name]
            if is_last and dst.send_state:
                if state_slots is None or state_slots.size != dst.state_slots.size:
                    raise KVTransferError(f"decode {dst.agent_name} expects {dst.state_slots.size} state slots, "
                                          f"send() got {None if state_slots is None else state_slots.size}")
                self._track(room, self.send_state(dst, peer, state_slots, Notif(room.room, NotifKind.STATE, rank)))
            if is_last and dst.send_aux:
                if room.aux_index is None:
                    raise KVTransferError(f"decode {dst.agent_name} expects aux but init() gave no aux_index")
                self._track(room, self.send_aux(dst, peer, room.aux_index, Notif(room.room, NotifKind.AUX, rank)))

    @staticmethod
    def _track(room: PrefillRoom, transfer) -> None:
        if transfer is not None:
            room.handles.append(transfer)

    def poll_prefill_room(self, room_id: int) -> KVPoll:
        """Advance a room: drive its transfers (NIXL needs polling to finish large ones), release
        finished handles, apply timeouts."""
        with self._lock:
            room = self.prefill_rooms[room_id]
            if room.failure is not None:
                return KVPoll.Failed
            now = time.monotonic()
            if not room.ready:
                claim_s = self.config.claim_timeout_s
                if (not room.claims and claim_s < self.config.bootstrap_timeout_s and now - room.created > claim_s):
                    self._fail_prefill_room(room, f"no decode server claimed the room within {claim_s}s (the "
                                                  "router's decode server is down or refused the request)")
                    return KVPoll.Failed
                if now - room.created > self.config.bootstrap_timeout_s:
                    got = f"{len(room.dsts)} of {room.required_dst_info_num or '?'}"
                    self._fail_prefill_room(room, f"only {got} decode destinations arrived within "
                                                  f"{self.config.bootstrap_timeout_s}s")
                    return KVPoll.Failed
                return KVPoll.Bootstrapping
            pending, failed = [], None
            for transfer in room.handles:
                state = "PROC" if failed else self.check(transfer)
                if state == "DONE":
                    self.finish(transfer)
                else:
                    pending.append(transfer)
                    failed = failed or (transfer if state == "ERR" else None)
            room.handles = pending  # finished transfers leave before a failure releases the rest
            if failed is not None:
                backend = self.transport.backend.upper()
                self._fail_prefill_room(room, f"{backend} transfer to {failed.agent_name} failed")
                return KVPoll.Failed
            if room.last_posted and not pending:
                return KVPoll.Success
            if room.transfer_started is None:
                return KVPoll.WaitingForInput
            if now - room.transfer_started > self.config.transfer_timeout_s:
                self._fail_prefill_room(room, f"transfer not done within {self.config.transfer_timeout_s}s")
                return KVPoll.Failed
            return KVPoll.Transferring
