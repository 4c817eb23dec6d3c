"""Qwen3-Next: Gated DeltaNet linear-attention layers interleaved with gated full attention, MoE MLPs.

Layers follow ``config.layer_types`` (HF derives it from ``full_attention_interval``):

- ``full_attention``: GQA with per-head q/k RMSNorm, partial rotary (``partial_rotary_factor`` of
  the head dim), and an output gate: q_proj yields ``[q_h, gate_h]`` per head and the attention
  output is multiplied by ``sigmoid(gate)`` before o_proj. Its K/V live in the MHA pool, which
  holds only these layers (``RadixAttention`` layer_id = index among the full-attention layers).
- ``linear_attention``: Gated DeltaNet. ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head),
  a depthwise causal conv1d (kernel ``linear_conv_kernel_dim``) with SiLU over ``[q, k, v]``, the
  gated delta rule (``layers/linear_attention.py``), a gated RMSNorm by ``z`` and out_proj. Its
  per-request state (conv: the last K-1 conv inputs; temporal: (Hv, dk, dv) per layer) lives in
  the Mamba state pool; ``forward_batch.mamba_slots`` (``StateSlots``) says, per request, which slot
  to start from and which to write.

RMSNorms are HF's ``(1 + weight)`` form except the gated one. MLPs are the sparse MoE with a
shared expert (``layers/moe.py``), or dense on ``mlp_only_layers`` / ``num_experts == 0``.
Weights use HF names; TP shards attention heads, key/value head groups of the linear layers and the
expert intermediate dims.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.pipeline import PipelineStage, PPMissingLayer
from sglang.srt.layers.activation import invariant_pointwise
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from sglang.srt.layers.linear_attention import (
    ZERO_STATE,
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from sglang.srt.layers.moe import SparseMoE, TopKRouter, moe_weight_shapes
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.model_executor.kv_pool_spec import KVPoolLayout, PoolSpec, mha_layout
from sglang.srt.models.base import ModelSpec
from sglang.srt.models.llama import (
    GATE_UP_STACKED_PARAMS,
    QKV_STACKED_PARAMS,
    CausalLM,
    DecoderModel,
    LlamaMLP,
    PreNormDecoderLayer,
    mlp_and_norm_shapes,
)

FULL, LINEAR = "full_attention", "linear_attention"
LAYER_TYPES = (FULL, LINEAR)


class OffsetRMSNorm(RMSNorm):
    """HF Qwen3-Next RMSNorm: ``x / rms(x) * (1 + weight)`` in fp32 (weight stored zero-centred)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``weight * x / rms(x) * silu(gate)`` over the last dim (the linear-attention output norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


def full_attention_layers(config) -> list[int]:
    return [i for i, t in enumerate(config.layer_types) if t == FULL]


def linear_attention_layers(config) -> list[int]:
    return [i for i, t in enumerate(config.layer_types) if t == LINEAR]


class Qwen3NextAttention(nn.Module):
    def __init__(self, config, kv_layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        d = self.head_dim = config.head_dim
        # q_proj yields [q, gate] per head: as 2 * num_heads heads of head_dim, sharded by head.
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias=config.attention_bias)
        self.q_norm = OffsetRMSNorm(d, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.rotary_dim = rotary_emb.head_dim
        self.attn = RadixAttention(self.num_heads, d, d**-0.5, self.num_kv_heads, kv_layer_id)

    def _rope(self, positions, q, k):
        r = self.rotary_dim
        q_rot, k_rot = self.rotary_emb(positions, q[..., :r], k[..., :r])
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)

    def forward(self, positions, hidden_states, forward_batch) -> torch.Tensor:
        d, h, hk = self.head_dim, self.num_heads, self.num_kv_heads
        qg, k, v = self.qkv_proj(hidden_states).split([2 * h * d, hk * d, hk * d], dim=-1)
        q, gate = qg.reshape(-1, h, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(-1, hk, d))
        q, k = self._rope(positions, q, k)
        out = self.attn(q, k, v.reshape(-1, hk, d), forward_batch)
        out = out * torch.sigmoid(gate.reshape(out.shape))  # (also 0 rows: a CP rank without tokens)
        return self.o_proj(out)


class ConvWeight(nn.Module):
    """The depthwise conv1d weight (HF ``(conv_dim, 1, K)``) keeping this rank's q, k and v channels."""

    def __init__(self, key_dim: int, value_dim: int, kernel: int, tp_rank: int, tp_size: int):
        super().__init__()
        self.key_dim, self.value_dim, self.tp_rank, self.tp_size = key_dim, value_dim, tp_rank, tp_size
        local = (2 * key_dim + value_dim) // tp_size
        self.weight = nn.Parameter(torch.empty(local, 1, kernel), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight: torch.Tensor, shard_id=None) -> None:
        kd, vd, r = self.key_dim // self.tp_size, self.value_dim // self.tp_size, self.tp_rank
        parts = [loaded_weight.narrow(0, r * kd, kd), loaded_weight.narrow(0, self.key_dim + r * kd, kd),
                 loaded_weight.narrow(0, 2 * self.key_dim + r * vd, vd)]
        shard = torch.cat(parts)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"conv1d: checkpoint shard has shape {tuple(shard.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(shard)


def _head_sharded(n: int, tp_rank: int, tp_size: int) -> nn.Parameter:
    """A per-value-head vector (A_log, dt_bias), this rank's heads."""
    local = n // tp_size
    param = nn.Parameter(torch.empty(local), requires_grad=False)

    def loader(p, loaded_weight, shard_id=None):
        shard = loaded_weight.narrow(0, tp_rank * local, local)
        if tuple(shard.shape) != tuple(p.shape):
            raise ValueError(f"head vector: checkpoint shard has shape {tuple(shard.shape)}, expected {tuple(p.shape)}")
        p.data.copy_(shard)

    param.weight_loader = loader
    return param


class GatedDeltaNet(nn.Module):
    def __init__(self, config, state_layer_id: int):
        super().__init__()
        self.state_layer_id = state_layer_id  # index among the linear-attention layers (state pool layer)
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden_size, 2 * config.linear_key_dim + 2 * config.linear_value_dim)
        self.in_proj_ba = ColumnParallelLinear(config.hidden_size, 2 * config.linear_num_value_heads)
        tp_rank, tp_size = self.in_proj_qkvz.tp_rank, self.in_proj_qkvz.tp_size
        self.nk = divide(config.linear_num_key_heads, tp_size, "linear_num_key_heads")
        self.nv = divide(config.linear_num_value_heads, tp_size, "linear_num_value_heads")
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv1d = ConvWeight(config.linear_key_dim, config.linear_value_dim, config.linear_conv_kernel_dim,
                                 tp_rank, tp_size)
        self.A_log = _head_sharded(config.linear_num_value_heads, tp_rank, tp_size)
        self.dt_bias = _head_sharded(config.linear_num_value_heads, tp_rank, tp_size)
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(config.linear_value_dim, config.hidden_size)

    def _split(self, hidden_states):
        """(mixed q|k|v (N, conv channels), z (N, nv, dv), b (N, nv), a (N, nv)) from the projections."""
        n, nk, r, dk, dv = hidden_states.shape[0], self.nk, self.nv // self.nk, self.dk, self.dv
        qkvz = self.in_proj_qkvz(hidden_states).reshape(n, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(hidden_states).reshape(n, nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, self.nv, dv), b.reshape(n, self.nv), a.reshape(n, self.nv)

    def _qkv(self, mixed):
        n = mixed.shape[0]
        kd = self.nk * self.dk
        q, k, v = mixed.split([kd, kd, self.nv * self.dv], dim=-1)
        return q.reshape(n, self.nk, self.dk), k.reshape(n, self.nk, self.dk), v.reshape(n, self.nv, self.dv)

    def forward(self, positions, hidden_states, forward_batch) -> torch.Tensor:
        pool, slots = forward_batch.state_pool, forward_batch.mamba_slots
        if pool is None or slots is None:
            raise ValueError("a linear-attention layer needs forward_batch.state_pool and forward_batch.mamba_slots")
        m = self.state_layer_id
        mixed, z, b, a = self._split(hidden_states)
        beta = invariant_pointwise(torch.sigmoid, b)
        g = -self.A_log.float().exp() * invariant_pointwise(F.softplus, a.float() + self.dt_bias)
        conv_w = self.conv1d.weight[:, 0, :]
        conv_buf, ssm_buf = pool.layer_view("conv_0", m), pool.layer_view("temporal", m)
        dst = torch.tensor(slots.dst, dtype=torch.int64, device=conv_buf.device)
        if forward_batch.forward_mode.is_decode():
            if min(slots.src) < 1:
                raise ValueError(f"decode continues a state: source slots must be >= 1, got {list(slots.src)}")
            src = torch.tensor(slots.src, dtype=torch.int64, device=conv_buf.device)
            x, conv_state = causal_conv1d(mixed.unsqueeze(-1), conv_w, conv_buf[src])
            q, k, v = self._qkv(F.silu(x[..., 0]))
            out, ssm_state = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_buf[src])
            pool.write_layer("conv_0", m, dst, conv_state)
            pool.write_layer("temporal", m, dst, ssm_state)
        else:
            outs, starts, slot_ids, conv_states, ssm_states, start = [], [], [], [], [], 0
            for i, (src, n) in enumerate(zip(slots.src, forward_batch.extend_seq_lens_cpu)):
                conv_state = None if src == ZERO_STATE else conv_buf[src]
                ssm_state = None if src == ZERO_STATE else ssm_buf[src]
                # Segments end at the request's checkpoints, then at its last token: the state after
                # each checkpoint offset goes to that checkpoint's slot (a later prefix resumes there).
                points = [*slots.checkpoints(i), (n, slots.dst[i])]
                pos = 0
                for offset, slot in points:
                    rows = slice(start + pos, start + offset)
                    x, conv_state = causal_conv1d(mixed[rows].transpose(0, 1), conv_w, conv_state)
                    q, k, v = self._qkv(F.silu(x).transpose(0, 1))
                    out, ssm_state = chunk_gated_delta_rule(q, k, v, g[rows], beta[rows], ssm_state)
                    outs.append(out)
                    slot_ids.append(slot)
                    conv_states.append(conv_state)
                    ssm_states.append(ssm_state)
                    pos = offset
                start += n
            out = torch.cat(outs)
            idx = torch.tensor(slot_ids, dtype=torch.int64, device=conv_buf.device)
            pool.write_layer("conv_0", m, idx, torch.stack(conv_states))
            pool.write_layer("temporal", m, idx, torch.stack(ssm_states))
        out = self.norm(out.to(hidden_states.dtype), z)
        return self.out_proj(out.reshape(out.shape[0], -1))


