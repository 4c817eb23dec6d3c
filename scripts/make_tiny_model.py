"""Write a small HF-format checkpoint directory, deterministically from a seed.

    python scripts/make_tiny_model.py --arch llama --out /tmp/tiny-llama [--seed 0]
    python scripts/make_tiny_model.py --arch qwen3 --out /tmp/bench-qwen3 \\
        --hidden 512 --layers 8 --heads 8 --kv-heads 4 --intermediate 1536 --vocab 4000

Architectures in ``HF_ARCHS`` (DeepSeek, MiMo, Qwen3-Next, ...) are built by HF ``transformers``
(``AutoConfig.for_model`` + ``from_config`` under ``torch.manual_seed(seed)``, then
``save_pretrained``), so their checkpoint format is the real one; they need transformers
installed (the ``test`` extra). The size flags map onto each config's keys; ``HF_ARCHS[arch]``
adds the architecture's own keys.

Writes config.json, generation_config.json, tokenizer.json (byte-level BPE trained here on a
generated corpus, so every string round-trips), tokenizer_config.json (with a ChatML template)
and model.safetensors (or ``--shards N`` files plus model.safetensors.index.json). The weights
are exactly what ``--load-format dummy`` builds from the same config and seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# arch -> (HF architecture, model_type, rope_theta, adds BOS, ties embeddings by default)
ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", 10000.0, True, False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", 1000000.0, False, True),
}
# arch -> (model_type, adds BOS, function(args) -> AutoConfig kwargs of that architecture).
# Each entry is the architecture's tiny shape; the common keys come from hf_common_kwargs.
HF_ARCHS: dict = {}


def _deepseek_kwargs(args) -> dict:
    """Tiny MLA + MoE shape shared by DeepSeek V2/V3: latent 32 + rope 8, 8 routed experts (top 2 of
    2 of 4 groups), one shared expert, layer 0 dense; init std 0.1 so greedy tokens are not near-ties."""
    return {
        "num_key_value_heads": args.heads,  # MLA: every head reads the one latent
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
        "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "initializer_range": 0.1,
    }


HF_ARCHS["deepseek_v2"] = ("deepseek_v2", True, lambda args: {
    **_deepseek_kwargs(args), "q_lora_rank": None, "topk_method": "group_limited_greedy",
})
def _yarn(args) -> dict:
    return {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": max(64, args.max_pos // 4),
            "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


HF_ARCHS["deepseek_v3"] = ("deepseek_v3", True, lambda args: {
    **_deepseek_kwargs(args), "q_lora_rank": 24, "rope_scaling": _yarn(args),
})
# DSA: 8 indexer heads of 32 (fewer heads make exact ReLU-zero score ties likely), top 16 keys, so
# any prompt past 16 tokens attends sparsely.
HF_ARCHS["deepseek_v32"] = ("deepseek_v32", True, lambda args: {
    **_deepseek_kwargs(args), "q_lora_rank": 24, "rope_scaling": _yarn(args),
    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16,
})


def _mimo_v2_flash_kwargs(args) -> dict:
    """Tiny MiMo-V2-Flash: q/k head_dim 1.5x the v head dim (192/128 in the release), full
    attention on every third layer from 0 and a 40-token sliding window (with sinks) on the rest,
    layer 0 dense, 8 routed experts (top 2 of 2 of 4 groups); init std 0.1 against near-ties."""
    v_head_dim = args.hidden // args.heads
    return {
        "head_dim": args.head_dim or v_head_dim * 3 // 2, "v_head_dim": v_head_dim, "sliding_window": 40,
        "layer_types": ["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(args.layers)],
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4,
        "topk_group": 2, "initializer_range": 0.1,
    }


HF_ARCHS["mimo_v2_flash"] = ("mimo_v2_flash", False, _mimo_v2_flash_kwargs)


def _deepseek_v4_kwargs(args) -> dict:
    """Tiny DeepSeek-V4: layers cycle CSA (blocks of 4, indexer of 8 heads keeping the top 4) /
    HCA (blocks of 16) / sliding only, a 16-token window, 4 mHC streams, 4 routed experts (top 2),
    the first half of the layers hash-routed; init std 0.15 against near-ties."""
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
    return {
        "num_key_value_heads": 1, "head_dim": args.head_dim or 32, "intermediate_size": args.intermediate or 32,
        "q_lora_rank": 32,
        "partial_rotary_factor": 0.5, "layer_types": [kinds[i % 3] for i in range(args.layers)],
        "mlp_layer_types": ["hash_moe" if i < (args.layers + 1) // 2 else "moe" for i in range(args.layers)],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "sliding_window": 16, "hc_mult": 4, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 8,
        "index_head_dim": 16, "index_topk": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "initializer_range": 0.15,
    }


HF_ARCHS["deepseek_v4"] = ("deepseek_v4", True, _deepseek_v4_kwargs)


def _qwen3_next_kwargs(args) -> dict:
    """Tiny Qwen3-Next: full attention on every second layer (linear attention on the others), Gated
    DeltaNet with 2 key / 4 value heads of 16, conv kernel 4, 4 experts (top 2) plus a shared
    expert; init std 0.1 against near-ties."""
    return {
        "head_dim": args.head_dim or args.hidden // args.heads, "full_attention_interval": 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "initializer_range": 0.1,
    }


HF_ARCHS["qwen3_next"] = ("qwen3_next", False, _qwen3_next_kwargs)


def hf_common_kwargs(args, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate or 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": args.max_pos,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "tie_word_embeddings": bool(args.tie),
    }


def write_hf_model(args, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    """Build the model with transformers, save it; returns the written config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, arch_kwargs = HF_ARCHS[args.arch]
    kwargs = {**hf_common_kwargs(args, vocab_size, bos_id, eos_id), **arch_kwargs(args)}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    with open(os.path.join(args.out, "config.json")) as f:
        return json.load(f)


