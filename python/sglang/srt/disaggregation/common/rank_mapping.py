"""Which prefill ranks feed which decode rank, and which heads / state rows each one moves.

Tp, Td = prefill and decode attention TP sizes; H = total KV heads of the model. A rank of a
side with T ranks holds ``max(1, H // T)`` heads. When T > H the heads are replicated
contiguously: ranks [g * T/H, (g + 1) * T/H) all hold head g. Every slice here is computed as
the intersection of the global heads a prefill rank holds with the global heads a decode rank
owns, so replication on either side needs no special case (pitfall 11 of the upstream notes:
a round-robin offset would hand decode ranks heads 0,1,0,1 instead of 0,0,1,1).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.disaggregation.base.conn import IncompatiblePeerError


def check_tp_size(total_heads: int, tp_size: int, side: str) -> None:
    """Raise IncompatiblePeerError unless ``tp_size`` splits (or replicates) ``total_heads`` evenly."""
    if total_heads < 1 or tp_size < 1:
        raise IncompatiblePeerError(f"{side}: total_kv_head_num {total_heads} and tp_size {tp_size} must be >= 1")
    if (tp_size <= total_heads and total_heads % tp_size) or (tp_size > total_heads and tp_size % total_heads):
        raise IncompatiblePeerError(
            f"{side} tp_size {tp_size} neither divides nor is a multiple of total_kv_head_num {total_heads}"
        )


def check_tp_pairing(prefill_tp: int, decode_tp: int) -> None:
    """Raise IncompatiblePeerError unless one TP size divides the other."""
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise IncompatiblePeerError(
            f"prefill tp_size {prefill_tp} and decode tp_size {decode_tp} cannot be mapped: one must divide the other"
        )


def heads_per_rank(total_heads: int, tp_size: int) -> int:
    return max(1, total_heads // tp_size)


def owned_heads(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads held by ``tp_rank`` under contiguous replication."""
    per_rank = heads_per_rank(total_heads, tp_size)
    replicas = max(1, tp_size // total_heads)
    start = (tp_rank // replicas) * per_rank
    return range(start, start + per_rank)


def target_prefill_ranks(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[int]:
    """Prefill TP ranks that decode rank ``decode_rank`` talks to (all of them get a request)."""
    check_tp_pairing(prefill_tp, decode_tp)
    if not 0 <= decode_rank < decode_tp:
        raise ValueError(f"decode_rank {decode_rank} outside [0, decode_tp={decode_tp})")
    if decode_tp >= prefill_tp:
        return [decode_rank // (decode_tp // prefill_tp)]
    ratio = prefill_tp // decode_tp
    return list(range(decode_rank * ratio, (decode_rank + 1) * ratio))


def required_dst_info_num(prefill_tp: int, decode_tp: int) -> int:
    """Decode ranks that send one prefill rank a request for the same room."""
    return max(1, decode_tp // prefill_tp)


@dataclass(frozen=True)
class HeadSlice:
    """Heads moved per token: ``num_heads`` heads from head ``src_head_offset`` of the source
    token (which holds ``src_heads``) to head ``dst_head_offset`` of the destination token (which
    holds ``dst_heads``). Offsets are local head indices, not global ones."""

    src_head_offset: int
    dst_head_offset: int
    num_heads: int
    src_heads: int
    dst_heads: int

    @property
    def is_whole_token(self) -> bool:
        """Source and destination tokens are the same heads: whole pages can be copied."""
        return self.num_heads == self.src_heads == self.dst_heads


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def head_slice(total_heads: int, prefill_tp: int, prefill_rank: int, decode_tp: int,
               decode_rank: int) -> HeadSlice | None:
    """The heads prefill rank sends decode rank, or None when it holds none the decode rank owns."""
    held = owned_heads(total_heads, prefill_tp, prefill_rank)
    needed = owned_heads(total_heads, decode_tp, decode_rank)
    common = _intersect(held, needed)
    if not common:
        return None
    return HeadSlice(common.start - held.start, common.start - needed.start, len(common), len(held), len(needed))


@dataclass(frozen=True)
class StateSlice:
    """Rows of a TP-sharded state item moved per request slot (rows of dim 0 of the item)."""

    src_row_offset: int
    dst_row_offset: int
    num_rows: int


def state_slice(src_rows: int, dst_rows: int, prefill_tp: int, prefill_rank: int, decode_tp: int,
                decode_rank: int) -> StateSlice | None:
    """Rows prefill rank sends decode rank for one state buffer, None when the shards are disjoint.

    Prefill rank p holds global rows [p * src_rows, (p + 1) * src_rows); the totals must agree.
    """
    if src_rows * prefill_tp != dst_rows * decode_tp:
        raise IncompatiblePeerError(
            f"state dim: prefill {src_rows} rows x tp {prefill_tp} != decode {dst_rows} rows x tp {decode_tp}"
        )
    held = range(prefill_rank * src_rows, (prefill_rank + 1) * src_rows)
    needed = range(decode_rank * dst_rows, (decode_rank + 1) * dst_rows)
    common = _intersect(held, needed)
    if not common:
        return None
    return StateSlice(common.start - held.start, common.start - needed.start, len(common))


def state_row_slices(src_segments, dst_segments, prefill_tp: int, prefill_rank: int, decode_tp: int,
                     decode_rank: int) -> list[StateSlice]:
    """Row runs prefill rank sends decode rank for one state buffer whose dim 0 is made of
    segments sharded across TP separately (Qwen3-Next's conv state: a rank holds its q, k and v
    channels, so TP 2 -> 1 joins q0 q1 | k0 k1 | v0 v1, not q0 k0 v0 | q1 k1 v1). ``*_segments``:
    rows of each segment on one rank of that side. [] when the shards are disjoint; raises
    IncompatiblePeerError when the segment counts or totals differ."""
    if len(src_segments) != len(dst_segments):
        raise IncompatiblePeerError(f"state segments: prefill {list(src_segments)} vs decode {list(dst_segments)}")
    runs, src_base, dst_base = [], 0, 0
    for src_rows, dst_rows in zip(src_segments, dst_segments):
        sl = state_slice(src_rows, dst_rows, prefill_tp, prefill_rank, decode_tp, decode_rank)
        if sl is not None:
            runs.append(StateSlice(src_base + sl.src_row_offset, dst_base + sl.dst_row_offset, sl.num_rows))
        src_base, dst_base = src_base + src_rows, dst_base + dst_rows
    return runs


@dataclass(frozen=True)
class PairPlan:
    """What one target prefill rank sends one decode rank for a request."""

    prefill_rank: int
    send_kv: bool
    send_state: bool
    send_aux: bool

    @property
    def sends_anything(self) -> bool:
        return self.send_kv or self.send_state or self.send_aux


def plan_decode_rank(total_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, is_mla: bool,
                     has_state: bool) -> list[PairPlan]:
    """One PairPlan per target prefill rank, in target order.

    KV: MLA latents are replicated, so only the first target sends them. MHA: a target sends KV
    when it holds owned heads that no earlier target already covers, so replicated prefill ranks
    never write the same bytes twice. State: every target (each holds a distinct shard, or the
    single target holds a superset). Aux: the first target.
    """
    targets = target_prefill_ranks(prefill_tp, decode_tp, decode_rank)
    if is_mla:
        return [PairPlan(p, i == 0, has_state, i == 0) for i, p in enumerate(targets)]
    check_tp_size(total_heads, prefill_tp, "prefill")
    check_tp_size(total_heads, decode_tp, "decode")
    needed = owned_heads(total_heads, decode_tp, decode_rank)
    covered: set[int] = set()
    plans = []
    for i, p in enumerate(targets):
        common = set(_intersect(owned_heads(total_heads, prefill_tp, p), needed))
        fresh = bool(common - covered)
        if fresh and common & covered:
            raise AssertionError(f"prefill rank {p} partially overlaps heads already covered for decode {decode_rank}")
        covered |= common
        plans.append(PairPlan(p, fresh, has_state, i == 0))
    if covered != set(needed):
        raise IncompatiblePeerError(
            f"decode rank {decode_rank} needs heads {list(needed)} but prefill ranks {targets} hold {sorted(covered)}"
        )
    return plans