def is_sparse_layer(config, layer_id: int) -> bool:
    """MoE unless the layer is in ``mlp_only_layers``, there are no experts, or off ``decoder_sparse_step``."""
    return (layer_id not in config.mlp_only_layers and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0)


def qwen3_next_moe(config) -> SparseMoE:
    """Softmax top-k router (logits and weights in the model dtype, as HF), routed experts and one
    ``shared_expert`` scaled by ``sigmoid(shared_expert_gate)``, summed in the model dtype."""
    router = TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                        norm_topk_prob=config.norm_topk_prob, model_dtype_logits=True, sorted_topk=True)
    return SparseMoE(router, config.hidden_size, config.moe_intermediate_size,
                     config.shared_expert_intermediate_size, shared_name="shared_expert", shared_gate=True,
                     accumulate_fp32=False)


class Qwen3NextDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_id: int, rotary_emb: RotaryEmbedding, pool_layer_id: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_id]
        if self.layer_type == FULL:
            self.self_attn = Qwen3NextAttention(config, pool_layer_id, rotary_emb)
        else:
            self.linear_attn = GatedDeltaNet(config, pool_layer_id)
        self.mlp = qwen3_next_moe(config) if is_sparse_layer(config, layer_id) else LlamaMLP(config)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def token_mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == FULL else self.linear_attn


