"""DeepSeek-V3.2: DeepSeek-V3's MLA + MoE with DSA, the lightning indexer's top-k sparse attention.

Per layer the indexer projects, per token, one key (``index_head_dim``: ``wk`` then LayerNorm, the
first ``qk_rope_head_dim`` features rotated half-split (not interleaved, as HF does), cached in the
``DSAIndexerPool`` sidecar at the anchor's slot, with scale 1: keys are stored unquantized), and
per query ``index_n_heads`` heads (``wq_b`` of the q LoRA residual, rotated the same way) and
per-head weights (``weights_proj * index_n_heads ** -0.5``). A query at position p scores every
key t <= p as ``sum_h w_h * relu(q_h . k_t * index_head_dim ** -0.5)`` and attends only the
``index_topk`` best (all of them while p + 1 <= index_topk).

Top-k: ``torch.topk`` of the row of the p + 1 visible keys, the row HF scores for a decode step,
so exact ties are broken by the same call on the same values (HF's prefill rows carry masked
entries past p as well; only an exact tie at the k-th score could then resolve otherwise). The
row does not depend on chunking, batching or cached prefixes, so neither does the choice.

Batch invariance: the scores are computed per request over key blocks of the attention
backend's plan (128 slots aligned to position 0, gemm_rows(q_len) rows), a head-weighted sum in
a fixed order; the attention then masks the keys not chosen to exact zeros in the same blocks.

Under TP the indexer is replicated (every rank chooses the same keys; its sidecar is the same
bytes on every rank, like the latent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.model_executor.kv_pool_spec import KVPoolLayout, PoolSpec
from sglang.srt.models.deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV3ForCausalLM,
    ReplicatedLinear,
)


class LayerNorm(nn.Module):
    """``F.layer_norm`` in fp32 with weight and bias (HF ``nn.LayerNorm``), cast back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb``: features ``[x1, x2]`` (halves) -> ``[x1 cos - x2 sin, x2 cos + x1 sin]``."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DeepseekV32Indexer(nn.Module):
    """The lightning indexer of one layer: writes its keys to the DSA pool, returns the chosen key
    positions per query row (T, index_topk), -1 where a row has fewer visible keys."""

    def __init__(self, config, layer_id: int, rotary_emb):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope, self.topk, self.layer_id = config.qk_rope_head_dim, config.index_topk, layer_id
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, 1e-6)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.n_heads)
        self.softmax_scale = self.head_dim**-0.5
        self.rotary_emb = rotary_emb  # the attention's table (YaRN factor included); rotated half-split here

    def _rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.rotary_emb.cos_cache[positions].unsqueeze(1)
        sin = self.rotary_emb.sin_cache[positions].unsqueeze(1)
        rot, rest = x.split([self.rope, self.head_dim - self.rope], dim=-1)
        return torch.cat([rotate_half_split(rot, cos, sin), rest], dim=-1)

    def forward(self, positions, hidden_states, q_resid, forward_batch) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q = self._rotate(positions, self.wq_b(q_resid).view(tokens, self.n_heads, self.head_dim))
        k = self._rotate(positions, self.k_norm(self.wk(hidden_states)).view(tokens, 1, self.head_dim))[:, 0]
        weights = self.weights_proj(hidden_states).float() * self.n_heads**-0.5  # (T, H)
        pool = forward_batch.side_pools[PoolKind.DSA_INDEXER]
        pool.set_index_k_buffer(self.layer_id, forward_batch.out_cache_loc, k,
                                torch.ones(tokens, 1, dtype=torch.float32, device=k.device))
        k_buf = pool.get_index_k_buffer(self.layer_id)
        chosen = torch.full((tokens, self.topk), -1, dtype=torch.int64, device=k.device)
        for chunk in forward_batch.attn_backend.forward_metadata:
            rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            scores = self._scores(q[rows], weights[rows], k_buf, chunk)
            first_pos = chunk.num_keys - chunk.q_len
            for r in range(chunk.q_len):
                visible = first_pos + r + 1
                if visible <= self.topk:
                    chosen[chunk.q_start + r, :visible] = torch.arange(visible, device=k.device)
                else:
                    chosen[chunk.q_start + r] = torch.topk(scores[r, :visible], self.topk).indices
        return chosen

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, k_buf: torch.Tensor, chunk) -> torch.Tensor:
        """(padded rows, blocks * key_block) index scores of one chunk's rows over its key slots."""
        rows, heads, nb = chunk.padded_rows, self.n_heads, chunk.num_blocks
        block = chunk.token_slots.numel() // nb
        # (rows, H, D): the backend pads every chunk to gemm_rows(q_len) rows
        q = F.pad(q.float(), (0, 0, 0, 0, 0, rows - q.shape[0]))
        q = q.permute(1, 0, 2).reshape(1, heads * rows, self.head_dim)
        keys = k_buf.index_select(0, chunk.token_slots).float()
        keys[chunk.num_keys :] = 0  # padding slots
        # contiguous, as the backend's operands (strided ones let MKL pick kernels by nb)
        keys = keys.view(nb, block, self.head_dim).transpose(1, 2).contiguous()  # (nb, D, block)
        scores = torch.matmul(q, keys).mul_(self.softmax_scale).relu_().view(nb, heads, rows, block)
        w = F.pad(weights, (0, 0, 0, rows - weights.shape[0])).t().reshape(1, heads, rows, 1)
        index = (scores * w).sum(dim=1)  # (nb, rows, block)
        return index.permute(1, 0, 2).reshape(rows, nb * block)


