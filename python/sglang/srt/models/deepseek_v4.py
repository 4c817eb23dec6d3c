"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) on the logical-anchor + state pools, HF checkpoint names.

What the model is (transformers' ``modeling_deepseek_v4``, paper sections in brackets):

* hyper-connections (mHC): every token carries ``hc_mult`` residual streams; each block collapses
  them with learned ``pre`` weights, and mixes its output back with ``post`` and a Sinkhorn-projected
  ``comb`` matrix;
* attention is shared-KV MQA (one KV head, K = V) over a sliding window of ``sliding_window`` tokens,
  with a per-head sink logit, partial interleaved RoPE on the trailing ``qk_rope_head_dim`` channels
  (undone on the output with ``-sin``) and a grouped low-rank output projection;
* a *compressed sparse attention* (CSA) layer also attends to compressed entries, one per block of
  ``m = compress_rates[CSA]`` tokens, formed as a softmax-gated sum over ``2 m`` token rows (the
  previous block's "Ca" half and this block's "Cb" half); a Lightning Indexer (its own compressor at
  ``index_head_dim``) picks the ``index_topk`` entries each query attends to;
* a *heavily compressed attention* (HCA) layer attends to every compressed entry of blocks of
  ``m' = compress_rates[HCA]`` tokens (no overlap, no indexer);
* MoE with sqrt-softplus scores, a shared expert, SwiGLU clamped at ``swiglu_limit``; the first
  ``hash_moe`` layers pick experts by a frozen ``tid2eid[token id]`` table.

What is cached (all in the ``DSV4_STATE`` sidecar, one row per anchor slot per layer, see
``DeepseekV4RowLayout`` in ``deepseek_v4_config.py``): each token's sliding-window KV row; for
CSA/HCA layers the token's raw compressor projections (``kv``, ``gate``: what HF buffers until a
block closes, and the Ca half it keeps as the next block's overlap) and the indexer's; and each
block's compressed entry (plus the indexer's compressed key) at the slot of the block's *last*
token. A prefix of any length therefore carries exactly what a request continuing it needs: the last
window of KV rows, every closed block's entry, and the raw rows of a block it ends inside of.
Nothing is held outside the pools, so HiCache (host tier, L3) moves this state with the anchor's
pages.

Batch invariance: projections go through ``invariant_linear``; attention and compression are done
per query token / per block with reduction lengths set by the token's position only, so a token's
output does not depend on chunking or on the other requests of the batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.activation import SIMD_ELEMENTS, invariant_pointwise
from sglang.srt.layers.linear import invariant_linear
from sglang.srt.layers.rotary_embedding import ROPE_SCALING_TYPES, yarn_attention_factor
from sglang.srt.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
)
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.model_executor.kv_pool_spec import KVPoolLayout, PoolSpec
from sglang.srt.models.base import ModelSpec
from sglang.srt.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4RowLayout, complete_v4_config
from sglang.srt.models.llama import CausalLM
from sglang.srt.models.weight_names import load_named_weights


# ----------------------------------------------------------------------------- math helpers (HF semantics)


