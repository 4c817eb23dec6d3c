"""Attention context parallelism (``--attn-cp-size``): the KV of a sequence split over CP ranks.

Which rank holds a token: the one of its page in the sequence, round robin,
``owner(p) = (p // page_size) % attn_cp_size`` (``cp_owner``). With ``--page-size 1`` this is
upstream's interleave split (token t on rank t % cp); with larger pages it is the same rule page
by page, so every rank caches whole pages and a page's bytes live on one rank only.

What each CP rank does in a forward (``forward_token_split``): it runs the tokens it owns (and
only those) through every layer with its (TP-sharded) weights. In each attention layer a rank

1. writes the K/V of its tokens to its pool, at the slots the shared page table gives them (the
   tree, the allocator and ``req_to_token`` are the same on every rank), and zeros at the slots
   of the other ranks' tokens: a rank's pool page holds its own KV or zeros, never stale bytes
   of a page it owned before the slot was reused;
2. all-gathers the queries of every rank's tokens and attends all of them over the keys it owns
   (causal mask by global position, keys of other ranks masked out), keeping the softmax
   numerator, denominator and row maximum per head;
3. all-gathers those partials over its attention-CP group, combines them in rank order
   (log-sum-exp rescaling to the common maximum) and keeps its own tokens' rows.

The final hidden states are gathered, so every rank computes the same logits and samples the
same tokens without a broadcast. A decode token is computed by the owner of its page (the
others run the layers on no rows and take part in the exchanges). Linear-attention layers
(Qwen3-Next) carry a sequential state: ``ReplicatedOverCP`` gathers every token for them, and
each CP rank keeps the whole state in its own state pool. What CP divides here: the dense and
attention compute of the tokens, and the KV each rank writes (and its host and L3 copies, keyed
per CP rank); each rank's pool keeps the whole slot space, so device memory is not divided.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.attention.torch_native_backend import AttnChunk, TorchNativeAttnBackend, tree_sum_blocks

def cp_owner(positions: torch.Tensor, page_size: int, cp_size: int) -> torch.Tensor:
    """The CP rank holding the KV of each token at ``positions`` (page round robin)."""
    return torch.div(positions, page_size, rounding_mode="floor") % cp_size


class ContextParallelAttnBackend(TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` over this rank's share of the keys, partials combined across
    the attention-CP group (``group``: its ``GroupCoordinator``)."""

    def __init__(self, device, page_size: int, group, key_block: int = 128, q_block: int = 256,
                 token_split: bool = False):
        super().__init__(device, key_block, q_block)
        self.token_split = token_split
        if group.world_size < 2:
            raise ValueError("ContextParallelAttnBackend needs an attention-CP group of >= 2 ranks")
        self.page_size = page_size
        self.group = group
        self.cp_rank, self.cp_size = group.rank_in_group, group.world_size
        self._owned_rows = torch.zeros(0, dtype=torch.bool)
        self._foreign_keys: list[torch.Tensor] = []

    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        owners = cp_owner(forward_batch.positions.to(self.device), self.page_size, self.cp_size)
        self._owned_rows = owners == self.cp_rank
        # batch rows of every rank's tokens, in rank order (each rank computes its own under token_split)
        self.rows_of_rank = [torch.nonzero(owners == r).view(-1) for r in range(self.cp_size)]
        self.local_rows = self.rows_of_rank[self.cp_rank]
        self._foreign_keys = []
        for chunk in self.forward_metadata:
            keys = torch.arange(chunk.num_blocks * self.key_block, device=self.device)
            foreign = cp_owner(keys, self.page_size, self.cp_size) != self.cp_rank
            self._foreign_keys.append(foreign.view(chunk.num_blocks, 1, 1, self.key_block))

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                key_positions: torch.Tensor | None = None) -> torch.Tensor:
        if key_positions is not None:
            raise NotImplementedError("attention context parallelism serves plain causal MHA/GQA layers only")
        if self.token_split:  # q, k, v: this rank's tokens only
            if save_kv_cache:
                self._save_local_kv(k, v, layer, forward_batch)
            q = self.gather_rows(q)
            save_kv_cache = False
        local = self.local_partials(q, k, v, layer, forward_batch, save_kv_cache)
        parts = [torch.empty_like(local) for _ in range(self.cp_size)]
        dist.all_gather(parts, local, group=self.group.device_group)
        out = combine_partials(torch.stack(parts), layer.tp_q_head_num, layer.v_head_dim).to(q.dtype)
        return out[self.local_rows] if self.token_split else out

    def _save_local_kv(self, k, v, layer, forward_batch) -> None:
        """Token split: this rank's tokens' K/V at their slots, zeros at the others' slots."""
        pool, loc = forward_batch.token_to_kv_pool, forward_batch.out_cache_loc
        pool.set_kv_buffer(layer.layer_id, loc[self.local_rows], k, v)
        foreign = loc[~self._owned_rows]
        if foreign.numel():
            pool.set_kv_buffer(layer.layer_id, foreign, k.new_zeros(foreign.numel(), *k.shape[1:]),
                               v.new_zeros(foreign.numel(), *v.shape[1:]))

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Token split: ``x`` (this rank's rows, ...) -> (every row of the batch, ...) in batch
        order, from every CP rank's rows (all-gathered, padded to the longest share)."""
        longest = max(rows.numel() for rows in self.rows_of_rank)
        padded = x.new_zeros(longest, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.cp_size)]
        dist.all_gather(parts, padded, group=self.group.device_group)
        out = x.new_empty(self._owned_rows.numel(), *x.shape[1:])
        for rows, part in zip(self.rows_of_rank, parts):
            out[rows] = part[: rows.numel()]
        return out

    def local_partials(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        """Write the owned rows' K/V, then every query over this rank's keys: (T, Hq * (Dv + 2))
        fp32, per row the numerator (Hq * Dv), denominator (Hq) and row maximum (Hq)."""
        if getattr(layer, "sinks", None) is not None or getattr(layer, "sliding_window", None) is not None:
            raise NotImplementedError("attention context parallelism serves plain causal MHA/GQA layers only")
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            # another rank's tokens as zeros: a slot reused from one of this rank's earlier pages
            # must not carry those bytes on into its host and L3 copies
            owned = self._owned_rows.view(-1, 1, 1)
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, torch.where(owned, k, 0.0),
                               torch.where(owned, v, 0.0))
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        heads, v_dim = layer.tp_q_head_num, layer.v_head_dim
        local = q.new_empty(q.shape[0], heads * (v_dim + 2), dtype=torch.float32)
        for chunk, foreign in zip(self.forward_metadata, self._foreign_keys):
            rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            num, den, row_max = self._partial(q[rows], k_buf, v_buf, chunk, layer, foreign)
            local[rows] = torch.cat([num.reshape(chunk.q_len, -1), den, row_max], dim=1)
        return local

    def _partial(self, q: torch.Tensor, k_buf, v_buf, chunk: AttnChunk, layer, foreign: torch.Tensor):
        """One chunk over this rank's keys, fp32: numerator (q_len, Hq, Dv), denominator and row
        maximum (q_len, Hq); a row with none of its keys here has maximum -inf and zeros."""
        num_kv, head_dim, v_dim, block = layer.tp_k_head_num, layer.head_dim, layer.v_head_dim, self.key_block
        group, rows, nb = layer.tp_q_head_num // num_kv, chunk.padded_rows, chunk.num_blocks

        q = F.pad(q.float() * layer.scaling, (0, 0, 0, 0, 0, rows - chunk.q_len))
        q = q.view(rows, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv, 1, group * rows, head_dim)
        q = q.contiguous()
        keys = k_buf.index_select(0, chunk.token_slots).float()
        vals = v_buf.index_select(0, chunk.token_slots).float()
        vals[chunk.num_keys:] = 0
        # another rank's slots may hold stale bytes (even NaN): zero them, P is 0 there anyway
        owned = ~foreign.view(-1)
        keys = torch.where(owned.view(-1, 1, 1), keys, 0.0)
        vals = torch.where(owned.view(-1, 1, 1), vals, 0.0)
        keys = keys.view(nb, block, num_kv, head_dim).permute(2, 0, 3, 1).contiguous()
        vals = vals.view(nb, block, num_kv, v_dim).permute(2, 0, 1, 3).contiguous()

        scores = torch.matmul(q, keys)  # (Hkv, nb, group * rows, block)
        by_row = scores.view(num_kv, nb, group, rows, block)
        by_row[:, chunk.first_masked_block:].masked_fill_(chunk.tail_masked_out, float("-inf"))
        by_row.masked_fill_(foreign, float("-inf"))
        row_max = by_row.amax(dim=(1, 4), keepdim=True)  # (Hkv, 1, group, rows, 1), -inf: no key here
        by_row.sub_(torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)).exp_()
        numerator = tree_sum_blocks(torch.matmul(scores, vals))  # (Hkv, group * rows, Dv)
        denominator = tree_sum_blocks(scores.sum(dim=-1, keepdim=True))  # (Hkv, group * rows, 1)
        numerator = numerator.view(num_kv, group, rows, v_dim).permute(2, 0, 1, 3).reshape(rows, -1, v_dim)
        denominator = denominator.view(num_kv, group, rows).permute(2, 0, 1).reshape(rows, -1)
        row_max = row_max.view(num_kv, group, rows).permute(2, 0, 1).reshape(rows, -1)
        n = chunk.q_len
        return numerator[:n], denominator[:n], row_max[:n]


