"""MiMo-V2-Flash (Xiaomi): hybrid sliding-window / full attention with asymmetric heads, MoE.

What the HF model (transformers ``mimo_v2_flash``) computes, and how it is cached here:

* q and k heads have ``head_dim``, v heads ``v_head_dim`` (192 / 128 in the release), so the KV
  cache is the asymmetric MHA pool (``AsymmetricMHATokenToKVPool``; the plain MHA pool when a
  config makes the two equal).
* ``layer_types`` mixes ``full_attention`` and ``sliding_attention`` layers. Sliding layers see
  the last ``sliding_window`` keys (the query included), have twice ``num_key_value_heads`` KV
  heads, and a learned per-head attention sink (``self_attn.attention_sink_bias`` in the
  checkpoint) in the softmax denominator. Full layers have ``num_key_value_heads`` heads, no sink.
  One pool holds every layer, so it is sized by the wider layers: ``head_num`` is the sliding
  layers' per-rank KV heads, and a full-attention layer uses the first of them (the attention
  backend writes zeros to the rest). Every layer keeps all its tokens (a sliding layer's keys
  before its window are masked, not freed), so HiCache moves whole pages of every layer.
* Partial rotary: the first ``int(head_dim * partial_rotary_factor)`` features of q and k rotate
  (rotate-half style), with ``rope_theta`` per layer type from ``rope_parameters``.
* Values are multiplied by ``attention_value_scale`` before they are cached.
* ``mlp_layer_types``: ``dense`` layers have a gated MLP of ``intermediate_size``; ``sparse``
  layers a routed MoE (``n_routed_experts`` experts of ``moe_intermediate_size``, sigmoid
  group-limited top-k router with ``e_score_correction_bias``, no shared experts).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.moe import SparseMoE, TopKRouter, moe_weight_shapes
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.kv_pool_spec import KVPoolLayout, mha_layout
from sglang.srt.models.base import ModelSpec
from sglang.srt.models.llama import (
    GATE_UP_STACKED_PARAMS,
    QKV_STACKED_PARAMS,
    CausalLM,
    DecoderModel,
    LlamaDecoderLayer,
    mlp_and_norm_shapes,
)

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
MLP_TYPES = ("dense", "sparse")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.334  # HF's default when rope_parameters omits it
# HF MiMoV2FlashConfig.__post_init__ defaults (the release's thetas).
DEFAULT_ROPE_PARAMETERS = {
    FULL: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR},
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR},
}


def kv_heads_of(hf, layer_type: str) -> int:
    """Total KV heads of a layer type (sliding layers have twice ``num_key_value_heads``)."""
    return hf.num_key_value_heads * (2 if layer_type == SLIDING else 1)


def rotary_dim_of(hf, layer_type: str) -> int:
    return int(hf.head_dim * hf.rope_parameters[layer_type]["partial_rotary_factor"])


class MiMoV2FlashAttention(nn.Module):
    def __init__(self, config, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        layer_type = config.layer_types[layer_id]
        self.head_dim, self.v_head_dim = config.head_dim, config.v_head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, kv_heads_of(config, layer_type),
            bias=config.attention_bias, v_head_size=self.v_head_dim,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.v_head_dim, config.hidden_size)
        self.rotary_emb = rotary_emb  # shared by the layers of one type
        self.rotary_dim = rotary_emb.head_dim
        self.v_scale = 1.0 if config.attention_value_scale is None else float(config.attention_value_scale)
        sliding = layer_type == SLIDING
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id,
            v_head_dim=self.v_head_dim, sliding_window=config.sliding_window if sliding else None, with_sinks=sliding,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        q_size, k_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden_states).split([q_size, k_size, self.num_kv_heads * self.v_head_dim], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = self.rotary_emb(positions, q[..., :r], k[..., :r])
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1)
        v = v.reshape(-1, self.num_kv_heads, self.v_head_dim) * self.v_scale
        return self.o_proj(self.attn(q, k, v, forward_batch))


def mimo_moe(config) -> SparseMoE:
    """A ``sparse`` layer's MoE: sigmoid scores, bias-corrected group-limited top-k (V3's
    ``noaux_tc`` router), no shared experts, expert outputs summed in the model dtype (as HF)."""
    router = TopKRouter(
        config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, scoring_func="sigmoid",
        topk_method="noaux_tc", n_group=config.n_group, topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=float(config.routed_scaling_factor),
        correction_bias=True,
    )
    return SparseMoE(router, config.hidden_size, config.moe_intermediate_size, accumulate_fp32=False)


class MiMoV2FlashModel(DecoderModel):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = {
            t: RotaryEmbedding(rotary_dim_of(config, t), config.max_position_embeddings,
                               config.rope_parameters[t]["rope_theta"])
            for t in sorted(set(config.layer_types))
        }
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, MiMoV2FlashAttention, rotary[config.layer_types[i]],
                              mimo_moe(config) if config.mlp_layer_types[i] == "sparse" else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MiMoV2FlashForCausalLM(ModelSpec, CausalLM):
    hf_required_keys = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "head_dim", "v_head_dim",
    )
    # HF MiMoV2FlashConfig defaults for the keys a config.json may omit.
    hf_config_defaults: ClassVar[dict] = {
        **ModelSpec.hf_config_defaults,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "sliding_window": 129,
        "attention_value_scale": 0.707,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "layer_types": None,
        "mlp_layer_types": None,
        "rope_parameters": None,
    }
    skipped_weight_prefixes = ("model.mtp.",)  # the multi-token-prediction head, which HF ignores too
    # (fused parameter, HF name part, shard id)
    stacked_params_mapping = (
        *QKV_STACKED_PARAMS, *GATE_UP_STACKED_PARAMS, (".attn.sinks", ".attention_sink_bias", None),
    )

    def __init__(self, config):
        super().__init__(config, MiMoV2FlashModel(config))

    @classmethod
    def complete_hf_config(cls, raw: dict, where: str = "config.json") -> dict:
        """HF's completion of a MiMo config: per-layer attention and MLP types (first layer and
        every 6th full, first layer dense), rope per layer type, ``sliding_window_size`` + 1 as
        ``sliding_window``; ValueError naming a bad value."""
        hf = super().complete_hf_config(raw, where)
        n = hf["num_hidden_layers"]
        if hf["layer_types"] is None:
            hf["layer_types"] = [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        if hf["mlp_layer_types"] is None:
            hf["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
        for key, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_TYPES)):
            values = list(hf[key])
            if len(values) != n or any(v not in allowed for v in values):
                raise ValueError(f"{where}: {key} must list one of {list(allowed)} per layer "
                                 f"({n} layers), got {values}")
            hf[key] = values
        if raw.get("sliding_window_size") is not None:  # the release's key: keys before the query
            hf["sliding_window"] = int(raw["sliding_window_size"]) + 1
        if SLIDING in hf["layer_types"] and (hf["sliding_window"] is None or int(hf["sliding_window"]) < 1):
            raise ValueError(f"{where}: sliding_window must be >= 1 for sliding_attention layers, "
                             f"got {hf['sliding_window']!r}")
        hf["rope_parameters"] = cls._rope_parameters(hf.get("rope_parameters"), hf, where)
        if hf["routed_scaling_factor"] is None:
            hf["routed_scaling_factor"] = 1.0
        if "sparse" in hf["mlp_layer_types"]:
            cls._check_router(hf, where)
        return hf

    @staticmethod
    def _check_router(hf: dict, where: str) -> None:
        experts, groups, top_groups, top_k = (hf[k] for k in ("n_routed_experts", "n_group", "topk_group",
                                                              "num_experts_per_tok"))
        if groups < 1 or experts % groups or experts // groups < 2:
            raise ValueError(f"{where}: n_routed_experts ({experts}) must split into n_group ({groups}) groups "
                             "of at least 2 experts")
        if not 1 <= top_groups <= groups:
            raise ValueError(f"{where}: topk_group must be in [1, n_group={groups}], got {top_groups}")
        if not 1 <= top_k <= top_groups * (experts // groups):
            raise ValueError(f"{where}: num_experts_per_tok must be in [1, {top_groups * (experts // groups)}] "
                             f"(the experts of topk_group groups), got {top_k}")

    @staticmethod
    def _rope_parameters(rope, hf: dict, where: str) -> dict:
        """rope_parameters per layer type (a flat dict applies to both); default rope only."""
        if rope is None:
            rope = DEFAULT_ROPE_PARAMETERS
        elif not isinstance(rope, dict):
            raise ValueError(f"{where}: rope_parameters must be a dict, got {rope!r}")
        elif not set(rope) & set(LAYER_TYPES):
            rope = dict.fromkeys(LAYER_TYPES, rope)
        out = {}
        for layer_type in sorted(set(hf["layer_types"])):
            params = rope.get(layer_type)
            if not isinstance(params, dict) or params.get("rope_theta") is None:
                raise ValueError(f"{where}: rope_parameters[{layer_type!r}] needs a rope_theta, got {params!r}")
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"{where}: rope_parameters[{layer_type!r}] rope_type {params['rope_type']!r} "
                                 "is not supported for MiMoV2FlashForCausalLM; supported: ['default']")
            factor = params.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
            rotary_dim = int(hf["head_dim"] * factor)
            if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > hf["head_dim"]:
                raise ValueError(f"{where}: head_dim {hf['head_dim']} x partial_rotary_factor {factor} gives rotary "
                                 f"dim {rotary_dim}; it must be even and in [2, head_dim]")
            out[layer_type] = {"rope_type": "default", "rope_theta": float(params["rope_theta"]),
                               "partial_rotary_factor": factor}
        return out

    @classmethod
    def kv_pool_layout(cls, hf, tp_size: int, dtype: torch.dtype) -> KVPoolLayout:
        """One (asymmetric) pool for all layers, with the widest layer type's per-rank KV heads."""
        heads = max(max(1, kv_heads_of(hf, t) // tp_size) for t in set(hf.layer_types))
        return mha_layout(dtype, hf.num_hidden_layers, heads, hf.head_dim, hf.v_head_dim)

    @classmethod
    def hf_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of this config holds, full (unsharded) shapes."""
        h, d, dv, nq = config.hidden_size, config.head_dim, config.v_head_dim, config.num_attention_heads
        shapes = cls.outer_weight_shapes(config)
        for i, layer_type in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            nkv = kv_heads_of(config, layer_type)
            attn = {"q_proj": (nq * d, h), "k_proj": (nkv * d, h), "v_proj": (nkv * dv, h)}
            for name, shape in attn.items():
                shapes[f"{p}self_attn.{name}.weight"] = shape
                if config.attention_bias:
                    shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
            shapes[f"{p}self_attn.o_proj.weight"] = (h, nq * dv)
            if layer_type == SLIDING:
                shapes[f"{p}self_attn.attention_sink_bias"] = (nq,)
            sparse = config.mlp_layer_types[i] == "sparse"
            moe = moe_weight_shapes(f"{p}mlp.", h, config.n_routed_experts, config.moe_intermediate_size,
                                    correction_bias=True) if sparse else None
            shapes.update(mlp_and_norm_shapes(p, h, config.intermediate_size, moe))
        return shapes


EntryClass = MiMoV2FlashForCausalLM