def softmax_lastdim(x: torch.Tensor) -> torch.Tensor:
    """Softmax over a short last dim, padded with -inf to the SIMD width (same reason as ``invariant_pointwise``)."""
    k = x.shape[-1]
    return F.pad(x, (0, -k % SIMD_ELEMENTS), value=float("-inf")).softmax(dim=-1)[..., :k]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF ``DeepseekV4RMSNorm`` (fp32 statistics, fp32 weight multiply) or the unweighted one."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_inv_freq(params: dict, rope_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (rope_dim // 2,), cos/sin scale) of one V4 rope table (``_rope_tables``)."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if params["rope_type"] != "yarn":
        return inv_freq, 1.0
    inv_freq = ROPE_SCALING_TYPES["yarn"](inv_freq, params, base=base, head_dim=rope_dim, max_position=max_position)
    return inv_freq, yarn_attention_factor(params, max_position)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos / sin (len(positions), rope_dim // 2) as HF's V4 rotary computes them."""
    freqs = positions.to(inv_freq.device)[:, None].float() * inv_freq.float()
    cos, sin = invariant_pointwise(torch.cos, freqs), invariant_pointwise(torch.sin, freqs)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x`` (T, [H,] D); cos/sin
    are (T, rope_dim // 2)."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = (rope.float() * cos + _rotate_half(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """A replicated ``weight`` (out, in) applied with ``invariant_linear`` (checkpoint name ``.weight``)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        return invariant_linear(x.reshape(-1, x.shape[-1]), self.weight).view(*shape, -1)


class Norm(nn.Module):
    """Weighted RMSNorm parameter holder (``.weight``, fp32 as HF keeps it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ----------------------------------------------------------------------------- attention


class Compressor(nn.Module):
    """A block compressor (checkpoint ``.compressor`` / ``.indexer.compressor``): ``wkv`` / ``wgate``
    project each token to ``coeff * dim`` raw rows; a closed block's entry is the softmax(gate + ape)
    weighted sum of its rows (and, with ``overlap``, of the previous block's first-half rows), RMS
    normed and RoPE'd at the block's first position."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        coeff = 2 if overlap else 1
        self.wkv = Linear(hidden, coeff * dim)
        self.wgate = Linear(hidden, coeff * dim)
        self.ape = _param(rate, coeff * dim, dtype=torch.float32)
        self.norm = Norm(dim, eps)

    def compress(self, kv_rows: torch.Tensor, gate_rows: torch.Tensor, prev_kv, prev_gate,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A block's entry from its ``rate`` raw rows (and the previous block's rows when
        overlapping; None for block 0), RoPE'd with ``cos`` / ``sin`` (1, rope_dim // 2). Returns (dim,)."""
        d, gate = self.dim, gate_rows.float() + self.ape.float()
        if self.overlap:
            kv, gate = kv_rows[:, d:], gate[:, d:]
            if prev_kv is not None:
                kv = torch.cat([prev_kv[:, :d], kv])
                gate = torch.cat([prev_gate.float()[:, :d] + self.ape.float()[:, :d], gate])
        else:
            kv = kv_rows
        weights = gate.softmax(dim=0, dtype=torch.float32).to(kv.dtype)
        entry = self.norm((kv * weights).sum(dim=0, keepdim=True))
        return apply_rope(entry, cos, sin)[0]


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its compressor's keys, scored per query by
    ``sum_h w_h * ReLU(q_h . k)``; the query attends to the ``index_topk`` best visible entries."""

    def __init__(self, config, rate: int):
        super().__init__()
        self.n_heads, self.dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.compressor = Compressor(config.hidden_size, self.dim, rate, True, config.rms_norm_eps)
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.dim)
        self.weights_proj = Linear(config.hidden_size, self.n_heads)


class DeepseekV4Attention(nn.Module):
    """Checkpoint ``model.layers.{i}.attn``. Reads and writes its layer's rows of the state pool."""

    def __init__(self, config, layer_id: int, rows: DeepseekV4RowLayout):
        super().__init__()
        self.layer_id, self.layer_type = layer_id, config.layer_types[layer_id]
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.window, self.eps, self.groups = config.sliding_window, config.rms_norm_eps, config.o_groups
        self.scaling = self.head_dim**-0.5
        h, q_rank = config.hidden_size, config.q_lora_rank
        self.wq_a = Linear(h, q_rank)
        self.q_norm = Norm(q_rank, self.eps)
        self.wq_b = Linear(q_rank, self.num_heads * self.head_dim)
        self.wkv = Linear(h, self.head_dim)
        self.norm = Norm(self.head_dim, self.eps)
        group_in = self.num_heads * self.head_dim // self.groups
        self.wo_a = Linear(group_in, self.groups * config.o_lora_rank)
        self.wo_b = Linear(self.groups * config.o_lora_rank, h)
        self.attn_sink = _param(self.num_heads, dtype=torch.float32)
        self.fields = rows.fields(self.layer_type)
        self.rate = config.compress_rates.get(self.layer_type, 0) if self.layer_type != SLIDING else 0
        table = config.v4_rope["main" if self.layer_type == SLIDING else "compress"]
        inv_freq, self.rope_scale = rope_inv_freq(table, config.qk_rope_head_dim, config.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.compressor = self.indexer = None
        if self.layer_type != SLIDING:
            self.compressor = Compressor(h, self.head_dim, self.rate, self.layer_type == CSA, self.eps)
        if self.layer_type == CSA:
            self.indexer = Indexer(config, self.rate)

    def _col(self, name: str) -> slice:
        start, width = self.fields[name]
        return slice(start, start + width)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
        """``x`` (T, hidden): the normed block input of every new token of the batch."""
        T, H, d = x.shape[0], self.num_heads, self.head_dim
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype, self.rope_scale)
        q_res = self.q_norm(self.wq_a(x))
        q = apply_rope(rms_norm(self.wq_b(q_res).view(T, H, d), None, self.eps), cos, sin)
        kv = apply_rope(self.norm(self.wkv(x)), cos, sin)
        state = forward_batch.side_pools[PoolKind.DSV4_STATE].get_state_buffer(self.layer_id)
        loc = forward_batch.out_cache_loc
        state[loc, self._col("swa")] = kv.to(state.dtype)
        if self.compressor is not None:
            state[loc, self._col("kv")] = self.compressor.wkv(x).to(state.dtype)
            state[loc, self._col("gate")] = self.compressor.wgate(x).to(state.dtype)
        idx_q = idx_w = None
        if self.indexer is not None:
            ind = self.indexer
            state[loc, self._col("idx_kv")] = ind.compressor.wkv(x).to(state.dtype)
            state[loc, self._col("idx_gate")] = ind.compressor.wgate(x).to(state.dtype)
            idx_q = apply_rope(ind.wq_b(q_res).view(T, ind.n_heads, ind.dim), cos, sin)
            idx_w = ind.weights_proj(x).float() * ind.n_heads**-0.5

        out = torch.empty(T, H, d, dtype=x.dtype, device=x.device)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        row = 0
        for req, prefix, new in zip(forward_batch.req_pool_indices.tolist(), forward_batch.extend_prefix_lens_cpu,
                                    forward_batch.extend_seq_lens_cpu):
            slots = req_to_token[req, : prefix + new].to(state.device, torch.int64)
            if self.compressor is not None:
                self._close_blocks(state, slots, prefix, prefix + new, x.dtype)
            for i in range(new):
                r = row + i
                q_idx = None if idx_q is None else (idx_q[r], idx_w[r])
                out[r] = self._attend(q[r], state, slots, prefix + i, q_idx)
            row += new
        out = apply_rope(out, cos, -sin).reshape(T, self.groups, -1)
        w = self.wo_a.weight.view(self.groups, -1, out.shape[-1])
        grouped = torch.cat([invariant_linear(out[:, g], w[g]) for g in range(self.groups)], dim=-1)
        return self.wo_b(grouped)

    def _close_blocks(self, state, slots, start: int, end: int, dtype) -> None:
        """Write the entry of every block closed by tokens [start, end) at its last token's slot."""
        m = self.rate
        blocks = range(start // m, end // m)
        if not blocks:
            return
        pos = torch.tensor([b * m for b in blocks], dtype=torch.int64)
        cos, sin = rope_cos_sin(pos, self.inv_freq, dtype, self.rope_scale)
        jobs = [(self.compressor, "kv", "gate", "comp")]
        if self.indexer is not None:
            jobs.append((self.indexer.compressor, "idx_kv", "idx_gate", "idx_comp"))
        for comp, kv_name, gate_name, out_name in jobs:
            kv_col, gate_col, out_col = self._col(kv_name), self._col(gate_name), self._col(out_name)
            for j, b in enumerate(blocks):
                cur = slots[b * m : (b + 1) * m]
                prev = slots[(b - 1) * m : b * m] if (comp.overlap and b > 0) else None
                entry = comp.compress(
                    state[cur, kv_col].to(dtype), state[cur, gate_col],
                    None if prev is None else state[prev, kv_col].to(dtype),
                    None if prev is None else state[prev, gate_col], cos[j : j + 1], sin[j : j + 1],
                )
                state[cur[-1], out_col] = entry.to(state.dtype)

    def _attend(self, q: torch.Tensor, state, slots, pos: int, idx) -> torch.Tensor:
        """One query (H, d) at ``pos``: its sliding window of KV rows, then the compressed entries it
        may see (all closed blocks for HCA, the indexer's top-k for CSA), with the sink logit."""
        lo = max(0, pos - self.window + 1)
        keys = state[slots[lo : pos + 1], self._col("swa")]
        if self.compressor is not None:
            m = self.rate
            visible = (pos + 1) // m
            if visible:
                ends = slots[m - 1 : visible * m : m]  # slot of each visible block's last token
                if idx is not None:
                    ends = self._select(idx, state, ends)
                keys = torch.cat([keys, state[ends, self._col("comp")]])
        keys = keys.to(q.dtype)
        scores = torch.matmul(q, keys.t()) * self.scaling  # (H, L)
        logits = torch.cat([scores, self.attn_sink.to(scores.dtype)[:, None]], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[:, :-1]
        return torch.matmul(probs.to(keys.dtype), keys)

    def _select(self, idx, state, ends: torch.Tensor) -> torch.Tensor:
        """The indexer's top-``index_topk`` block-end slots among ``ends`` for one query."""
        q_idx, weights = idx
        ind = self.indexer
        if ends.numel() <= ind.topk:
            return ends
        keys = state[ends, self._col("idx_comp")].float()
        scores = F.relu(torch.matmul(q_idx.float(), keys.t())) * ind.dim**-0.5  # (heads, visible)
        total = (scores * weights[:, None]).sum(dim=0)
        chosen = total.topk(ind.topk).indices.sort().values
        return ends[chosen]


# ----------------------------------------------------------------------------- MoE and hyper-connections


class Expert(nn.Module):
    """SwiGLU with HF V4's clamps: ``w1`` gate, ``w3`` up, ``w2`` down."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w3, self.w2 = Linear(hidden, inter), Linear(hidden, inter), Linear(inter, hidden)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(invariant_pointwise(F.silu, gate) * up)


class Gate(nn.Module):
    """Router: learned scores; experts by top-k (``bias`` = score correction) or, for ``hash_moe``,
    by the frozen ``tid2eid[token id]`` table."""

    def __init__(self, config, is_hash: bool):
        super().__init__()
        self.is_hash, self.top_k = is_hash, config.num_experts_per_tok
        self.scoring, self.scale = config.scoring_func, config.routed_scaling_factor
        self.weight = _param(config.n_routed_experts, config.hidden_size)
        if is_hash:
            self.tid2eid = _param(config.vocab_size, self.top_k, dtype=torch.int64)
        else:
            self.bias = _param(config.n_routed_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = invariant_linear(x, self.weight)
        if self.scoring == "sqrtsoftplus":
            scores = invariant_pointwise(F.softplus, logits).sqrt()
        elif self.scoring == "sigmoid":
            scores = invariant_pointwise(torch.sigmoid, logits)
        else:
            scores = softmax_lastdim(logits)
        if self.is_hash:
            indices = self.tid2eid[input_ids].long()
        else:
            indices = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices


class MoE(nn.Module):
    """Checkpoint ``model.layers.{i}.ffn``: routed experts + one shared expert."""

    def __init__(self, config, layer_id: int):
        super().__init__()
        inter, limit = config.moe_intermediate_size, config.swiglu_limit
        self.gate = Gate(config, config.mlp_layer_types[layer_id] == "hash_moe")
        self.experts = nn.ModuleList(Expert(config.hidden_size, inter, limit) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(config.hidden_size, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        routed = torch.zeros_like(x)
        for e in torch.unique(indices).tolist():
            token_idx, pos = torch.where(indices == e)
            out = self.experts[e](x[token_idx]) * weights[token_idx, pos, None].to(x.dtype)
            routed.index_add_(0, token_idx, out)
        return routed + self.shared_experts(x)


def hc_weights(streams: torch.Tensor, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """mHC: (post (T, n), comb (T, n, n), collapsed input (T, hidden)) from the streams (T, n, hidden)."""
    T, n, _ = streams.shape
    flat = rms_norm(streams.reshape(T, -1).float(), None, norm_eps)
    mixes = invariant_linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = invariant_pointwise(torch.sigmoid, pre_w * s[0] + pre_b) + eps
    post = 2 * invariant_pointwise(torch.sigmoid, post_w * s[1] + post_b)
    comb = softmax_lastdim(comb_w.view(T, n, n) * s[2] + comb_b.view(n, n)) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, rows: DeepseekV4RowLayout):
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        self.attn = DeepseekV4Attention(config, layer_id, rows)
        self.ffn = MoE(config, layer_id)
        self.attn_norm, self.ffn_norm = Norm(h, config.rms_norm_eps), Norm(h, config.rms_norm_eps)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", _param((2 + n) * n, n * h, dtype=torch.float32))
            setattr(self, f"hc_{part}_base", _param((2 + n) * n, dtype=torch.float32))
            setattr(self, f"hc_{part}_scale", _param(3, dtype=torch.float32))
        self.hc_args = (config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)

    def _mix(self, part: str, streams: torch.Tensor, block) -> torch.Tensor:
        post, comb, collapsed = hc_weights(streams, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_base"),
                                           getattr(self, f"hc_{part}_scale"), *self.hc_args)
        out = block(collapsed)
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                               streams)

    def forward(self, streams, positions, input_ids, forward_batch):
        streams = self._mix("attn", streams, lambda h: self.attn(self.attn_norm(h), positions, forward_batch))
        return self._mix("ffn", streams, lambda h: self.ffn(self.ffn_norm(h), input_ids))


class HyperHead(nn.Module):
    """Checkpoint ``model.hc_head``: the final collapse of the streams."""

    def __init__(self, config):
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        self.hc_fn = _param(n, n * h, dtype=torch.float32)
        self.hc_base = _param(n, dtype=torch.float32)
        self.hc_scale = _param(1, dtype=torch.float32)
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_norm(streams.flatten(1).float(), None, self.norm_eps)
        pre = invariant_pointwise(torch.sigmoid,
                        invariant_linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class DeepseekV4Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        rows = DeepseekV4RowLayout(config.head_dim, config.index_head_dim)
        self.hc_mult = config.hc_mult
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i, rows) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config)
        self.norm = Norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        streams = embeds.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, positions, input_ids, forward_batch)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(ModelSpec, CausalLM):
    """Weights are replicated on every TP rank (HF's V4 TP plan keeps attention replicated too);
    only the embedding and LM head are vocab-sharded."""

    lm_head_name = "head"  # the checkpoint's name
    # Why --pp-size > 1 is refused (model_runner.check_pipeline_support).
    pipeline_unsupported_reason = ("its layers hand on hc_mult hyper-connection streams (collapsed by hc_head "
                                   "before the norm), not the hidden states and residual a pipeline stage sends")

    @classmethod
    def complete_hf_config(cls, raw: dict, where: str = "config.json") -> dict:
        return complete_v4_config(raw, where)

    @classmethod
    def kv_pool_layout(cls, hf, tp_size: int, dtype: torch.dtype) -> KVPoolLayout:
        """A logical anchor (slots, no bytes) and one state row per slot per layer
        (``DeepseekV4RowLayout``)."""
        rows = DeepseekV4RowLayout(hf.head_dim, hf.index_head_dim)
        layers = hf.num_hidden_layers
        return KVPoolLayout(
            PoolSpec(PoolKind.DSV4_ANCHOR, {"layer_num": layers}),
            (PoolSpec(PoolKind.DSV4_STATE, {"row_dim": rows.row_dim(hf.layer_types), "layer_num": layers,
                                            "dtype": dtype}),),
        )

    def __init__(self, config):
        super().__init__(config, DeepseekV4Model(config))

    @classmethod
    def hf_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        """Every tensor a V4 checkpoint (DeepSeek names, as transformers saves them) holds."""
        h, d, n, heads = config.hidden_size, config.head_dim, config.hc_mult, config.num_attention_heads
        q_rank, inter, experts = config.q_lora_rank, config.moe_intermediate_size, config.n_routed_experts
        c, ih = config.index_head_dim, config.index_n_heads
        shapes = {**cls.outer_weight_shapes(config), "model.hc_head.hc_fn": (n, n * h), "model.hc_head.hc_base": (n,),
                  "model.hc_head.hc_scale": (1,)}
        for i, layer_type in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            a = p + "attn."
            shapes.update({
                a + "attn_sink": (heads,), a + "wq_a.weight": (q_rank, h), a + "q_norm.weight": (q_rank,),
                a + "wq_b.weight": (heads * d, q_rank), a + "wkv.weight": (d, h), a + "norm.weight": (d,),
                a + "wo_a.weight": (config.o_groups * config.o_lora_rank, heads * d // config.o_groups),
                a + "wo_b.weight": (h, config.o_groups * config.o_lora_rank),
                p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
            })
            comps = []
            if layer_type != SLIDING:
                coeff = 2 if layer_type == CSA else 1
                comps.append((a + "compressor.", d, coeff))
            if layer_type == CSA:
                comps.append((a + "indexer.compressor.", c, 2))
                shapes[a + "indexer.wq_b.weight"] = (ih * c, q_rank)
                shapes[a + "indexer.weights_proj.weight"] = (ih, h)
            rate = config.compress_rates.get(layer_type, 0)
            for prefix, dim, coeff in comps:
                shapes.update({prefix + "wkv.weight": (coeff * dim, h), prefix + "wgate.weight": (coeff * dim, h),
                               prefix + "ape": (rate, coeff * dim), prefix + "norm.weight": (dim,)})
            f = p + "ffn."
            shapes[f + "gate.weight"] = (experts, h)
            if config.mlp_layer_types[i] == "hash_moe":
                shapes[f + "gate.tid2eid"] = (config.vocab_size, config.num_experts_per_tok)
            else:
                shapes[f + "gate.bias"] = (experts,)
            for e in [*(f"experts.{j}." for j in range(experts)), "shared_experts."]:
                shapes.update({f + e + "w1.weight": (inter, h), f + e + "w3.weight": (inter, h),
                               f + e + "w2.weight": (h, inter)})
            for part in ("attn", "ffn"):
                shapes.update({f"{p}hc_{part}_fn": ((2 + n) * n, n * h), f"{p}hc_{part}_base": ((2 + n) * n,),
                               f"{p}hc_{part}_scale": (3,)})
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load DeepSeek-named full tensors (``canonical_weight_name``; multi-token-prediction
        ``mtp.*`` tensors are skipped, as HF does); ValueError on missing / unexpected names or a hash
        routing table naming an expert outside [0, n_routed_experts). A floating ``tid2eid`` (only
        ``--load-format dummy`` makes one) becomes valid expert ids derived from its values."""
        experts, tied = self.config.n_routed_experts, self.config.tie_word_embeddings

        def routed(items):
            for name, tensor in items:
                name = canonical_weight_name(name)
                if name.startswith("mtp.") or ".mtp." in name or (tied and name == "head.weight"):
                    continue
                if name.endswith("gate.tid2eid") and tensor.is_floating_point():
                    tensor = (tensor.abs() * 1e4).long() % experts
                yield name, tensor

        load_named_weights(self, routed(weights), self.hf_weight_shapes(self.config), ())
        for name, param in self.named_parameters():
            if name.endswith("tid2eid"):
                bad = (param.data < 0) | (param.data >= experts)
                if bool(bad.any()):
                    raise ValueError(f"{name} routes to experts {param.data[bad].unique().tolist()[:5]}; "
                                     f"must be in [0, n_routed_experts={experts})")


_TOP_LEVEL_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                    "hc_head_scale": "model.hc_head.hc_scale"}


def canonical_weight_name(name: str) -> str:
    """The name this module uses for a checkpoint tensor. transformers 5.23 ``save_pretrained`` writes
    ``model.layers.{i}.attn...`` / ``model.embed_tokens.weight`` / ``head.weight``; DeepSeek's own
    release layout has the same per-layer names without ``model.`` and ``embed.weight``,
    ``norm.weight``, ``hc_head_fn`` at the top. Both map here."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    if name.startswith("layers."):
        return "model." + name
    return name


EntryClass = DeepseekV4ForCausalLM