class Qwen3NextModel(DecoderModel):
    """Builds only this pipeline stage's part (``PipelineStage.current``); pool layer ids count the
    stage's own full-attention (KV pool) and linear-attention (state pool) layers from 0."""

    def __init__(self, config):
        super().__init__()
        self.stage = stage = PipelineStage.current(config.num_hidden_layers)
        holds_embedding = stage.is_first or (config.tie_word_embeddings and stage.is_last)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if holds_embedding
                             else PPMissingLayer())
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        rotary_emb = RotaryEmbedding(rotary_dim, config.max_position_embeddings, config.rope_theta,
                                     config.rope_scaling)
        own = range(stage.start_layer, stage.end_layer)
        full = [i for i in own if config.layer_types[i] == FULL]
        linear = [i for i in own if config.layer_types[i] == LINEAR]
        pool_ids = {i: (full.index(i) if i in full else linear.index(i)) for i in own}
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, rotary_emb, pool_ids[i]) if i in pool_ids else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else PPMissingLayer()


class Qwen3NextForCausalLM(ModelSpec, CausalLM):
    hf_required_keys = ModelSpec.hf_required_keys + ("num_key_value_heads",)
    supports_pipeline_parallel = True
    supports_attn_context_parallel = True
    hf_config_defaults: ClassVar[dict] = {
        **ModelSpec.hf_config_defaults,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10,
        "num_experts": 512,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "layer_types": None,
    }
    skipped_weight_prefixes = ("mtp.",)  # multi-token prediction, which HF does not use either
    # (fused parameter, HF projection, shard id); q_proj holds [q, gate] per head.
    stacked_params_mapping = (*QKV_STACKED_PARAMS, *GATE_UP_STACKED_PARAMS)

    @classmethod
    def complete_hf_config(cls, raw: dict, where: str = "config.json") -> dict:
        hf = super().complete_hf_config(raw, where)
        rope = raw.get("rope_parameters")
        if isinstance(rope, dict) and "partial_rotary_factor" in rope and "partial_rotary_factor" not in raw:
            hf["partial_rotary_factor"] = rope["partial_rotary_factor"]
        n = hf["num_hidden_layers"]
        if hf["layer_types"] is None:
            every = hf["full_attention_interval"]
            if not isinstance(every, int) or every < 1:
                raise ValueError(f"{where}: full_attention_interval must be a positive int, got {every!r}")
            hf["layer_types"] = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
        types = list(hf["layer_types"])
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"{where}: layer_types must list {n} entries from {list(LAYER_TYPES)}, got {types}")
        if FULL not in types:
            raise ValueError(f"{where}: layer_types has no {FULL!r} layer; the KV pool (the tree's anchor) needs one")
        hf["layer_types"] = types
        if hf["linear_num_value_heads"] % hf["linear_num_key_heads"]:
            raise ValueError(f"{where}: linear_num_value_heads ({hf['linear_num_value_heads']}) must be a multiple "
                             f"of linear_num_key_heads ({hf['linear_num_key_heads']})")
        rotary = int(hf["head_dim"] * hf["partial_rotary_factor"])
        if rotary < 2 or rotary % 2:
            raise ValueError(f"{where}: head_dim * partial_rotary_factor must be an even number >= 2, got {rotary}")
        hf["linear_key_dim"] = hf["linear_key_head_dim"] * hf["linear_num_key_heads"]
        hf["linear_value_dim"] = hf["linear_value_head_dim"] * hf["linear_num_value_heads"]
        hf["mlp_only_layers"] = list(hf["mlp_only_layers"] or [])
        return hf

    @classmethod
    def pipeline_stage_hf_config(cls, hf, start_layer: int, end_layer: int):
        """A stage needs a full-attention layer (its KV pool is the tree's anchor) and, when the model
        has linear-attention layers, one of those too (every rank keeps the same state slots)."""
        stage = super().pipeline_stage_hf_config(hf, start_layer, end_layer)
        needed = [FULL] + ([LINEAR] if LINEAR in hf.layer_types else [])
        lacking = [kind for kind in needed if kind not in stage.layer_types]
        if lacking:
            raise ValueError(f"the pipeline stage of layers [{start_layer}, {end_layer}) has no "
                             f"{' and no '.join(lacking)} layer (layer_types {hf.layer_types}); every stage of "
                             "Qwen3-Next needs both its KV pool and its state pool; choose a --pp-size whose "
                             "contiguous ranges each hold both kinds")
        return stage

    @classmethod
    def kv_pool_layout(cls, hf, tp_size: int, dtype: torch.dtype) -> KVPoolLayout:
        """MHA K/V for the full-attention layers; a Mamba state per request for the linear ones
        (this rank's key/value head groups: conv (q|k|v channels, K - 1), temporal (Hv, dk, dv) fp32)."""
        heads = max(1, hf.num_key_value_heads // tp_size)
        anchor = mha_layout(dtype, len(full_attention_layers(hf)), heads, hf.head_dim).anchor
        linear = linear_attention_layers(hf)
        if not linear:
            return KVPoolLayout(anchor)
        nk = divide(hf.linear_num_key_heads, tp_size, "linear_num_key_heads")
        nv = divide(hf.linear_num_value_heads, tp_size, "linear_num_value_heads")
        conv_channels = 2 * nk * hf.linear_key_head_dim + nv * hf.linear_value_head_dim
        state = PoolSpec(PoolKind.MAMBA, {
            "conv_state_shapes": [(conv_channels, hf.linear_conv_kernel_dim - 1)],
            "conv_state_segments": [(nk * hf.linear_key_head_dim,) * 2 + (nv * hf.linear_value_head_dim,)],
            "temporal_state_shape": (nv, hf.linear_key_head_dim, hf.linear_value_head_dim),
            "num_mamba_layers": len(linear), "conv_dtype": dtype, "ssm_dtype": torch.float32,
        })
        return KVPoolLayout(anchor, state=state)

    def __init__(self, config):
        super().__init__(config, Qwen3NextModel(config))

    @classmethod
    def hf_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF Qwen3-Next checkpoint of this config holds (full shapes; MTP excluded)."""
        h, d = config.hidden_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        kd, vd, nv = config.linear_key_dim, config.linear_value_dim, config.linear_num_value_heads
        shapes = cls.outer_weight_shapes(config)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            if config.layer_types[i] == FULL:
                attn = {"q_proj": (2 * q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
                for name, shape in attn.items():
                    shapes[f"{p}self_attn.{name}.weight"] = shape
                    if config.attention_bias:
                        shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
                shapes[f"{p}self_attn.q_norm.weight"] = (d,)
                shapes[f"{p}self_attn.k_norm.weight"] = (d,)
            else:
                la = f"{p}linear_attn."
                shapes[f"{la}in_proj_qkvz.weight"] = (2 * kd + 2 * vd, h)
                shapes[f"{la}in_proj_ba.weight"] = (2 * nv, h)
                shapes[f"{la}conv1d.weight"] = (2 * kd + vd, 1, config.linear_conv_kernel_dim)
                shapes[f"{la}A_log"] = (nv,)
                shapes[f"{la}dt_bias"] = (nv,)
                shapes[f"{la}norm.weight"] = (config.linear_value_head_dim,)
                shapes[f"{la}out_proj.weight"] = (h, vd)
            moe = moe_weight_shapes(
                f"{p}mlp.", h, config.num_experts, config.moe_intermediate_size, shared_name="shared_expert",
                shared_intermediate_size=config.shared_expert_intermediate_size, shared_gate=True,
            ) if is_sparse_layer(config, i) else None
            shapes.update(mlp_and_norm_shapes(p, h, config.intermediate_size, moe))
        return shapes


EntryClass = Qwen3NextForCausalLM
