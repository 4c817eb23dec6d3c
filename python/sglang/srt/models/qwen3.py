"""Qwen3: Llama layout plus per-head RMSNorm of q and k before rotary (no attention bias)."""

from __future__ import annotations

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, layer_id: int, rotary_emb):
        super().__init__(config, layer_id, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    @classmethod
    def hf_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_weight_shapes(config)
        for i in range(config.num_hidden_layers):
            shapes[f"model.layers.{i}.self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"model.layers.{i}.self_attn.k_norm.weight"] = (config.head_dim,)
        return shapes


EntryClass = Qwen3ForCausalLM
