"""The per-request ends of a PD room, whatever the transport: ``PDKVSender`` (prefill) and
``PDKVReceiver`` (decode) on a ``PDKVManager`` (``common/manager.py``). Each backend names them
(``NixlKVSender`` / ``NixlKVReceiver`` in ``nixl/conn.py``, ``MooncakeKV...`` in
``mooncake/conn.py``).

Per request, decode: ``Receiver(mgr, addr, room)`` -> poll() until WaitingForInput ->
``init(page_ids, aux_index, state_slots)`` -> poll() until Success or Failed. Prefill:
``Sender(mgr, addr, room)`` -> ``init(num_pages, aux_index)`` -> poll() until WaitingForInput ->
``send(page_ids)`` per chunk (state slots with the last) -> poll() until Success or Failed.
Polling drives the transfers, so schedulers poll every step. On Failed the caller frees the
request's pages; ``failure_exception()`` says why.
"""

from __future__ import annotations

from sglang.srt.disaggregation.base.conn import (
    BaseKVReceiver,
    BaseKVSender,
    DisaggregationMode,
    KVPoll,
    KVTransferError,
    as_page_ids,
)
from sglang.srt.disaggregation.common.manager import PDKVManager

_TERMINAL = (KVPoll.Success, KVPoll.Failed)


def _check_mode(mgr: PDKVManager, mode: DisaggregationMode, who: str) -> None:
    if mgr.mode is not mode:
        raise ValueError(f"{who} needs a {mode.value} {type(mgr).__name__}, got a {mgr.mode.value} one")


class _RoomEnd:
    """One side's end of a room: its terminal state, the failure reason, and abort.

    Subclasses set ``mgr``, ``room``, ``_room`` and implement ``_fail_room`` / ``_drop_room``.
    """

    _final: KVPoll | None = None
    _failure: str | None = None

    def _fail_room(self, reason: str) -> None:
        raise NotImplementedError

    def _drop_room(self) -> None:
        raise NotImplementedError

    def _finish(self, state: KVPoll) -> None:
        self._final, self._failure = state, self._room.failure
        self._drop_room()

    def failure_exception(self) -> KVTransferError | None:
        return None if self._failure is None else KVTransferError(f"room {self.room}: {self._failure}")

    def abort(self) -> None:
        """Fail the room now, release its transfers and tell the peers."""
        if self._final is not None:
            return
        with self.mgr._lock:
            self._fail_room(f"aborted by {self.mgr.mode.value}")
        self._finish(KVPoll.Failed)


class PDKVSender(_RoomEnd, BaseKVSender):
    """Prefill side of room ``bootstrap_room``. Mutates the manager's room of that id."""

    def __init__(self, mgr: PDKVManager, bootstrap_addr: str, bootstrap_room: int):
        _check_mode(mgr, DisaggregationMode.PREFILL, type(self).__name__)
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room)
        self._room = mgr.prefill_room(self.room)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """``num_kv_indices``: pages of the whole request; ``aux_index``: row of the aux buffers."""
        if num_kv_indices < 0:
            raise ValueError(f"num_kv_indices must be >= 0, got {num_kv_indices}")
        with self.mgr._lock:
            self._room.num_pages, self._room.aux_index = int(num_kv_indices), aux_index

    def send(self, kv_indices, state_indices=None) -> None:
        """Post a chunk of source page ids; ``state_indices`` (request slots) go with the last."""
        if self._final is not None:
            return
        slots = None if state_indices is None else as_page_ids(state_indices, "state_indices")
        self.mgr.send_chunk(self.room, as_page_ids(kv_indices, "kv_indices"), slots)

    def poll(self) -> KVPoll:
        if self._final is not None:
            return self._final
        state = self.mgr.poll_prefill_room(self.room)
        if state in _TERMINAL:
            self._finish(state)
        return state

    def _fail_room(self, reason: str) -> None:
        self.mgr._fail_prefill_room(self._room, reason)

    def _drop_room(self) -> None:
        self.mgr.drop_prefill_room(self.room)


class PDKVReceiver(_RoomEnd, BaseKVReceiver):
    """Decode side of room ``bootstrap_room`` fed by the prefill cluster at ``bootstrap_addr``."""

    def __init__(self, mgr: PDKVManager, bootstrap_addr, bootstrap_room: int):
        """``bootstrap_addr``: a BootstrapAddr or "host:port". Raises ValueError when it is
        malformed, UntrustedPeerError (a ValueError) when this rank may not contact it (nothing
        is sent there), or when the room is already open here. The bootstrap lookup starts at
        once on the manager's lookup workers (a poll never waits on it): an unreachable server
        is retried until the bootstrap timeout (prefill may still be starting), an
        incompatible or unauthenticated one fails the room."""
        _check_mode(mgr, DisaggregationMode.DECODE, type(self).__name__)
        self.mgr, self.room = mgr, int(bootstrap_room)
        self._room = mgr.decode_room(self.room, bootstrap_addr)
        self.bootstrap_addr = self._room.bootstrap_addr

    def init(self, kv_indices, aux_index: int | None = None, state_indices=None) -> None:
        """Start the transfer into destination page ids ``kv_indices`` (and aux row, state slots).

        Raises ValueError before bootstrap finished or on ids outside this rank's buffers.
        """
        if self.poll() is KVPoll.Failed:
            return
        if self._room.targets is None or self._room.status is not None:
            raise ValueError(f"room {self.room}: init() needs state WaitingForInput, got {self.poll().name}")
        a = self.mgr.args
        pages = as_page_ids(kv_indices, "kv_indices")
        slots = as_page_ids([] if state_indices is None else state_indices, "state_indices")
        limit = min(a.num_kv_pages)
        if pages.size and (pages.min() < 0 or pages.max() >= limit):
            raise ValueError(f"kv_indices must be page ids in [0, {limit}), got [{pages.min()}, {pages.max()}]")
        if slots.size and not a.state_data_ptrs:
            raise ValueError(f"state_indices {slots.tolist()} given but this rank registered no state buffers")
        self.mgr.send_requests(self.room, pages, aux_index, slots)

    def poll(self) -> KVPoll:
        if self._final is not None:
            return self._final
        state = self.mgr.poll_decode_room(self.room)
        if state in _TERMINAL:
            self._finish(state)
        return state

    def _fail_room(self, reason: str) -> None:
        self.mgr._fail_decode_room(self._room, reason)

    def _drop_room(self) -> None:
        self.mgr.drop_decode_room(self.room)
