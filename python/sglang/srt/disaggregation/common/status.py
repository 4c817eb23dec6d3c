"""Per-request bookkeeping on both sides; no transport calls here.

Decode: ``TransferStatus`` (upstream's fields) collects notifications keyed by the sender's
ENGINE RANK and says when a room is complete: every expected KV sender reported its last chunk
and every chunk up to it, every expected state sender reported, and the aux arrived. Upstream
keyed KV notifications by pp rank until sglang PR #22145: with PP=1 every prefill TP rank was pp
rank 0, so a room fed by several of them never completed. Completion counts distinct senders.
Prefill: ``PrefillRoom`` holds the destinations decode ranks asked for and the in-flight handles.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from sglang.srt.disaggregation.common.messages import Notif, NotifKind
from sglang.srt.disaggregation.common.rank_mapping import HeadSlice, PairPlan, StateSlice
from sglang.srt.disaggregation.common.staging import SliceLayout
from sglang.srt.disaggregation.common.trust import BootstrapAddr


@dataclass
class TransferStatus:
    """Which notifications of one room arrived; senders are engine ranks (upstream's ``_per_pp``
    names kept). ``received_kvs_per_pp``: KV chunk ids per sender; ``expected_kvs_per_pp``: chunk
    count per sender, known once its last chunk arrived; ``num_pp_ranks_expected``: KV senders
    (None: not known yet, never done). State senders are counted apart: ``received_state_per_pp``
    must hold ``len(state_senders)`` of them (upstream: ``num_pp_ranks_expected``) when
    ``expects_state``. Failure is not recorded here: the room holds it, with its reason.

    Ours beside upstream's fields: ``kv_senders`` / ``state_senders`` / ``aux_sender`` name who
    may report (None: anyone, as upstream); ``expects_aux`` False for a rank without aux buffers.
    ``record`` raises ValueError on a notification the room does not expect (unknown sender,
    duplicate chunk, chunk past the last) instead of filing it.
    """

    received_kvs_per_pp: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    expected_kvs_per_pp: dict[int, int] = field(default_factory=dict)
    num_pp_ranks_expected: int | None = None
    received_aux: bool = False
    received_state_per_pp: set[int] = field(default_factory=set)
    expects_state: bool = False
    expects_aux: bool = True
    kv_senders: frozenset[int] | None = None
    state_senders: frozenset[int] | None = None
    aux_sender: int | None = None

    @classmethod
    def expecting(cls, kv_senders, state_senders, aux_sender: int | None) -> "TransferStatus":
        """A room fed by exactly these engine ranks (aux_sender None: no aux expected)."""
        kv, state = frozenset(kv_senders), frozenset(state_senders)
        return cls(num_pp_ranks_expected=len(kv), expects_state=bool(state), expects_aux=aux_sender is not None,
                   kv_senders=kv, state_senders=state, aux_sender=aux_sender)

    @property
    def num_state_senders_expected(self) -> int:
        if self.state_senders is not None:
            return len(self.state_senders)
        return self.num_pp_ranks_expected or 0

    @property
    def num_received(self) -> int:
        """Notifications filed so far (KV chunks, state, aux)."""
        kv = sum(len(chunks) for chunks in self.received_kvs_per_pp.values())
        return kv + len(self.received_state_per_pp) + int(self.received_aux)

    def record(self, notif: Notif) -> None:
        rank = notif.engine_rank
        if notif.kind is NotifKind.KV:
            if self.kv_senders is not None and rank not in self.kv_senders:
                raise ValueError(f"room {notif.room}: KV from engine rank {rank}, expected {sorted(self.kv_senders)}")
            chunks, last = self.received_kvs_per_pp[rank], self.expected_kvs_per_pp.get(rank)
            if notif.chunk_id in chunks or (last is not None and notif.chunk_id >= last):
                raise ValueError(f"room {notif.room}: unexpected KV chunk {notif.chunk_id} from engine rank {rank}")
            if notif.is_last:
                if any(c > notif.chunk_id for c in chunks):
                    raise ValueError(f"room {notif.room}: last chunk {notif.chunk_id} below a received one")
                self.expected_kvs_per_pp[rank] = notif.chunk_id + 1
            chunks.add(notif.chunk_id)
        elif notif.kind is NotifKind.STATE:
            allowed = self.state_senders is None or rank in self.state_senders
            if not allowed or rank in self.received_state_per_pp:
                raise ValueError(f"room {notif.room}: unexpected state from engine rank {rank}")
            self.received_state_per_pp.add(rank)
        else:
            allowed = self.kv_senders is None or rank == self.aux_sender
            if not allowed or self.received_aux:
                raise ValueError(f"room {notif.room}: unexpected aux from engine rank {rank}")
            self.received_aux = True

    def _kv_done(self, rank: int) -> bool:
        expected = self.expected_kvs_per_pp.get(rank)
        return expected is not None and len(self.received_kvs_per_pp.get(rank, ())) == expected

    def is_done(self) -> bool:
        """Every expected sender reported everything (upstream's semantics, failure aside)."""
        if self.num_pp_ranks_expected is None or (self.expects_aux and not self.received_aux):
            return False
        if self.expects_state and len(self.received_state_per_pp) < self.num_state_senders_expected:
            return False
        if len(self.expected_kvs_per_pp) < self.num_pp_ranks_expected:
            return False
        return all(self._kv_done(rank) for rank in self.expected_kvs_per_pp)

    def missing(self) -> str:
        """What has not arrived, for timeout messages."""
        kv = sorted(self.received_kvs_per_pp if self.kv_senders is None else self.kv_senders)
        parts = [f"KV from engine rank {r}" for r in kv if not self._kv_done(r)]
        if self.num_pp_ranks_expected is not None and len(kv) < self.num_pp_ranks_expected:
            parts.append(f"KV from {self.num_pp_ranks_expected - len(kv)} more sender(s)")
        if self.expects_state:
            if self.state_senders is None:
                unheard = self.num_state_senders_expected - len(self.received_state_per_pp)
                parts += [f"state from {unheard} more sender(s)"] if unheard > 0 else []
            else:
                unheard = sorted(self.state_senders - self.received_state_per_pp)
                parts += [f"state from engine rank {r}" for r in unheard]
        if self.expects_aux and not self.received_aux:
            parts.append("aux" if self.aux_sender is None else f"aux from engine rank {self.aux_sender}")
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
    state_slices: list[list[StateSlice]]  # per state buffer: the row runs this destination gets
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
    claims: set[str] = field(default_factory=set)  # decode agents that claimed it (CLAIM or REQUEST)
    num_pages: int | None = None
    aux_index: int | None = None
    pages_sent: int = 0
    last_posted: bool = False
    transfer_started: float | None = None
    handles: list[Transfer] = field(default_factory=list)
    failure: str | None = None
    has_sender: bool = False  # a sender (PDKVSender) drives it (else decode requests opened it)

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
    bootstrap_addr: BootstrapAddr
    created: float = field(default_factory=time.monotonic)
    targets: list[DecodeTarget] | None = None
    status: TransferStatus | None = None
    init_at: float | None = None
    failure: str | None = None
    bootstrap_error: str | None = None  # last lookup error while Bootstrapping
    page_ids: np.ndarray | None = None  # destination pages, once init() ran
    staged: list[StagedSlice] = field(default_factory=list)
