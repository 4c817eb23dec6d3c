"""DeepSeek-V2 / V3 (MLA on the MLA pool + MoE) against HF transformers on tiny checkpoints that
transformers itself wrote (make_tiny_model --arch deepseek_v2 / deepseek_v3).

V2: q_lora_rank null, softmax router with group_limited_greedy, interleaved rope. V3: q LoRA,
sigmoid router with a (randomized, so it changes routing) e_score_correction_bias, normalized
top-k weights, routed_scaling_factor 2.5, YaRN rope with mscale != mscale_all_dim (so both the
cos/sin attention factor and the softmax mscale^2 are in play). Both: layer 0 dense
(first_k_dense_replace=1), layer 1 MoE with 8 routed experts and one shared expert.

Tolerance (fp32, CPU): every prefill / decode step's logits within LOGIT_TOL * max(1, max |logit|)
of HF's (measured: about 1e-6 absolute on logits of magnitude ~3; the absorbed MLA form sums in
another order than HF's expanded form); greedy tokens identical to HF ``generate``. Within our
engine (batching, chunked prefill, cached prefix, page size) outputs are bitwise identical.
"""

import math
import os

import pytest
import torch
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.memory_pool.mla import MLATokenToKVPool
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test import hf_reference as hf_ref
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import Driver, make_tiny_model, run_tp_workers

transformers = pytest.importorskip("transformers")

register_cpu_ci(est_time=20, suite="per-commit-cpu")

LOGIT_TOL = 1e-5
NEW_TOKENS = 8
_g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(5, 990, (n,), generator=_g).tolist() for n in (5, 131, 300)]  # 300: 3 key blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    v2 = make_tiny_model(str(root / "v2"), "deepseek_v2")
    v3 = make_tiny_model(str(root / "v3"), "deepseek_v3")
    hf_ref.randomize_zero_inits(v3, {"e_score_correction_bias": 0.05})  # HF's zeros would not change the choice
    return {"deepseek_v2": v2, "deepseek_v3": v3}


@pytest.fixture(scope="module")
def hf_models(models):
    return {arch: hf_ref.load_hf(path) for arch, path in models.items()}


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_logits_and_greedy_match_hf(models, hf_models, arch):
    runner = hf_ref.make_runner(models[arch])
    assert isinstance(runner.token_to_kv_pool, MLATokenToKVPool)
    for prompt in PROMPTS:
        want_tokens, want_logits = hf_ref.hf_greedy(hf_models[arch], prompt, NEW_TOKENS)
        tokens, logits = hf_ref.greedy_steps(runner, prompt, NEW_TOKENS)
        assert tokens == want_tokens, (len(prompt), tokens, want_tokens)
        for step, (got, want) in enumerate(zip(logits, want_logits)):
            diff = (got - want).abs().max().item()
            tol = LOGIT_TOL * max(1.0, want.abs().max().item())
            assert diff <= tol, f"{arch} prompt {len(prompt)} step {step}: logit diff {diff} > {tol}"
    assert len(set(tokens)) > 2  # not a degenerate repetition


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_batched_chunked_cached_and_page_size_are_bitwise_equal(models, arch):
    ref = Driver(hf_ref.make_runner(models[arch], page_size=1)).generate(PROMPTS, NEW_TOKENS, batch=False)
    runner = hf_ref.make_runner(models[arch], page_size=4)
    driver = Driver(runner)
    assert driver.generate(PROMPTS, NEW_TOKENS, batch=True, chunk=64) == ref
    # A request whose first 128 tokens reuse another's KV (a prefix-cache hit).
    donor = driver.new_req(PROMPTS[2])
    driver.extend([donor], [len(PROMPTS[2])])
    hit = driver.generate([PROMPTS[2]], NEW_TOKENS, reuse=[(donor, 128)])
    assert hit == [ref[2]]


def test_yarn_rope_matches_hf():
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
               "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    cfg = transformers.AutoConfig.for_model("deepseek_v3", qk_rope_head_dim=64, max_position_embeddings=163840,
                                            rope_parameters=scaling)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert attention_factor != 1.0
    ours = RotaryEmbedding(64, 4096, 10000.0, scaling)
    positions = torch.arange(4096, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None]
    torch.testing.assert_close(ours.cos_cache, freqs.cos() * attention_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin_cache, freqs.sin() * attention_factor, rtol=0, atol=1e-6)
    default = RotaryEmbedding(64, 4096, 10000.0, None)
    assert (ours.cos_cache - default.cos_cache).abs().max() > 0.1  # the scaling really changed the table


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_router_matches_hf(arch):
    """Our router's choice and weights equal HF's on many tokens, for the grouped top-k of each version."""
    from sglang.srt.layers.moe import TopKRouter

    if arch == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter as HFRouter,
        )
        kw = {"topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5}
        ours_kw = {"scoring_func": "softmax", "topk_method": "group_limited_greedy"}
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as HFRouter,
        )
        kw = {"norm_topk_prob": True, "routed_scaling_factor": 2.5}
        ours_kw = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                   "correction_bias": True}
    cfg = transformers.AutoConfig.for_model(arch, hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                            n_group=4, topk_group=2, **kw)
    gen = torch.Generator().manual_seed(3)
    hf = HFRouter(cfg)
    ours = TopKRouter(32, 16, 3, n_group=4, topk_group=2, routed_scaling_factor=kw["routed_scaling_factor"],
                      **ours_kw)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32, generator=gen))
        ours.weight.copy_(hf.weight)
        if arch == "deepseek_v3":
            hf.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(300, 32, generator=gen)
    _, want_w, want_ids = hf(x)
    got_w, got_ids = ours(x)
    want = [dict(zip(i.tolist(), w.tolist())) for i, w in zip(want_ids, want_w)]
    got = [dict(zip(i.tolist(), w.tolist())) for i, w in zip(got_ids, got_w)]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        assert all(math.isclose(g[e], w[e], rel_tol=1e-6, abs_tol=1e-7) for e in g)
    # The groups matter: plain top-k would pick experts outside the best groups for some tokens.
    plain = torch.topk(x @ hf.weight.T, k=3, dim=-1).indices
    assert any(set(p.tolist()) != set(w) for p, w in zip(plain, want))


