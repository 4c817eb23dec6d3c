"""DeepSeek-V4 on the logical-anchor + state pools against HF transformers, on a tiny checkpoint
transformers itself wrote (make_tiny_model --arch deepseek_v4, 4 layers: CSA / HCA / sliding / CSA).

The tiny model: CSA blocks of 4 with an indexer of 8 heads keeping the top 4 entries, HCA blocks of
16, a 16-token sliding window, 4 mHC streams, 2 hash-routed then 2 top-k MoE layers. HF initializes
``ape`` (position_bias), the attention sinks, the mHC bases, the router correction bias and the
``tid2eid`` hash table to zeros; they are randomized here so every one of them changes the output.
Prompts of 150-300 tokens close dozens of CSA blocks, many HCA blocks and cross the window; the
indexer is selective (top 4 of up to 75 blocks).

Tolerance (fp32, CPU): every prefill position's and decode step's logits within
LOGIT_TOL * max(1, max |logit|) of HF's (measured ~2e-6 relative); greedy tokens identical to HF
``generate``. Within our engine (chunked prefill, batching, a cached prefix ending inside a block,
page size) outputs are bitwise identical on CPU.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.memory_pool.dsv4 import DeepSeekV4StatePool, LogicalAnchorPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.srt.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4RowLayout
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import Driver, make_tiny_model
from sglang.test.hf_reference import (
    DSV4_ZERO_INITS,
    hf_greedy,
    load_hf,
    randomize_zero_inits,
)
from sglang.test.hf_reference import make_runner as _make_runner

transformers = pytest.importorskip("transformers")

register_cpu_ci(est_time=15, suite="per-commit-cpu")

LOGIT_TOL = 2e-5
NEW_TOKENS = 8
_g = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(5, 990, (n,), generator=_g).tolist() for n in (7, 150, 301)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("v4") / "v4"), "deepseek_v4", "--layers", "4")
    randomize_zero_inits(path, DSV4_ZERO_INITS)  # so every one of them changes the output
    return path


@pytest.fixture(scope="module")
def hf(model_path):
    return load_hf(model_path)


def make_runner(path, page_size=1, **kw):
    return _make_runner(path, page_size, **kw)


def assert_close(ours, ref, what):
    scale = max(1.0, ref.abs().max().item())
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= LOGIT_TOL * scale, f"{what}: max |logit diff| {diff:.3g} > {LOGIT_TOL} * {scale:.3g}"


def all_position_logits(runner, req, new_ids):
    """Logits of every new token of one extend (the LM head on all rows, not just the last)."""
    prefix = len(req.kv_slots)
    slots = runner.token_to_kv_pool_allocator.alloc(len(new_ids))
    req.kv_slots += slots.tolist()
    req.owned_slots += slots.tolist()
    batch = ForwardBatch.init_extend(runner, [req.req_idx], [prefix], [new_ids], slots)
    with torch.no_grad():
        hidden = runner.model.model(batch.input_ids, batch.positions, batch)
        return hidden @ runner.model.head.weight.t()


def test_pool_layout_holds_the_v4_state(model_path):
    mc = ModelConfig.from_pretrained(model_path)
    hf_cfg = mc.hf_config
    assert hf_cfg.layer_types == [CSA, HCA, SLIDING, CSA]
    layout = mc.kv_pool_layout(1)
    assert layout.anchor.kind is PoolKind.DSV4_ANCHOR and [s.kind for s in layout.sidecars] == [PoolKind.DSV4_STATE]
    rows = DeepseekV4RowLayout(hf_cfg.head_dim, hf_cfg.index_head_dim)
    d, c = hf_cfg.head_dim, hf_cfg.index_head_dim
    # swa row + raw kv/gate (2 series) + entry; indexer raw kv/gate (2 series) + key
    assert rows.width(CSA) == d + 4 * d + d + 4 * c + c
    assert rows.width(HCA) == d + 2 * d + d and rows.width(SLIDING) == d
    assert layout.sidecars[0].args["row_dim"] == rows.width(CSA)
    r = make_runner(model_path, max_total_tokens=64)
    assert isinstance(r.token_to_kv_pool, LogicalAnchorPool) and r.token_to_kv_pool.get_size_per_token() == 0
    state = r.side_pools[PoolKind.DSV4_STATE]
    assert isinstance(state, DeepSeekV4StatePool) and state.get_state_buffer(3).shape[1] == rows.width(CSA)


def test_prefill_and_chunked_decode_logits_match_hf(model_path, hf):
    runner = make_runner(model_path)
    prompt = PROMPTS[2]
    tokens, hf_steps = hf_greedy(hf, prompt, NEW_TOKENS)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0]
    driver = Driver(runner)
    # whole prompt in one prefill: every position
    req = driver.new_req(prompt)
    assert_close(all_position_logits(runner, req, prompt), ref[: len(prompt)], "prefill")
    driver.release(req)
    # chunks that end inside CSA and HCA blocks and inside the window, then decode HF's tokens
    req = driver.new_req(prompt)
    start = 0
    for size in (37, 1, 64, 50, len(prompt) - 152):
        got = all_position_logits(runner, req, prompt[start : start + size])
        assert_close(got, ref[start : start + size], f"chunk at {start}")
        start += size
    assert start == len(prompt)
    req.token_ids = prompt + tokens
    for step, token in enumerate(tokens[:-1]):
        got = all_position_logits(runner, req, [token])
        assert_close(got[0], hf_steps[step + 1], f"decode step {step + 1}")
    driver.release(req)


def test_greedy_matches_hf_generate_and_is_invariant(model_path, hf):
    want = [hf_greedy(hf, p, NEW_TOKENS)[0] for p in PROMPTS]
    reference = Driver(make_runner(model_path)).generate(PROMPTS, NEW_TOKENS, batch=False)
    assert [[t for t, _ in out] for out in reference] == want
    assert len({t for out in want for t in out}) > 4, "degenerate generation"
    for page_size, chunk in ((1, 23), (4, None), (16, 40)):
        driver = Driver(make_runner(model_path, page_size))
        assert driver.generate(PROMPTS, NEW_TOKENS, batch=True, chunk=chunk) == reference
    # cached prefixes that end inside an HCA block (150 = 9 * 16 + 6) and inside a CSA block (61)
    driver = Driver(make_runner(model_path))
    donors = []
    for prompt, n in zip(PROMPTS, (0, 61, 150)):
        donor = driver.new_req(prompt[: max(n, 1)])
        driver.extend([donor], [len(donor.token_ids)])
        donors.append((donor, n) if n else None)
    assert driver.generate(PROMPTS, NEW_TOKENS, reuse=donors) == reference


def test_yarn_compress_rope_matches_hf(model_path, tmp_path):
    """Release configs put YaRN on the compress rope (CSA / HCA layers, compressors, indexer): the
    same weights with a YaRN compress table (factor 4 from 64 positions; nested, so HF derives the
    mscale attention factor) match HF past the original length."""
    path = tmp_path / "yarn"
    shutil.copytree(model_path, path)
    with open(path / "config.json") as f:
        raw = json.load(f)
    raw["rope_parameters"]["compress"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                              beta_fast=32, beta_slow=1)
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)
    hf_yarn = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    assert hf_yarn.model.rotary_emb.compress_attention_scaling != 1.0
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = hf_yarn(torch.tensor([prompt])).logits[0]
    runner = make_runner(str(path))
    req = Driver(runner).new_req(prompt)
    assert_close(all_position_logits(runner, req, prompt), ref, "yarn prefill")


def test_release_weight_names_load(model_path, tmp_path):
    """DeepSeek's release layout (no ``model.`` prefix, ``embed.weight``, ``hc_head_fn``, an
    ``mtp.*`` block) loads into the same model as transformers' layout."""
    path = tmp_path / "release"
    shutil.copytree(model_path, path)
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
                "hc_head.hc_scale": "hc_head_scale"}.get(name, name)
        renamed[name] = tensor
    renamed["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    assert "layers.0.attn.wq_a.weight" in renamed and "embed.weight" in renamed
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompt = PROMPTS[1]
    logits = []
    for p in (model_path, str(path)):
        runner = make_runner(p, max_total_tokens=512)
        logits.append(all_position_logits(runner, Driver(runner).new_req(prompt), prompt))
    assert torch.equal(logits[0], logits[1])


def test_dummy_load_format_runs(model_path):
    """``--load-format dummy`` (no safetensors read) builds valid hash tables and generates."""
    runner = make_runner(model_path, load_format="dummy", max_total_tokens=256)
    out = Driver(runner).generate([PROMPTS[1][:40]], 3)
    assert len(out[0]) == 3 and all(-20 < lp <= 0 for _, lp in out[0])


def test_config_errors(model_path):
    mc = ModelConfig.from_pretrained(model_path)
    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    cases = [
        ({"num_key_value_heads": 2}, r"num_key_value_heads=2 is not supported; must be 1"),
        ({"layer_types": ["full_attention"] * 4}, r"layer_types entries \['full_attention'"),
        ({"layer_types": [CSA]}, r"len\(layer_types\) is 1, num_hidden_layers is 4"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                              "compress": {"rope_type": "longrope", "factor": 16}}},
         r"rope_type 'longrope' is not supported for DeepseekV4ForCausalLM; supported: \['default', 'yarn'\]"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                              "compress": {"rope_type": "yarn", "factor": 16}}}, r"lacks original_max_position"),
        ({"compress_rates": {CSA: 0, HCA: 16}}, r"compress_rates\['compressed_sparse_attention'\] is 0"),
        ({"o_groups": 3}, r"o_groups=3 is not supported; must be a divisor of"),
        ({"index_topk": None}, r"lacks required fields \['index_topk'\]"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict({**raw, **change}, model_path)
    assert mc.hf_config.qk_rope_head_dim == 16