class DeepseekV32Attention(DeepseekV2Attention):
    def __init__(self, config, layer_id: int, rotary_emb):
        super().__init__(config, layer_id, rotary_emb)
        self.indexer = DeepseekV32Indexer(config, layer_id, rotary_emb)

    def select_keys(self, positions, hidden_states, q_resid, forward_batch) -> torch.Tensor | None:
        return self.indexer(positions, hidden_states, q_resid, forward_batch)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """V3 + DSA. HF V3.2 always interleaves the attention rope and needs the q LoRA (the indexer
    reads its residual)."""

    hf_required_keys = (*DeepseekV3ForCausalLM.hf_required_keys, "q_lora_rank", "index_n_heads", "index_head_dim",
                        "index_topk")
    attention_cls = DeepseekV32Attention

    @classmethod
    def complete_hf_config(cls, raw: dict, where: str = "config.json") -> dict:
        hf = super().complete_hf_config(raw, where)
        hf["rope_interleave"] = True
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            if not isinstance(hf[key], int) or hf[key] < 1:
                raise ValueError(f"{where}: {key} must be a positive integer, got {hf[key]!r}")
        if hf["index_head_dim"] < hf["qk_rope_head_dim"]:
            raise ValueError(f"{where}: index_head_dim ({hf['index_head_dim']}) must be >= qk_rope_head_dim "
                             f"({hf['qk_rope_head_dim']}): the indexer rotates its first qk_rope_head_dim features")
        kinds = hf.get("mlp_layer_types")
        if kinds is not None and (len(kinds) != hf["num_hidden_layers"] or set(kinds) - {"dense", "sparse"}):
            raise ValueError(f"{where}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                             f"{hf['num_hidden_layers']} layers, got {kinds!r}")
        layer_types = hf.get("layer_types")
        if layer_types is not None and set(layer_types) != {"indexed_attention"}:
            raise ValueError(f"{where}: layer_types {sorted(set(layer_types))} not supported; supported: "
                             "['indexed_attention']")
        return hf

    @classmethod
    def kv_pool_layout(cls, hf, tp_size: int, dtype: torch.dtype) -> KVPoolLayout:
        """The MLA latent + rope row, and the indexer key (+ scale) in the DSA sidecar (same slots)."""
        layout = super().kv_pool_layout(hf, tp_size, dtype)
        indexer = {"index_head_dim": hf.index_head_dim, "layer_num": hf.num_hidden_layers, "dtype": dtype}
        return KVPoolLayout(layout.anchor, sidecars=(PoolSpec(PoolKind.DSA_INDEXER, indexer),))

    @classmethod
    def attention_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_weight_shapes(config)
        heads, dim, h = config.index_n_heads, config.index_head_dim, config.hidden_size
        shapes.update({
            "indexer.wq_b.weight": (heads * dim, config.q_lora_rank),
            "indexer.wk.weight": (dim, h),
            "indexer.k_norm.weight": (dim,),
            "indexer.k_norm.bias": (dim,),
            "indexer.weights_proj.weight": (heads, h),
        })
        return shapes


EntryClass = DeepseekV32ForCausalLM
