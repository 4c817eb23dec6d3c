"""Per-request bookkeeping on both sides; no transport calls here.

Decode: ``TransferStatus`` collects notifications keyed by the sender's ENGINE RANK and says
when a room is complete: every expected KV sender reported its last chunk and every chunk up to
it, every expected state sender reported, and the aux sender reported (pitfall 12 of the
upstream notes: senders are engine ranks, and completion counts distinct senders, not messages).
Prefill: ``PrefillRoom`` holds the destinations decode ranks asked for and the in-flight handles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from sglang.srt.disaggregation.common.messages import Notif, NotifKind
from sglang.srt.disaggregation.common.rank_mapping import HeadSlice, PairPlan, StateSlice
from sglang.srt.disaggregation.common.staging import SliceLayout


class TransferStatus:
    """Which notifications of one room arrived. ``record`` raises ValueError on a notification
    the room does not expect (unknown sender, duplicate chunk, chunk past the last)."""

    def __init__(self, kv_senders: set[int], state_senders: set[int], aux_sender: int | None):
        self.kv_senders, self.state_senders, self.aux_sender = set(kv_senders), set(state_senders), aux_sender
        self.chunks: dict[int, set[int]] = {r: set() for r in kv_senders}
        self.last_chunk: dict[int, int] = {}
        self.state_from: set[int] = set()
        self.aux_received = False
        self.num_received = 0

    def record(self, notif: Notif) -> None:
        rank = notif.engine_rank
        if notif.kind is NotifKind.KV:
            if rank not in self.kv_senders:
                raise ValueError(f"room {notif.room}: KV from engine rank {rank}, expected {sorted(self.kv_senders)}")
            last = self.last_chunk.get(rank)
            if notif.chunk_id in self.chunks[rank] or (last is not None and notif.chunk_id > last):
                raise ValueError(f"room {notif.room}: unexpected KV chunk {notif.chunk_id} from engine rank {rank}")
            if notif.is_last:
                if any(c > notif.chunk_id for c in self.chunks[rank]):
                    raise ValueError(f"room {notif.room}: last chunk {notif.chunk_id} below a received one")
                self.last_chunk[rank] = notif.chunk_id
            self.chunks[rank].add(notif.chunk_id)
        elif notif.kind is NotifKind.STATE:
            if rank not in self.state_senders or rank in self.state_from:
                raise ValueError(f"room {notif.room}: unexpected state from engine rank {rank}")
            self.state_from.add(rank)
        else:
            if rank != self.aux_sender or self.aux_received:
                raise ValueError(f"room {notif.room}: unexpected aux from engine rank {rank}")
            self.aux_received = True
        self.num_received += 1

    def _kv_done(self, rank: int) -> bool:
        last = self.last_chunk.get(rank)
        return last is not None and len(self.chunks[rank]) == last + 1

    def is_done(self) -> bool:
        return (
            all(self._kv_done(r) for r in self.kv_senders)
            and self.state_from == self.state_senders
            and (self.aux_sender is None or self.aux_received)
        )

    def missing(self) -> str:
        """What has not arrived, for timeout messages."""
        parts = [f"KV from engine rank {r}" for r in sorted(self.kv_senders) if not self._kv_done(r)]
        parts += [f"state from engine rank {r}" for r in sorted(self.state_senders - self.state_from)]
        if self.aux_sender is not None and not self.aux_received:
            parts.append(f"aux from engine rank {self.aux_sender}")
        return ", ".join(parts) or "nothing"


@dataclass
class DstInfo:
    """One decode rank's destination for a room, as its REQUEST named it (validated)."""

    agent_name: str
    engine_rank: int
    tp_rank: int
    page_ids: np.ndarray
    state_slots: np.ndarray
    aux_index: int
    send_kv: bool
    send_state: bool
    send_aux: bool
    head_slice: HeadSlice | None  # None: whole pages (MLA or same heads on both sides)
    state_slices: list[StateSlice | None]
    staging_offset: int = -1  # >= 0: write the KV in staged layout into the decode's staging area there
    layout: SliceLayout | None = None  # bytes of each source token this destination receives
    next_chunk: int = 0  # KV chunk ids count per destination (a send may post several chunks)


@dataclass
class Transfer:
    """A posted WRITE and the staging range (offset, bytes) it reads from, if any."""

    agent_name: str
    handle: object
    staging: tuple[int, int] | None = None


@dataclass
class PrefillRoom:
    room: int
    created: float = field(default_factory=time.monotonic)
    required_dst_info_num: int | None = None
    dsts: dict[str, DstInfo] = field(default_factory=dict)
    num_pages: int | None = None
    aux_index: int | None = None
    pages_sent: int = 0
    last_posted: bool = False
    transfer_started: float | None = None
    handles: list[Transfer] = field(default_factory=list)
    failure: str | None = None
    has_sender: bool = False  # a NixlKVSender drives it (else decode requests opened it)

    @property
    def ready(self) -> bool:
        return self.required_dst_info_num is not None and len(self.dsts) >= self.required_dst_info_num


@dataclass
class DecodeTarget:
    """A prefill rank this decode rank talks to for a room."""

    plan: PairPlan
    agent_name: str
    engine_rank: int


@dataclass
class StagedSlice:
    """Decode staging range one prefill rank (``engine_rank``) writes the room's KV into, in
    staged layout; each KV chunk is scattered into the pool (``layout`` of the decode's tokens)
    as its notification arrives. ``scattered_pages`` counts the request pages done."""

    engine_rank: int
    offset: int
    nbytes: int
    layout: SliceLayout
    scattered_pages: int = 0


@dataclass
class DecodeRoom:
    room: int
    bootstrap_addr: str
    created: float = field(default_factory=time.monotonic)
    targets: list[DecodeTarget] | None = None
    status: TransferStatus | None = None
    init_at: float | None = None
    failure: str | None = None
    bootstrap_error: str | None = None  # last lookup error while Bootstrapping
    page_ids: np.ndarray | None = None  # destination pages, once init() ran
    staged: list[StagedSlice] = field(default_factory=list)