def combine_partials(parts: torch.Tensor, heads: int, v_dim: int) -> torch.Tensor:
    """``parts`` (cp, T, heads * (v_dim + 2)): every rank's numerator, denominator, row maximum
    (as ``ContextParallelAttnBackend.forward`` packs them) -> attention output (T, heads * v_dim),
    summed in rank order after rescaling each rank's sums to the common maximum."""
    cp, t = parts.shape[0], parts.shape[1]
    num = parts[..., : heads * v_dim].reshape(cp, t, heads, v_dim)
    den = parts[..., heads * v_dim : heads * (v_dim + 1)]
    row_max = parts[..., heads * (v_dim + 1) :]
    common = row_max.amax(dim=0)  # (T, heads): finite, every row has its own key somewhere
    scale = torch.exp(row_max - common)  # exp(-inf) = 0 for a rank without keys of the row
    out = (num * scale.unsqueeze(-1)).sum(dim=0) / (den * scale).sum(dim=0).unsqueeze(-1)
    return out.reshape(t, heads * v_dim)


def forward_token_split(model, forward_batch, backend: ContextParallelAttnBackend):
    """A causal LM's forward with the batch's tokens split over the CP ranks: this rank runs its
    own tokens (``backend.local_rows``) through every layer, the attention layers exchange
    queries and partials, and the final hidden states are gathered so every rank computes the
    same logits. ``model``: a ``CausalLM`` (``model.model``, ``logits_processor``, its head)."""
    rows = backend.local_rows
    hidden = model.model(forward_batch.input_ids[rows], forward_batch.positions[rows], forward_batch)
    hidden = backend.gather_rows(hidden)
    return model.logits_processor(hidden, getattr(model, model.lm_head_name), forward_batch)


class ReplicatedOverCP(nn.Module):
    """A token mixer with a sequential state (Qwen3-Next's linear attention) under the token
    split: it gathers every rank's rows, runs on the whole batch (each CP rank keeps the whole
    state in its own state pool) and returns this rank's rows."""

    def __init__(self, mixer: nn.Module, backend: ContextParallelAttnBackend):
        super().__init__()
        self.mixer = mixer
        self.backend = backend

    def forward(self, positions, hidden_states, forward_batch):
        out = self.mixer(forward_batch.positions, self.backend.gather_rows(hidden_states), forward_batch)
        return out[self.backend.local_rows]


def replicate_state_mixers(model: nn.Module, backend: ContextParallelAttnBackend, name: str = "linear_attn") -> int:
    """Wrap every decoder layer's ``name`` mixer (loaded already) in ``ReplicatedOverCP``;
    returns how many."""
    wrapped = 0
    for layer in getattr(model.model, "layers", ()):
        mixer = getattr(layer, name, None)
        if isinstance(mixer, nn.Module) and not isinstance(mixer, ReplicatedOverCP):
            setattr(layer, name, ReplicatedOverCP(mixer, backend))
            wrapped += 1
    return wrapped
