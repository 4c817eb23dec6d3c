"""DeepSeek-V2 / V3: multi-head latent attention (MLA) on the MLA pool, MoE with shared experts.

Attention runs in absorbed (latent) form. Per token the pool caches one "head" of
``kv_lora_rank + qk_rope_head_dim`` values: the compressed KV after ``kv_a_layernorm``, then the
rotated ``k_pe``. A query's no-rope part is mapped into the latent space through the K half of
``kv_b_proj`` (``q_nope @ W_UK``) and concatenated with its rotated ``q_pe``; attention over the
cached latents is then MQA with key dim ``kv_lora_rank + rope`` and value dim ``kv_lora_rank``
(the pool's value view is the latent), and each head's latent output is mapped to ``v_head_dim``
through the V half of ``kv_b_proj``. That equals HF's expanded form (keys ``[latent @ W_UK^T, k_pe]``,
values ``latent @ W_UV^T``) up to fp32 rounding. The softmax scale is ``qk_head_dim ** -0.5``, times
``mscale(factor, mscale_all_dim) ** 2`` with YaRN rope scaling (as HF applies it).

Rotary: DeepSeek rotates interleaved feature pairs (HF V2 always, V3 when ``rope_interleave``).

Tensor parallelism: attention heads are sharded (q / q_b / kv_b column-parallel, o_proj
row-parallel); ``q_a_proj`` and ``kv_a_proj_with_mqa`` are replicated, so the cached latent is the
same bytes on every rank (the MLA pool is replicated: only TP rank 0 backs it up to L3). MoE layers
shard each expert's intermediate dim (``layers/moe.py``).

Pipeline parallelism: a stage builds its layer range only (``DeepseekV2Model``); the latent is
replicated over a stage's TP ranks but differs between stages, so TP rank 0 of each stage backs
up its own pages (the pp rank and size are in the L3 namespace, ``mem_cache/storage/keys.py``).

Layers ``i >= first_k_dense_replace`` (and ``i % moe_layer_freq == 0``) are MoE; the others use a
dense MLP of ``intermediate_size``. Multi-token-prediction layers some checkpoints carry
(``model.layers.{num_hidden_layers}...``) are not used and skipped on load, as HF does.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from sglang.srt.distributed import get_tensor_model_parallel_world_size
from sglang.srt.distributed.pipeline import PipelineStage, PPMissingLayer
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    gemm_rows,
    invariant_linear,
)
from sglang.srt.layers.moe import DeepseekMoE, moe_weight_shapes
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import (
    RotaryEmbedding,
    rope_type_of,
    yarn_factor,
    yarn_get_mscale,
)
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.model_executor.kv_pool_spec import KVPoolLayout, PoolSpec
from sglang.srt.models.base import ModelSpec
from sglang.srt.models.llama import (
    GATE_UP_STACKED_PARAMS,
    CausalLM,
    DecoderModel,
    LlamaDecoderLayer,
    mlp_and_norm_shapes,
)


class ReplicatedLinear(nn.Module):
    """``x @ W^T (+ b)`` with the full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def invariant_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for ``x`` (B, T, K), ``w`` (B, K, N), with T padded to ``gemm_rows(T)`` so a row's
    result does not depend on how many rows share the call."""
    rows = x.shape[1]
    if rows and rows != gemm_rows(rows):
        x = torch.cat([x, x.new_zeros(x.shape[0], gemm_rows(rows) - rows, x.shape[2])], dim=1)
    return torch.matmul(x, w)[:, :rows]


def mla_softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if rope_type_of(scaling) != "default" and scaling.get("mscale_all_dim"):
        mscale = yarn_get_mscale(yarn_factor(scaling, config.max_position_embeddings), scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    """MLA in latent form over the MLA pool (see the module docstring)."""

    def __init__(self, config, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        h, bias = config.hidden_size, config.attention_bias
        self.num_heads = divide(config.num_attention_heads, tp_size, "num_attention_heads")
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        qk_dim = self.nope + self.rope
        total_heads = config.num_attention_heads
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, total_heads * qk_dim)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_heads * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, h, bias=bias)
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(
            self.num_heads, self.kv_lora_rank + self.rope, mla_softmax_scale(config), 1, layer_id,
            v_head_dim=self.kv_lora_rank,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q_resid, q = None, self.q_proj(hidden_states)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(tokens, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.reshape(tokens, 1, self.rope))

        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope :]
        q_latent = invariant_bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (T, H, kv_lora_rank)
        q_full = torch.cat([q_latent, q_pe], dim=-1)
        k_full = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # (T, 1, kv_lora_rank + rope)
        key_positions = self.select_keys(positions, hidden_states, q_resid, forward_batch)
        out = self.attn(q_full, k_full, None, forward_batch, key_positions=key_positions)  # (T, H * kv_lora_rank)
        out = out.view(tokens, self.num_heads, self.kv_lora_rank).transpose(0, 1)
        out = invariant_bmm(out, w_uv.transpose(1, 2)).transpose(0, 1)  # (T, H, v_head_dim)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))

    def select_keys(self, positions, hidden_states, q_resid, forward_batch) -> torch.Tensor | None:
        """The key positions each row attends (T, K), or None for all earlier keys (dense MLA)."""
        return None


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def is_moe_layer(config, layer_id: int) -> bool:
    """``mlp_layer_types[i] == "sparse"`` when the config lists them (V3.2), else MoE from
    ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds is not None:
        return bool(config.n_routed_experts) and kinds[layer_id] == "sparse"
    return (
        bool(config.n_routed_experts)
        and layer_id >= config.first_k_dense_replace
        and layer_id % config.moe_layer_freq == 0
    )