_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part cache memory page token layer model host device storage prefix tree request"
).split()


def corpus(seed: int, lines: int = 4000):
    """Deterministic pseudo-English: common words, invented words, numbers, punctuation, code."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    invented = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(1500)]
    for i in range(lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(invented) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10**rng.randint(1, 6))))
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":", ";"])
        if i % 10 == 0:
            line = f"def {rng.choice(invented)}(x, y):\n    return x + {rng.randint(0, 99)} * y  # {rng.choice(_WORDS)}"
        yield line


def build_tokenizer(vocab_size: int, seed: int, add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer)
    if add_bos:
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
        )
    return tok


def hf_config(args, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    architecture, model_type, rope_theta, _, tie_default = ARCHS[args.arch]
    head_dim = args.head_dim or args.hidden // args.heads
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate or 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": args.max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": args.attention_bias,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_default if args.tie is None else args.tie,
        "torch_dtype": args.dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def write_weights(out: str, config: dict, seed: int, dtype: str, shards: int) -> None:
    import torch
    from safetensors.torch import save_file

    from sglang.srt.model_executor.model_config import ModelConfig
    from sglang.srt.model_executor.weight_utils import dummy_weights_iterator
    from sglang.srt.model_executor.model_registry import get_model_class

    mc = ModelConfig.from_dict(config, out)
    shapes = get_model_class(mc.architecture).hf_weight_shapes(mc.hf_config)
    tensors = {n: t.to(getattr(torch, dtype)).contiguous() for n, t in dummy_weights_iterator(shapes, seed)}
    if shards == 1:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=sorted([*ARCHS, *HF_ARCHS]))
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
    p.add_argument("--intermediate", type=int, default=None, help="default 2 * hidden")
    p.add_argument("--vocab", type=int, default=1000, help="BPE vocabulary size to train (incl. specials)")
    p.add_argument("--max-pos", type=int, default=8192, help="max_position_embeddings")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None, help="tie_word_embeddings")
    p.add_argument("--attention-bias", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shards", type=int, default=1, help="split weights over N safetensors files + index")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads or args.hidden % args.heads and args.head_dim is None:
        p.error("--heads must be a multiple of --kv-heads, and --hidden of --heads unless --head-dim is given")
    if args.vocab < 300 or args.shards < 1:
        p.error("--vocab must be >= 300 (256 bytes + specials + merges) and --shards >= 1")
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    add_bos = HF_ARCHS[args.arch][1] if args.arch in HF_ARCHS else ARCHS[args.arch][3]
    tok = build_tokenizer(args.vocab, args.seed, add_bos=add_bos)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    bos_id, eos_id = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if args.arch in HF_ARCHS:
        config = write_hf_model(args, vocab_size, bos_id, eos_id)
    else:
        config = hf_config(args, vocab_size, bos_id, eos_id)
    files = {
        "generation_config.json": {"bos_token_id": bos_id, "eos_token_id": [eos_id, tok.token_to_id("<|im_end|>")]},
        "tokenizer_config.json": {
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
            "add_bos_token": add_bos,
            "model_max_length": args.max_pos,
            "chat_template": CHAT_TEMPLATE,
        },
    }
    if args.arch not in HF_ARCHS:
        files["config.json"] = config
    for name, content in files.items():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(content, f, indent=2)
    if args.arch not in HF_ARCHS:
        write_weights(args.out, config, args.seed, args.dtype, args.shards)
    print(f"wrote {args.arch} model ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}) to {args.out}")
    return args.out


if __name__ == "__main__":
    main()
