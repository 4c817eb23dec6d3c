"""DeepSeek-V4's config keys and the layout of its cached state rows (``models/deepseek_v4.py``
is the model): HF defaults, validation naming the bad key, the rope tables, and where each cached
quantity sits in a layer's ``DeepSeekV4StatePool`` row."""

from __future__ import annotations

from dataclasses import dataclass

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


# ----------------------------------------------------------------------------- config and cache rows


def _default_layer_types(n: int) -> list[str]:
    """HF's default schedule: two HCA layers, then CSA / HCA interleaved."""
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def complete_v4_config(raw: dict, where: str) -> dict:
    """``raw`` with HF's V4 defaults (``DeepseekV4Config.__post_init__``) filled in; ValueError
    naming a missing or bad key."""
    required = ("hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "head_dim", "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "o_groups", "o_lora_rank",
                "index_n_heads", "index_head_dim", "index_topk", "sliding_window")
    missing = [k for k in required if raw.get(k) is None]
    if missing:
        raise ValueError(f"{where} lacks required fields {missing} for DeepseekV4ForCausalLM")
    defaults = {
        "num_key_value_heads": 1, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": False, "max_position_embeddings": 1048576, "rope_parameters": None,
    }
    hf = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    n = hf["num_hidden_layers"]
    rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    hf["compress_rates"] = rates
    layer_types = raw.get("layer_types")
    if layer_types is None and raw.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
        layer_types = [by_ratio.get(r, f"compress_ratio={r}") for r in raw["compress_ratios"]]
    hf["layer_types"] = list(layer_types if layer_types is not None else _default_layer_types(n))[:n]
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = raw.get("num_hash_layers", 3)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    hf["mlp_layer_types"] = list(mlp_types)[:n]
    if hf.get("partial_rotary_factor") is None:
        qk_rope = raw.get("qk_rope_head_dim")
        hf["partial_rotary_factor"] = qk_rope / hf["head_dim"] if qk_rope is not None else 64 / 512
    hf["qk_rope_head_dim"] = int(hf["head_dim"] * hf["partial_rotary_factor"])
    hf["v4_rope"] = _rope_tables(hf, where)
    _validate_v4(hf, where)
    return hf


def _rope_tables(hf: dict, where: str) -> dict[str, dict]:
    """The ``main`` (sliding layers) and ``compress`` (CSA / HCA layers, compressors, indexer) rope
    parameters, as ``DeepseekV4Config.__post_init__`` and HF's rope init resolve them: a flat
    ``rope_parameters`` is the compress rope's scaling (YaRN there gets ``attention_factor`` 1.0) and
    the main rope is plain; ``truncate`` is read from the top level."""
    rope = hf["rope_parameters"] or hf.get("rope_scaling") or {}  # legacy configs ship ``rope_scaling``
    nested = isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict)
    flat = {k: v for k, v in rope.items() if k not in ("main", "compress")}
    tables = {}
    for label, theta_key in (("main", "rope_theta"), ("compress", "compress_rope_theta")):
        params = dict(rope[label]) if nested else (dict(flat) if label == "compress" else {})
        params.setdefault("rope_theta", hf[theta_key])
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"{where}: rope_parameters[{label!r}] rope_type {rope_type!r} is not supported for "
                             "DeepseekV4ForCausalLM; supported: ['default', 'yarn']")
        if rope_type == "yarn":
            if params.get("original_max_position_embeddings") is None:
                raise ValueError(f"{where}: rope_parameters[{label!r}] (yarn) lacks original_max_position_embeddings")
            if not nested:
                params.setdefault("attention_factor", 1.0)
            params["truncate"] = rope.get("truncate", True)
        params["rope_type"] = rope_type
        tables[label] = params
    return tables