class DeepseekV2Model(DecoderModel):
    """Builds only this pipeline stage's part (``PipelineStage.current``), as ``LlamaModel``: the
    embedding on the first stage, the final norm on the last, and the layers of its range, each
    dense or MoE by its global index; a stage's attention layers number from 0 (its MLA pool
    and, for V3.2, its indexer sidecar hold only its layers)."""

    def __init__(self, config, attention_cls=DeepseekV2Attention):
        super().__init__()
        self.stage = stage = PipelineStage.current(config.num_hidden_layers)
        holds_embedding = stage.is_first or (config.tie_word_embeddings and stage.is_last)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if holds_embedding
                             else PPMissingLayer())
        rotary_emb = RotaryEmbedding(
            config.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
            interleaved=bool(config.rope_interleave),
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i - stage.start_layer, attention_cls, rotary_emb,
                              DeepseekMoE(config) if is_moe_layer(config, i) else None)
            if stage.start_layer <= i < stage.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else PPMissingLayer()


class DeepseekV2ForCausalLM(ModelSpec, CausalLM):
    hf_required_keys = (
        *ModelSpec.hf_required_keys, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    )
    # HF DeepseekV2Config defaults for keys a config.json may omit.
    hf_config_defaults: ClassVar[dict] = {
        **ModelSpec.hf_config_defaults,
        "q_lora_rank": 1536,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "moe_intermediate_size": 1407,
        "num_experts_per_tok": None,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "norm_topk_prob": False,
        "rope_interleave": True,
    }
    # Keys a MoE config (n_routed_experts set) must give explicitly.
    moe_required_keys = ("num_experts_per_tok",)
    # Keys whose explicit null means something (no q LoRA, no groups, no shared experts), not "default".
    nullable_keys = ("q_lora_rank", "n_group", "topk_group", "n_shared_experts", "n_routed_experts")
    attention_cls = DeepseekV2Attention
    stacked_params_mapping = GATE_UP_STACKED_PARAMS
    # --pp-size: a stage holds a contiguous layer range (dense or MoE layers alike) and an MLA
    # pool over those layers; its latent is replicated over TP, not over stages, so TP rank 0 of
    # every stage writes its own L3 objects (the pp rank is part of their namespace).
    supports_pipeline_parallel = True

    @classmethod
    def complete_hf_config(cls, raw: dict, where: str = "config.json") -> dict:
        hf = super().complete_hf_config(raw, where)
        hf.update({k: None for k in cls.nullable_keys if k in raw and raw[k] is None})
        if hf["n_routed_experts"]:
            missing = [k for k in cls.moe_required_keys if hf.get(k) is None]
            if missing:
                raise ValueError(f"{where} lacks required fields {missing} for {cls.__name__} "
                                 f"(a MoE config: n_routed_experts={hf['n_routed_experts']})")
        if hf["mlp_bias"]:
            raise ValueError(f"{where}: mlp_bias=true is not supported for {cls.__name__} (supported: false)")
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "num_attention_heads"):
            if not isinstance(hf[key], int) or hf[key] < 1:
                raise ValueError(f"{where}: {key} must be a positive integer, got {hf[key]!r}")
        if hf["qk_rope_head_dim"] % 2:
            raise ValueError(f"{where}: qk_rope_head_dim must be even, got {hf['qk_rope_head_dim']}")
        if hf["moe_layer_freq"] < 1:
            raise ValueError(f"{where}: moe_layer_freq must be >= 1, got {hf['moe_layer_freq']}")
        yarn = rope_type_of(hf["rope_scaling"]) == "yarn"  # (also names an unsupported rope type)
        if yarn and hf["rope_scaling"].get("original_max_position_embeddings") is None:
            raise ValueError(f"{where}: rope_scaling type 'yarn' needs original_max_position_embeddings")
        return hf

    @classmethod
    def kv_pool_layout(cls, hf, tp_size: int, dtype: torch.dtype) -> KVPoolLayout:
        """One latent + rope row per token and layer, the same on every TP rank."""
        args = {"dtype": dtype, "kv_lora_rank": hf.kv_lora_rank, "qk_rope_head_dim": hf.qk_rope_head_dim,
                "layer_num": hf.num_hidden_layers}
        return KVPoolLayout(PoolSpec(PoolKind.MLA, args))

    def __init__(self, config):
        super().__init__(config, DeepseekV2Model(config, self.attention_cls))

    @classmethod
    def attention_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        """One layer's ``self_attn.*`` tensors (names relative to the layer), full shapes."""
        h, heads = config.hidden_size, config.num_attention_heads
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        r, rope = config.kv_lora_rank, config.qk_rope_head_dim
        shapes = {}
        if config.q_lora_rank is None:
            shapes["q_proj.weight"] = (heads * qk, h)
        else:
            shapes["q_a_proj.weight"] = (config.q_lora_rank, h)
            shapes["q_a_layernorm.weight"] = (config.q_lora_rank,)
            shapes["q_b_proj.weight"] = (heads * qk, config.q_lora_rank)
            if config.attention_bias:
                shapes["q_a_proj.bias"] = (config.q_lora_rank,)
        shapes["kv_a_proj_with_mqa.weight"] = (r + rope, h)
        shapes["kv_a_layernorm.weight"] = (r,)
        shapes["kv_b_proj.weight"] = (heads * (config.qk_nope_head_dim + config.v_head_dim), r)
        shapes["o_proj.weight"] = (h, heads * config.v_head_dim)
        if config.attention_bias:
            shapes["kv_a_proj_with_mqa.bias"] = (r + rope,)
            shapes["o_proj.bias"] = (h,)
        return shapes

    @classmethod
    def hf_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of this config holds, full (unsharded) shapes."""
        h = config.hidden_size
        shapes = cls.outer_weight_shapes(config)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            for name, shape in cls.attention_weight_shapes(config).items():
                shapes[f"{p}self_attn.{name}"] = shape
            moe = None
            if is_moe_layer(config, i):
                shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
                moe = moe_weight_shapes(f"{p}mlp.", h, config.n_routed_experts, config.moe_intermediate_size,
                                        correction_bias=config.topk_method == "noaux_tc",
                                        shared_intermediate_size=shared)
            shapes.update(mlp_and_norm_shapes(p, h, config.intermediate_size, moe))
        return shapes

    def skip_weight(self, name: str) -> bool:
        """Multi-token-prediction layers past ``num_hidden_layers``, which HF does not use either."""
        m = _LAYER_RE.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_hidden_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3: sigmoid scores with the ``e_score_correction_bias`` group-limited choice (noaux_tc),
    normalized top-k weights; optional q LoRA and rope interleave as the config says."""

    hf_config_defaults: ClassVar[dict] = {
        **DeepseekV2ForCausalLM.hf_config_defaults,
        "q_lora_rank": 1536,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "num_experts_per_tok": 8,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "rope_interleave": True,
    }


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]
