"""Llama / Qwen3 from HF-format directories: checkpoints written by make_tiny_model load
(single file and sharded index), match dummy init with the same seed and an independent dense
float64 implementation; bad directories and configs fail with clear errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.model_executor.model_config import ModelConfig
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT, Driver, make_tiny_model

register_cpu_ci(est_time=15, suite="per-commit-cpu")

PROMPT = [5, 17, 260, 3, 99, 42, 7, 311, 8, 8, 150]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_tiny_model(str(root / "llama"), "llama", "--attention-bias", "--seed", "3"),
        "qwen3": make_tiny_model(str(root / "qwen3"), "qwen3", "--kv-heads", "1", "--seed", "4"),
        "llama_sharded": make_tiny_model(str(root / "sharded"), "llama", "--attention-bias", "--seed", "3", "--shards", "3"),
    }


def runner(path, **kw):
    return ModelRunner(ModelRunnerConfig(path, max_total_tokens=256, max_running_requests=4, **kw))


def step_logits(r, prompt, forced):
    """Logits after the prompt, then after each forced token (prefill + decodes)."""
    d = Driver(r)
    req = d.new_req(prompt)
    rows = [d.extend([req], [len(prompt)]).next_token_logits[0]]
    for t in forced:
        req.token_ids.append(t)
        rows.append(d.decode([req]).next_token_logits[0])
    d.release(req)
    return torch.stack(rows)


def rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.arange(x.shape[0], dtype=torch.float64).unsqueeze(1) * inv
    emb = torch.cat([freqs, freqs], -1)
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos().unsqueeze(1) + torch.cat([-x2, x1], -1) * emb.sin().unsqueeze(1)


def reference_logits(path, ids):
    """Dense causal forward in float64 straight from the HF tensors and config."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    w = {k: v.double() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    lin = lambda x, name: x @ w[name + ".weight"].T + w.get(name + ".bias", 0)  # noqa: E731
    h, kvh, d, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    n = len(ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, w[p + "input_layernorm.weight"], eps)
        q = lin(y, p + "self_attn.q_proj").view(n, h, d)
        k = lin(y, p + "self_attn.k_proj").view(n, kvh, d)
        v = lin(y, p + "self_attn.v_proj").view(n, kvh, d)
        if p + "self_attn.q_norm.weight" in w:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"], eps), rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"]).repeat_interleave(h // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", attn, v.repeat_interleave(h // kvh, 1)).reshape(n, h * d)
        x = x + lin(o, p + "self_attn.o_proj")
        y = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + lin(torch.nn.functional.silu(lin(y, p + "mlp.gate_proj")) * lin(y, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_checkpoint_matches_dense_reference(models, arch):
    forced = [4, 200, 31]
    got = step_logits(runner(models[arch]), PROMPT, forced)
    want = reference_logits(models[arch], PROMPT + forced)[len(PROMPT) - 1 :]
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)


def test_checkpoint_equals_dummy_with_same_seed_and_sharded_index(models):
    forced = [9, 10]
    from_file = step_logits(runner(models["llama"]), PROMPT, forced)
    assert torch.equal(from_file, step_logits(runner(models["llama"], load_format="dummy", seed=3), PROMPT, forced))
    assert torch.equal(from_file, step_logits(runner(models["llama_sharded"]), PROMPT, forced))
    assert not torch.equal(from_file, step_logits(runner(models["llama"], load_format="dummy", seed=4), PROMPT, forced))


def test_make_tiny_model_cli_is_deterministic(models, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "make_tiny_model.py"), "--arch", "qwen3",
           "--out", str(out), "--kv-heads", "1", "--seed", "4"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (out / name).read_bytes() == open(os.path.join(models["qwen3"], name), "rb").read(), name


def test_unknown_architecture_lists_known(models, tmp_path):
    cfg = json.load(open(os.path.join(models["llama"], "config.json")))
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['MambaForCausalLM'\].*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_missing_directory_and_config_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="nope.*is not a directory"):
        ModelConfig.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_bad_checkpoints_are_rejected(models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(models["llama"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.extra.weight"] = torch.zeros(1)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.1.mlp.up_proj.weight'\].*unexpected weights"):
        runner(str(bad))
    tensors = load_file(os.path.join(models["llama"], "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(3,\)"):
        runner(str(bad))
    os.remove(bad / "model.safetensors")
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        runner(str(bad))
    assert runner(str(bad), load_format="dummy").model is not None
    with pytest.raises(ValueError, match=r"unknown load_format 'pt'.*dummy"):
        ModelRunnerConfig(str(bad), load_format="pt")