def test_kv_pool_layout_is_mla_replicated_over_tp(models):
    mc = ModelConfig.from_pretrained(models["deepseek_v3"])
    for tp in (1, 2, 4):
        layout = mc.kv_pool_layout(tp)
        assert layout.anchor.kind is PoolKind.MLA and not layout.sidecars and layout.state is None
        assert layout.anchor.args["kv_lora_rank"] == 32 and layout.anchor.args["qk_rope_head_dim"] == 8
        assert layout.bytes_per_token(4) == 2 * (32 + 8) * 4  # 2 layers, fp32, same at every TP size


def test_bad_configs_name_the_key(models):
    import json

    from sglang.srt.layers.moe import TopKRouter

    with open(os.path.join(models["deepseek_v2"], "config.json")) as f:
        raw = json.load(f)
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        bad = {k: v for k, v in raw.items() if k != key}
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_dict(bad, "m")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": None}, "m")
    with pytest.raises(ValueError, match="rope_scaling type 'ntk_magic'"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"type": "ntk_magic", "factor": 2.0}}, "m")
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "m")
    with pytest.raises(ValueError, match="scoring_func 'relu'"):
        TopKRouter(8, 8, 2, scoring_func="relu")
    with pytest.raises(ValueError, match="n_group"):
        TopKRouter(8, 8, 2, topk_method="group_limited_greedy", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_dict({**raw, "mlp_bias": True}, "m")
    dense = {**raw, "n_routed_experts": None, "num_experts_per_tok": None}
    mc = ModelConfig.from_dict(dense, "m")  # no experts: every layer dense, top-k not needed
    assert mc.hf_config.n_routed_experts is None and mc.hf_config.q_lora_rank is None


@pytest.mark.parametrize("scoring_func, topk_method", [("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc")])
def test_moe_rows_do_not_depend_on_the_batch(scoring_func, topk_method):
    """Each token's router choice, weights and MoE output are bitwise the same alone or among others
    (a flat sigmoid kernel rounds its tail elements differently: the router pads its rows)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe import DeepseekMoE

    cfg = SimpleNamespace(hidden_size=64, n_routed_experts=8, num_experts_per_tok=2, scoring_func=scoring_func,
                          topk_method=topk_method, n_group=4, topk_group=2, norm_topk_prob=True,
                          routed_scaling_factor=2.5, moe_intermediate_size=32, n_shared_experts=1)
    moe = DeepseekMoE(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        x = torch.randn(37, 64, generator=gen)
        whole_w, whole_ids = moe.gate(x)
        whole = moe(x)
        for i in range(x.shape[0]):
            w, ids = moe.gate(x[i : i + 1])
            assert torch.equal(ids[0], whole_ids[i]) and torch.equal(w[0], whole_w[i]), i
            assert torch.equal(moe(x[i : i + 1])[0], whole[i]), i


def test_tp2_matches_tp1(models, tmp_path):
    """TP=2 over gloo (heads, experts' intermediate dims sharded; latent and indexer replicated):
    the same greedy tokens as TP=1, logits and logprobs within 1e-4 (all-reduce order). V3.2 too."""
    paths = [models["deepseek_v2"], models["deepseek_v3"], make_tiny_model(str(tmp_path / "v32"), "deepseek_v32")]
    prompts = PROMPTS[1:]
    tp2 = run_tp_workers(paths, prompts, 4, str(tmp_path / "tp2.json"))
    for path in paths:
        driver = Driver(ModelRunner(ModelRunnerConfig(path, max_total_tokens=4096, max_running_requests=8)))
        reqs = [driver.new_req(p) for p in prompts]
        logits = driver.extend(reqs, [len(p) for p in prompts]).next_token_logits
        for r in reqs:
            driver.release(r)
        torch.testing.assert_close(torch.tensor(tp2[path]["logits"]), logits, atol=1e-4, rtol=1e-4)
        for got, want in zip(tp2[path]["outputs"], driver.generate(prompts, 4)):
            assert [t for t, _ in got] == [t for t, _ in want], path
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4
