"""What every model class tells the engine before it is built: its config keys and its cache.

``ModelConfig.from_dict`` asks the architecture's class for ``complete_hf_config`` (required keys,
HF defaults, validation); the model runner asks it for ``kv_pool_layout`` (pool kinds and shapes,
see ``model_executor/kv_pool_spec.py``). A subclass overrides the tables or the methods.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang.srt.model_executor.kv_pool_spec import KVPoolLayout, mha_layout


class ModelSpec:
    # Keys config.json must have, and the defaults HF applies to those it may omit.
    hf_required_keys: tuple[str, ...] = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
    )
    hf_config_defaults: dict = {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
    }
    supported_hidden_acts: tuple[str, ...] = ("silu",)
    # Whether the class builds only its pipeline stage's layers (``--pp-size`` > 1), so a stage's
    # pools are the model's pools over fewer layers (``pipeline_stage_hf_config``).
    supports_pipeline_parallel: bool = False
    # Whether its attention is plain causal MHA/GQA over one KV pool, which --attn-cp-size > 1
    # splits over CP ranks (layers/attention/context_parallel_backend.py).
    supports_attn_context_parallel: bool = False

    @classmethod
    def complete_hf_config(cls, raw: dict, where: str = "config.json") -> dict:
        """``raw`` with HF defaults filled in; ValueError naming a missing key or bad value."""
        missing = [k for k in cls.hf_required_keys if raw.get(k) is None]
        if missing:
            raise ValueError(f"{where} lacks required fields {missing} for {cls.__name__}")
        hf = {**cls.hf_config_defaults, **{k: v for k, v in raw.items() if v is not None or k not in
                                          cls.hf_config_defaults}}
        hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
        if hf.get("head_dim") is None:
            hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        if hf["hidden_act"] not in cls.supported_hidden_acts:
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; supported: {list(cls.supported_hidden_acts)}")
        # rope_parameters (transformers 5) carries rope_theta / rope scaling for new checkpoints
        rope = hf.get("rope_parameters")
        if isinstance(rope, dict):
            if "rope_theta" in rope and "rope_theta" not in raw:
                hf["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default" and hf.get("rope_scaling") is None:
                hf["rope_scaling"] = dict(rope)
        return hf

    @classmethod
    def pipeline_stage_hf_config(cls, hf, start_layer: int, end_layer: int):
        """The config a pipeline stage's pools are laid out from (``kv_pool_layout``): ``hf`` with
        only the layers ``[start_layer, end_layer)`` (``num_hidden_layers`` and, where the model has
        them, ``layer_types``). ValueError saying why when that stage cannot be served."""
        view = {**vars(hf), "num_hidden_layers": end_layer - start_layer}
        if getattr(hf, "layer_types", None) is not None:
            view["layer_types"] = list(hf.layer_types[start_layer:end_layer])
        return SimpleNamespace(**view)

    @classmethod
    def kv_pool_layout(cls, hf, tp_size: int, dtype: torch.dtype) -> KVPoolLayout:
        """K/V of ``num_key_value_heads // tp_size`` heads (at least 1: replicated) per layer."""
        heads = max(1, hf.num_key_value_heads // tp_size)
        return mha_layout(dtype, hf.num_hidden_layers, heads, hf.head_dim)
