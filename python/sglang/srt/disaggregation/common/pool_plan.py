"""How PD moves each pool kind a model states in its ``kv_pool_layout``: one table, no model names.

A rank's device pools become one ``KVArgs``:

* paged pools (the anchor and its sidecars, all addressed with the anchor's token slots: MHA /
  asymmetric K/V, MLA latents, the DSA indexer keys, DeepSeek-V4's state rows) register as the
  KV buffers; a request's pages move as whole pages (or, for head-sharded pools under
  heterogeneous TP, as head slices of each token), so a sidecar travels with the same page ids
  and in the same WRITEs as the anchor. One movement per rank: every paged pool of a model
  must share it (``KVArgs.is_mla`` means "replicated whole pages": only the first prefill target
  sends them);
* an own-slot state pool (Mamba conv + temporal states) registers as the state buffers; the
  request's slot moves once, after its last KV chunk, as the rows of each TP-sharded segment of
  every state item (``rank_mapping.state_row_slices``), counted as its own sender kind.

A pool kind missing from ``PD_TRANSFER_PLANS``, or paged pools of different movements, are
refused when the server starts, with the reason.
"""

from __future__ import annotations

from enum import Enum

from sglang.srt.disaggregation.base.conn import KVArgs, aux_fields, state_fields
from sglang.srt.mem_cache.memory_pool.base import SHARD_MODE, PoolKind, ShardMode


class Movement(str, Enum):
    HEAD_SLICED_PAGES = "head_sliced_pages"  # paged, sharded by KV heads: pages or per-token head slices
    WHOLE_PAGES = "whole_pages"  # paged, replicated on every TP rank: whole pages from one prefill rank
    STATE_ROWS = "state_rows"  # own slot per request, rows sharded by heads: the slot's row runs


PD_TRANSFER_PLANS: dict[PoolKind, Movement] = {
    PoolKind.MHA: Movement.HEAD_SLICED_PAGES,
    PoolKind.ASYMMETRIC_MHA: Movement.HEAD_SLICED_PAGES,
    PoolKind.MLA: Movement.WHOLE_PAGES,
    PoolKind.DSA_INDEXER: Movement.WHOLE_PAGES,
    PoolKind.DSV4_ANCHOR: Movement.WHOLE_PAGES,  # slots without bytes: contributes no buffer
    PoolKind.DSV4_STATE: Movement.WHOLE_PAGES,
    PoolKind.MAMBA: Movement.STATE_ROWS,
}
# A replicated pool must move as whole pages, a sharded paged one as head slices.
assert all((SHARD_MODE[k] is ShardMode.REPLICATED) == (m is Movement.WHOLE_PAGES)
           for k, m in PD_TRANSFER_PLANS.items() if m is not Movement.STATE_ROWS)


def plan_of(kind: PoolKind) -> Movement:
    """The movement of pool kind ``kind``; ValueError naming the kinds PD moves otherwise."""
    try:
        return PD_TRANSFER_PLANS[kind]
    except KeyError:
        raise ValueError(f"PD serving cannot move {kind.value} pools; it moves "
                         f"{[k.value for k in PD_TRANSFER_PLANS]}") from None


def paged_movement(kinds: list[PoolKind]) -> Movement:
    """The one movement of a rank's paged pools (anchor first, then sidecars)."""
    moves = {plan_of(k) for k in kinds}
    if Movement.STATE_ROWS in moves or len(moves) != 1:
        raise ValueError("PD serving moves a rank's paged pools with one movement; this model's pools "
                         + ", ".join(f"{k.value} ({plan_of(k).value})" for k in kinds) + " differ")
    return moves.pop()


def kv_args_of_pools(anchor, sidecars: list, state_pool, *, engine_rank: int, tp_rank: int, tp_size: int,
                     total_kv_head_num: int, aux_buffers=()) -> KVArgs:
    """KVArgs over a rank's device pools: ``anchor`` and ``sidecars`` (token-slot pools) as KV
    buffers, anchor's first; ``state_pool`` (or None) as state buffers; plus the aux tensors.
    Reads pointers; mutates nothing. ValueError for pools PD cannot move together."""
    movement = paged_movement([anchor.kind, *(p.kind for p in sidecars)])
    if state_pool is not None and plan_of(state_pool.kind) is not Movement.STATE_ROWS:
        raise ValueError(f"PD serving cannot move a {state_pool.kind.value} pool as per-request state")
    if movement is Movement.HEAD_SLICED_PAGES:
        if sidecars:  # no model has one: its sidecar would need head slices of its own
            raise ValueError(f"PD serving cannot head-slice sidecar pools {[p.kind.value for p in sidecars]}")
        return KVArgs.from_pools(anchor, engine_rank=engine_rank, tp_rank=tp_rank, tp_size=tp_size,
                                 total_kv_head_num=total_kv_head_num, aux_buffers=aux_buffers, state_pool=state_pool)
    ptrs, lens, items, dtypes = [], [], [], []
    for pool in (anchor, *sidecars):
        p, n, i = pool.get_contiguous_buf_infos()
        ptrs, lens, items = ptrs + p, lens + n, items + i
        dtypes += [str(c.dtype).removeprefix("torch.") for c in pool.components]
    layers = int(anchor.layer_num)
    return KVArgs(
        engine_rank=engine_rank, kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items,
        page_size=anchor.page_size, kv_head_num=1, head_dim=sum(items), layer_num=layers if len(ptrs) % layers == 0 else 1,
        kv_dtype="+".join(dict.fromkeys(dtypes)), tp_rank=tp_rank, tp_size=tp_size, is_mla=True,
        **aux_fields(aux_buffers), **state_fields(state_pool),
    )