def _validate_v4(hf: dict, where: str) -> None:
    n = hf["num_hidden_layers"]
    for key, types, allowed in (("layer_types", hf["layer_types"], LAYER_TYPES),
                                ("mlp_layer_types", hf["mlp_layer_types"], MLP_LAYER_TYPES)):
        if len(types) != n:
            raise ValueError(f"{where}: len({key}) is {len(types)}, num_hidden_layers is {n}")
        bad = [t for t in types if t not in allowed]
        if bad:
            raise ValueError(f"{where}: {key} entries {bad} are not supported; allowed: {list(allowed)}")
    for kind in {t for t in hf["layer_types"] if t != SLIDING}:
        rate = hf["compress_rates"].get(kind)
        if not isinstance(rate, int) or rate < 1:
            raise ValueError(f"{where}: compress_rates[{kind!r}] is {rate!r}; must be an int >= 1")
    checks = [
        ("num_key_value_heads", hf["num_key_value_heads"] == 1, "1 (V4 attention is shared-KV MQA)"),
        ("hidden_act", hf["hidden_act"] == "silu", "'silu'"),
        ("scoring_func", hf["scoring_func"] in SCORING_FUNCS, f"one of {list(SCORING_FUNCS)}"),
        ("qk_rope_head_dim", hf["qk_rope_head_dim"] % 2 == 0 and
         0 < hf["qk_rope_head_dim"] <= min(hf["head_dim"], hf["index_head_dim"]),
         f"even and in (0, min(head_dim, index_head_dim)={min(hf['head_dim'], hf['index_head_dim'])}]"),
        ("o_groups", (hf["num_attention_heads"] * hf["head_dim"]) % hf["o_groups"] == 0,
         f"a divisor of num_attention_heads * head_dim = {hf['num_attention_heads'] * hf['head_dim']}"),
        ("num_experts_per_tok", 1 <= hf["num_experts_per_tok"] <= hf["n_routed_experts"],
         f"in [1, n_routed_experts={hf['n_routed_experts']}]"),
        ("sliding_window", hf["sliding_window"] >= 1, ">= 1"),
        ("index_topk", hf["index_topk"] >= 1, ">= 1"),
        ("hc_mult", hf["hc_mult"] >= 1, ">= 1"),
    ]
    for key, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{where}: {key}={hf[key]!r} is not supported; must be {allowed}")


@dataclass(frozen=True)
class DeepseekV4RowLayout:
    """Where each cached quantity sits in a layer's state row (``DeepSeekV4StatePool``, one row of
    ``row_dim`` values per anchor slot per layer). Offsets are (start, width).

    Every layer: ``swa`` = the token's sliding-window KV (normed, RoPE'd). CSA/HCA layers add the
    token's raw compressor ``kv`` / ``gate`` projections (``coeff * head_dim`` each, coeff 2 for CSA's
    two overlapping series, 1 for HCA) and ``comp`` = the compressed entry of the block the token
    closes (written at a block's last token only). CSA adds the indexer's raw ``idx_kv`` /
    ``idx_gate`` (``2 * index_head_dim``) and ``idx_comp`` (its compressed key)."""

    head_dim: int
    index_head_dim: int

    def fields(self, layer_type: str) -> dict[str, tuple[int, int]]:
        d, c = self.head_dim, self.index_head_dim
        widths = [("swa", d)]
        if layer_type == HCA:
            widths += [("kv", d), ("gate", d), ("comp", d)]
        elif layer_type == CSA:
            widths += [("kv", 2 * d), ("gate", 2 * d), ("comp", d), ("idx_kv", 2 * c), ("idx_gate", 2 * c),
                       ("idx_comp", c)]
        out, start = {}, 0
        for name, width in widths:
            out[name] = (start, width)
            start += width
        return out

    def width(self, layer_type: str) -> int:
        return sum(w for _, w in self.fields(layer_type).values())

    def row_dim(self, layer_types) -> int:
        """One row width for every layer (the pool has one): the widest layer type present."""
        return max(self.width(t) for t in layer_types)
