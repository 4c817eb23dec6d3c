"""Llama (GQA, optional attention/MLP bias, tied embeddings) with HF weight names, and the pieces the
other decoder-only models here share: the pre-norm residual block (``PreNormDecoderLayer``), the
embed -> layers -> norm stack (``DecoderModel``), the LM-head / logits / weight-loading shell
(``CausalLM``) and the HF weight-shape helper ``mlp_and_norm_shapes`` (``gated_mlp_shapes`` is in ``layers/moe.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sglang.srt.distributed.pipeline import PipelineStage, PPMissingLayer, PPProxyTensors
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.moe import gated_mlp_shapes
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.models.base import ModelSpec
from sglang.srt.models.weight_names import load_named_weights


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inter, bias = config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by all layers
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, *self.qk_norm(q, k))
        out = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), forward_batch)
        return self.o_proj(out)


class PreNormDecoderLayer(nn.Module):
    """``h + mixer(norm(h))`` then ``+ mlp(norm(.))``, the residual carried through the fused
    add-and-norm of ``input_layernorm`` / ``post_attention_layernorm``. A subclass sets those two
    norms, ``mlp`` and ``self_attn`` (or overrides ``token_mixer``)."""

    @property
    def token_mixer(self) -> nn.Module:
        return self.self_attn

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.token_mixer(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    """``attention_cls(config, layer_id, rotary_emb)``, then ``mlp`` (default: the dense ``LlamaMLP``)."""

    def __init__(self, config, layer_id: int, attention_cls, rotary_emb: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = attention_cls(config, layer_id, rotary_emb)
        self.mlp = LlamaMLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    """``embed_tokens`` -> ``layers`` (each ``(positions, h, forward_batch, residual) -> (h, residual)``)
    -> final ``norm``; a subclass builds the three.

    Under pipeline parallelism ``stage`` (a ``PipelineStage``) says which layers this process
    runs: a stage after the first starts from ``pp_proxy_tensors`` (the previous stage's hidden
    states and residual), a stage before the last returns them instead of normed hidden states.
    ``stage`` None (models without PP support): the whole model."""

    stage: PipelineStage | None = None

    def forward(self, input_ids, positions, forward_batch,
                pp_proxy_tensors: PPProxyTensors | None = None) -> torch.Tensor | PPProxyTensors:
        if pp_proxy_tensors is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = pp_proxy_tensors.hidden_states, pp_proxy_tensors.residual
        stage = self.stage
        layers = self.layers if stage is None else self.layers[stage.start_layer:stage.end_layer]
        for layer in layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        if stage is not None and not stage.is_last:
            return PPProxyTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaModel(DecoderModel):
    """Builds only this pipeline stage's part (``PipelineStage.current``); the attention layers
    of a stage number from 0, as its KV pool holds only its layers."""

    def __init__(self, config, attention_cls=LlamaAttention):
        super().__init__()
        self.stage = stage = PipelineStage.current(config.num_hidden_layers)
        holds_embedding = stage.is_first or (config.tie_word_embeddings and stage.is_last)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if holds_embedding
                             else PPMissingLayer())
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i - stage.start_layer, attention_cls, rotary_emb)
            if stage.start_layer <= i < stage.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else PPMissingLayer()


class CausalLM(nn.Module):
    """The shell every causal LM shares: ``model`` (hidden states), the LM head (the embedding
    when ``tie_word_embeddings``) registered as ``lm_head_name`` (its checkpoint name), logits."""

    lm_head_name = "lm_head"
    # Checkpoint tensors the model does not use (e.g. a multi-token-prediction head), by name prefix.
    skipped_weight_prefixes: tuple[str, ...] = ()
    # (fused parameter, HF name part, shard id) for the checkpoint tensors loaded into a fused one.
    stacked_params_mapping: tuple = ()

    def __init__(self, config, model: nn.Module):
        super().__init__()
        self.config = config
        self.model = model
        tied = config.tie_word_embeddings
        stage = getattr(model, "stage", None)
        if stage is not None and not stage.is_last:
            head = PPMissingLayer()
        else:
            head = model.embed_tokens if tied else ParallelLMHead(config.vocab_size, config.hidden_size)
        setattr(self, self.lm_head_name, head)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(self, input_ids, positions, forward_batch,
                pp_proxy_tensors: PPProxyTensors | None = None) -> LogitsProcessorOutput | PPProxyTensors:
        """Next-token logits; a pipeline stage before the last returns its ``PPProxyTensors``."""
        if pp_proxy_tensors is None:
            hidden_states = self.model(input_ids, positions, forward_batch)
        else:
            hidden_states = self.model(input_ids, positions, forward_batch, pp_proxy_tensors)
        if isinstance(hidden_states, PPProxyTensors):
            return hidden_states
        return self.logits_processor(hidden_states, getattr(self, self.lm_head_name), forward_batch)

    @classmethod
    def outer_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        """The embedding, final norm and (untied) LM head tensors, full shapes."""
        h = config.hidden_size
        shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
        if not config.tie_word_embeddings:
            shapes[f"{cls.lm_head_name}.weight"] = (config.vocab_size, h)
        return shapes

    def skip_weight(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is left out of loading (it is not the model's)."""
        return name.startswith(self.skipped_weight_prefixes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (each rank keeps its shard), less ``skip_weight`` ones and
        those another pipeline stage holds. Raises ValueError on missing, unexpected or
        mis-shaped names."""
        shapes = self.hf_weight_shapes(self.config)
        kept = ((n, t) for n, t in weights if not self.skip_weight(n))
        stage = getattr(self.model, "stage", None)
        if stage is not None and stage.pp_size > 1:
            tied = self.config.tie_word_embeddings
            shapes = {n: s for n, s in shapes.items() if stage.owns_weight(n, tied, self.lm_head_name)}
            kept = ((n, t) for n, t in kept if stage.owns_weight(n, tied, self.lm_head_name))
        load_named_weights(self, kept, shapes, self.stacked_params_mapping)


def mlp_and_norm_shapes(prefix: str, hidden: int, inter: int, moe: dict | None = None,
                        bias: bool = False) -> dict[str, tuple[int, ...]]:
    """A decoder layer's ``mlp.*`` tensors (the ``moe`` shapes, else a dense gated MLP of ``inter``)
    and its two RMSNorms, at layer ``prefix`` (``model.layers.{i}.``), full shapes."""
    shapes = dict(moe) if moe is not None else gated_mlp_shapes(f"{prefix}mlp.", hidden, inter, bias)
    shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
    shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    return shapes


# (fused parameter, HF projection, shard id): q/k/v into qkv_proj, gate/up into gate_up_proj (the
# expert projections match too: experts.{e}.gate_proj -> experts.{e}.gate_up_proj).
QKV_STACKED_PARAMS = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"))
GATE_UP_STACKED_PARAMS = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


class LlamaForCausalLM(ModelSpec, CausalLM):
    attention_cls = LlamaAttention
    supports_pipeline_parallel = True
    supports_attn_context_parallel = True
    stacked_params_mapping = (*QKV_STACKED_PARAMS, *GATE_UP_STACKED_PARAMS)

    def __init__(self, config):
        super().__init__(config, LlamaModel(config, self.attention_cls))

    @classmethod
    def hf_weight_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of this config holds, full (unsharded) shapes."""
        h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        shapes = cls.outer_weight_shapes(config)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
            for name, shape in attn.items():
                shapes[f"{p}self_attn.{name}.weight"] = shape
                if config.attention_bias:
                    shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
            shapes.update(mlp_and_norm_shapes(p, h, inter, bias=config.mlp_bias))
        return shapes


EntryClass = LlamaForCausalLM
