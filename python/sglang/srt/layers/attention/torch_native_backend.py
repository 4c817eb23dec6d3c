"""Paged attention in plain torch, on CPU and CUDA alike.

Each request attends on its own, in batch order, in fp32: its keys and values are gathered from
the device pool by token slot (``req_to_token``), so prefix KV computed in an earlier forward and
KV written in this one are read the same way. Queries are processed in chunks of at most
``q_block`` rows; keys in blocks of ``key_block`` slots aligned to absolute position 0.

Why this shape: a token's output must not depend on which forward computed its prefix, on how
many tokens share its chunk, or on the other requests in the batch (batch invariance). So

* every GEMM runs with ``gemm_rows(rows)`` rows (BLAS uses other kernels for few rows and for a
  last partial tile of rows), and
  its operands are contiguous (with strided ones, MKL on AMD CPUs chooses kernels by the batch
  count, i.e. by how many key blocks a chunk reads);
* the softmax numerator and denominator are summed per key block with a fixed reduction length
  ``key_block``, and the per-block partial sums are combined by a pairwise tree over a
  power-of-two number of blocks. Blocks past a row's causal limit contribute exact zeros, so
  a row sees the same arithmetic whether it is a decode step or one row of a long prefill.

A sliding-window layer (``layer.sliding_window`` = W: a row at position p sees keys p - W + 1 ..
p, HF's convention) masks the keys before its window to exact zeros inside the same blocks, so
the blocks and the tree stay aligned to position 0 and the arithmetic stays chunk-independent;
key blocks wholly before every row's window are not read at all, and the tree treats them as
the exact zeros they would sum to (``tree_sum_blocks(..., leading_zero_blocks)``).
Attention sinks (``layer.sinks``, one learned logit per query head) add ``exp(sink)`` to the
softmax denominator and nothing to the numerator. A layer with fewer KV heads than the pool
holds (MiMo's full-attention layers beside its wider sliding-window layers) uses the pool's
first heads and writes zeros to the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang.srt.layers.activation import invariant_pointwise
from sglang.srt.layers.linear import gemm_rows


@dataclass(frozen=True)
class AttnChunk:
    """Query rows ``[q_start, q_start + q_len)`` of the batch (one request) attending the
    request's first ``num_keys`` tokens. ``token_slots`` lists their slots padded with slot 0
    (the pool's reserved padding page) to ``num_blocks`` whole key blocks.

    Only key blocks from ``first_masked_block`` on can hold keys past a row's position;
    ``tail_masked_out`` (blocks, 1, padded rows, key_block) is True there where a row must not
    look, so earlier blocks are never masked. ``positions`` (padded rows,) are the rows' absolute
    positions (padded rows repeat the last key's), ``first_pos`` the first row's, for
    sliding-window masks."""

    q_start: int
    q_len: int
    padded_rows: int
    num_keys: int
    num_blocks: int
    token_slots: torch.Tensor
    first_masked_block: int
    tail_masked_out: torch.Tensor
    positions: torch.Tensor
    first_pos: int


def tree_sum_blocks(partial: torch.Tensor, leading_zero_blocks: int = 0) -> torch.Tensor:
    """Sum ``partial`` (H, num_blocks, ...) over dim 1 by a pairwise tree over a power-of-two
    block count: trailing all-zero blocks never change the result. With ``leading_zero_blocks``
    = z, the result is bitwise that of the tree over z all-zero blocks followed by ``partial``
    (where a pair meets a zero, 0 + x == x), without materialising the zeros: at each level one
    zero is prepended when the live nodes start at an odd index."""
    if leading_zero_blocks:
        offset = leading_zero_blocks
        while offset or partial.shape[1] > 1:
            zero = partial.new_zeros(partial.shape[0], 1, *partial.shape[2:])
            if offset % 2:
                partial = torch.cat([zero, partial], dim=1)
            if partial.shape[1] % 2:
                partial = torch.cat([partial, zero], dim=1)
            partial = partial[:, 0::2] + partial[:, 1::2]
            offset //= 2
        return partial[:, 0]
    num_blocks = partial.shape[1]
    width = 1 << (num_blocks - 1).bit_length()
    if width != num_blocks:
        pad = partial.new_zeros(partial.shape[0], width - num_blocks, *partial.shape[2:])
        partial = torch.cat([partial, pad], dim=1)
    while partial.shape[1] > 1:
        partial = partial[:, 0::2] + partial[:, 1::2]
    return partial[:, 0]


class TorchNativeAttnBackend:
    def __init__(self, device: str | torch.device, key_block: int = 128, q_block: int = 256):
        if key_block < 1 or q_block < 1:
            raise ValueError(f"key_block and q_block must be >= 1, got {key_block}, {q_block}")
        self.device = torch.device(device)
        self.key_block = key_block
        self.q_block = q_block
        self.forward_metadata: list[AttnChunk] = []
        self._window_masks: dict[tuple[int, int], torch.Tensor] = {}

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan the chunks of one forward (shared by all layers). Reads ``req_to_token``."""
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        chunks = []
        q_start = 0
        for req_idx, prefix_len, extend_len in zip(
            forward_batch.req_pool_indices.tolist(),
            forward_batch.extend_prefix_lens_cpu,
            forward_batch.extend_seq_lens_cpu,
        ):
            slots = req_to_token[req_idx, : prefix_len + extend_len].to(self.device, torch.int64)
            for c0 in range(0, extend_len, self.q_block):
                c1 = min(extend_len, c0 + self.q_block)
                chunks.append(self._plan_chunk(q_start + c0, prefix_len + c0, c1 - c0, slots[: prefix_len + c1]))
            q_start += extend_len
        self.forward_metadata = chunks
        self._window_masks = {}

    def _plan_chunk(self, q_start: int, first_pos: int, q_len: int, token_slots: torch.Tensor) -> AttnChunk:
        num_keys, block = token_slots.numel(), self.key_block
        num_blocks = -(-num_keys // block)
        padded_slots = F.pad(token_slots, (0, num_blocks * block - num_keys))
        padded_rows = gemm_rows(q_len)
        first_masked = min((first_pos + 1) // block, num_blocks - 1)
        # Padded rows repeat the last real key position: finite, ignored.
        pos = torch.arange(first_pos, first_pos + padded_rows, device=self.device).clamp(max=num_keys - 1)
        keys = torch.arange(first_masked * block, num_blocks * block, device=self.device).view(-1, 1, 1, block)
        tail_masked_out = keys > pos.view(1, 1, -1, 1)
        return AttnChunk(
            q_start, q_len, padded_rows, num_keys, num_blocks, padded_slots, first_masked, tail_masked_out, pos,
            first_pos,
        )

    def _window_masked_out(self, chunk: AttnChunk, window: int) -> torch.Tensor:
        """(blocks, 1, padded rows, key_block): True at keys before each row's window (shared by
        the layers of one window size in a forward)."""
        key = (chunk.q_start, window)
        mask = self._window_masks.get(key)
        if mask is None:
            keys = torch.arange(chunk.num_blocks * self.key_block, device=self.device)
            mask = keys.view(-1, 1, 1, self.key_block) <= (chunk.positions - window).view(1, 1, -1, 1)
            self._window_masks[key] = mask
        return mask

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                key_positions: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` (T, Hq, D), ``k`` (T, Hkv, D), ``v`` (T, Hkv, Dv) -> (T, Hq * Dv). Writes k/v to the
        pool at ``forward_batch.out_cache_loc`` first, then reads every key through the pool (an MLA
        pool's value buffer is a view of its latent, so ``v`` may be None there).

        ``key_positions`` (T, K) int64, optional (sparse attention, e.g. DSA's top-k): row t attends
        only the keys at those positions of its request (-1 entries are unused); the others are
        masked to exact zeros inside the same blocks, so the arithmetic stays chunk-independent."""
        pool = forward_batch.token_to_kv_pool
        pool_heads = getattr(pool, "head_num", layer.tp_k_head_num)
        if save_kv_cache:
            if k.shape[1] < pool_heads:  # this layer uses the pool's first heads; zeros in the rest
                k = F.pad(k, (0, 0, 0, pool_heads - k.shape[1]))
                v = F.pad(v, (0, 0, 0, pool_heads - v.shape[1]))
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        if layer.tp_k_head_num < pool_heads:
            k_buf, v_buf = k_buf[:, : layer.tp_k_head_num], v_buf[:, : layer.tp_k_head_num]
        out = q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        for chunk in self.forward_metadata:
            rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            selected = None if key_positions is None else self._selected_keys(chunk, key_positions[rows])
            out[rows] = self._attend(q[rows], k_buf, v_buf, chunk, layer, selected).to(out.dtype)
        return out

    def _selected_keys(self, chunk: AttnChunk, positions: torch.Tensor) -> torch.Tensor:
        """(blocks, 1, padded rows, key_block) bool: True at the keys each row attends (padded rows:
        every key, so they stay finite)."""
        width = chunk.num_blocks * self.key_block
        sel = torch.zeros(chunk.padded_rows, width + 1, dtype=torch.bool, device=self.device)
        sel[chunk.q_len :] = True
        cols = positions.to(self.device, torch.int64)
        cols = torch.where((cols >= 0) & (cols < width), cols, width)  # unused entries -> the spare column
        sel[: chunk.q_len].scatter_(1, cols, True)
        return sel[:, :width].view(chunk.padded_rows, chunk.num_blocks, self.key_block).permute(1, 0, 2).unsqueeze(1)

    def _attend(self, q: torch.Tensor, k_buf, v_buf, chunk: AttnChunk, layer,
                selected: torch.Tensor | None = None) -> torch.Tensor:
        """One chunk, fp32: scores per key block (heads, blocks, rows, key_block); per block the
        softmax numerator (P @ V) and denominator (row sums of P), then the fixed-order tree
        over blocks."""
        num_kv, head_dim, v_dim, block = layer.tp_k_head_num, layer.head_dim, layer.v_head_dim, self.key_block
        window = getattr(layer, "sliding_window", None)
        # Key blocks wholly before the first row's window (so before every row's) are skipped.
        skip = 0 if window is None else min(max(0, chunk.first_pos - window + 1) // block, chunk.first_masked_block)
        group, rows, nb = layer.tp_q_head_num // num_kv, chunk.padded_rows, chunk.num_blocks - skip

        q = F.pad(q.float() * layer.scaling, (0, 0, 0, 0, 0, rows - chunk.q_len))
        q = q.view(rows, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv, 1, group * rows, head_dim)
        q = q.contiguous()
        slots = chunk.token_slots[skip * block :]
        keys = k_buf.index_select(0, slots).float()  # (nb * block, Hkv, D)
        vals = v_buf.index_select(0, slots).float()
        vals[chunk.num_keys - skip * block :] = 0  # padding slots: P is 0 there, but 0 * NaN would not be
        # GEMM operands contiguous: with strided (permuted) operands, MKL on AMD picks kernels by
        # the batch count (nb), so a row's bits would depend on how many key blocks its chunk has.
        keys = keys.view(nb, block, num_kv, head_dim).permute(2, 0, 3, 1).contiguous()  # (Hkv, nb, D, block)
        vals = vals.view(nb, block, num_kv, v_dim).permute(2, 0, 1, 3).contiguous()  # (Hkv, nb, block, Dv)

        scores = torch.matmul(q, keys)  # (Hkv, nb, group * rows, block)
        by_row = scores.view(num_kv, nb, group, rows, block)
        by_row[:, chunk.first_masked_block - skip :].masked_fill_(chunk.tail_masked_out, float("-inf"))
        if selected is not None:
            by_row.masked_fill_(~selected[skip:], float("-inf"))
        if window is not None and chunk.num_keys > window:
            by_row.masked_fill_(self._window_masked_out(chunk, window)[skip:], float("-inf"))
        row_max = by_row.amax(dim=(1, 4), keepdim=True)  # (Hkv, 1, group, rows, 1)
        sinks = getattr(layer, "sinks", None)
        if sinks is not None:
            sinks = sinks.float().view(num_kv, 1, group, 1, 1)
            row_max = torch.maximum(row_max, sinks)
        by_row.sub_(row_max).exp_()
        numerator = tree_sum_blocks(torch.matmul(scores, vals), skip)
        denominator = tree_sum_blocks(scores.sum(dim=-1, keepdim=True), skip)
        if sinks is not None:
            denominator = denominator + invariant_pointwise(torch.exp, sinks - row_max).view(num_kv, group * rows, 1)
        out = (numerator / denominator).view(num_kv, group, rows, v_dim).permute(2, 0, 1, 3)
        return out.reshape(rows, -1)[: chunk.q_len]
