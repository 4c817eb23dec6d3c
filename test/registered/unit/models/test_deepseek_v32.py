"""DeepSeek-V3.2 (MLA + DSA lightning indexer, top-k sparse attention) against HF transformers on a
tiny checkpoint transformers wrote (make_tiny_model --arch deepseek_v32: 8 indexer heads, top 16
keys, YaRN, noaux_tc MoE with a randomized correction bias).

Prompts run to 300 tokens, so most rows attend 16 of up to 300 keys. Checked: the indexer picks
the same keys as HF's for every prefill and decode row; prefill and decode logits within
LOGIT_TOL * max(1, max |logit|) of HF's (fp32); greedy tokens identical to HF ``generate``; the
choice matters (attending every key instead gives other logits); outputs bitwise identical
under batching, chunked prefill, cached prefixes and page size; indexer keys live in the DSA
sidecar at the anchor's slots.
"""

import json
import os

import pytest
import torch
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.memory_pool.dsa import DSAIndexerPool
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.test import hf_reference as hf_ref
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import Driver, make_tiny_model

transformers = pytest.importorskip("transformers")

register_cpu_ci(est_time=15, suite="per-commit-cpu")

LOGIT_TOL = 1e-5
NEW_TOKENS = 8
TOPK = 16
_g = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(5, 990, (n,), generator=_g).tolist() for n in (9, 140, 300)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("dsv32") / "m"), "deepseek_v32")
    hf_ref.randomize_zero_inits(path, {"e_score_correction_bias": 0.05})
    return path


@pytest.fixture(scope="module")
def hf(model_path):
    return hf_ref.load_hf(model_path)


def capture(modules):
    """Record each module's outputs in call order (forward hooks); returns (log, handles)."""
    log = {i: [] for i in range(len(modules))}
    handles = [m.register_forward_hook(lambda mod, args, out, i=i: log[i].append(out.detach().clone()))
               for i, m in enumerate(modules)]
    return log, handles


def hf_choices(rows: torch.Tensor, positions: list[int]) -> list[set[int]]:
    """HF's top-k indices per row, restricted to the visible keys (HF's early rows also carry
    masked ones, which its attention then drops)."""
    return [{i for i in row.tolist() if i <= p} for row, p in zip(rows, positions)]


def test_indexer_choice_logits_and_greedy_match_hf(model_path, hf):
    runner = hf_ref.make_runner(model_path)
    assert isinstance(runner.side_pools[PoolKind.DSA_INDEXER], DSAIndexerPool)
    ours_idx = [layer.self_attn.indexer for layer in runner.model.model.layers]
    hf_idx = [layer.self_attn.indexer for layer in hf.model.layers]
    for prompt in PROMPTS:
        hf_log, hf_handles = capture(hf_idx)
        want_tokens, want_logits = hf_ref.hf_greedy(hf, prompt, NEW_TOKENS)
        for h in hf_handles:
            h.remove()

        our_log, our_handles = capture(ours_idx)
        tokens, logits = hf_ref.greedy_steps(runner, prompt, NEW_TOKENS)
        for h in our_handles:
            h.remove()
        for step, (row, want) in enumerate(zip(logits, want_logits, strict=True)):
            diff, tol = (row - want).abs().max().item(), LOGIT_TOL * max(1.0, want.abs().max().item())
            assert diff <= tol, f"prompt {len(prompt)} step {step}: logit diff {diff} > {tol}"
        assert tokens == want_tokens

        for layer in range(len(hf_idx)):
            # forward 0: the prefill (rows 0..n-1); then one decode row per step.
            n = len(prompt)
            want = hf_choices(hf_log[layer][0][0], list(range(n)))
            want += [hf_choices(step[0], [n + s])[0] for s, step in enumerate(hf_log[layer][1:])]
            got = [{i for i in row.tolist() if i >= 0} for row in torch.cat(our_log[layer])]
            assert len(got) == len(want) == n + NEW_TOKENS - 1
            bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            assert not bad, f"layer {layer}: rows {bad[:8]} chose other keys than HF"
            assert max(len(g) for g in got) == TOPK and len(got[-1]) == TOPK  # sparse for long rows


def test_the_choice_matters(model_path, hf, tmp_path):
    """With index_topk past the sequence length (dense MLA) the logits move far beyond LOGIT_TOL."""
    dense = tmp_path / "dense"
    dense.mkdir()
    for name in os.listdir(model_path):
        if name != "config.json":
            os.symlink(os.path.join(model_path, name), dense / name)
    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    (dense / "config.json").write_text(json.dumps({**raw, "index_topk": 4096}))
    prompt = PROMPTS[2]
    runners = {"sparse": hf_ref.make_runner(model_path), "dense": hf_ref.make_runner(str(dense))}
    rows = {}
    for name, runner in runners.items():
        driver = Driver(runner)
        req = driver.new_req(prompt)
        rows[name] = driver.extend([req], [len(prompt)]).next_token_logits[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    assert (rows["sparse"] - want).abs().max() <= LOGIT_TOL * max(1.0, want.abs().max().item())
    assert (rows["dense"] - want).abs().max() > 100 * LOGIT_TOL


def test_batched_chunked_cached_and_page_size_are_bitwise_equal(model_path):
    ref = Driver(hf_ref.make_runner(model_path, page_size=1)).generate(PROMPTS, NEW_TOKENS, batch=False)
    driver = Driver(hf_ref.make_runner(model_path, page_size=4))
    assert driver.generate(PROMPTS, NEW_TOKENS, batch=True, chunk=48) == ref
    donor = driver.new_req(PROMPTS[2])
    driver.extend([donor], [len(PROMPTS[2])])
    assert driver.generate([PROMPTS[2]], NEW_TOKENS, reuse=[(donor, 132)]) == [ref[2]]


def test_layout_and_bad_configs(model_path):
    mc = ModelConfig.from_pretrained(model_path)
    layout = mc.kv_pool_layout(2)
    assert layout.anchor.kind is PoolKind.MLA
    assert [s.kind for s in layout.sidecars] == [PoolKind.DSA_INDEXER]
    assert layout.sidecars[0].args["index_head_dim"] == 32
    # latent + rope (40 fp32) + indexer key (32 fp32) + scale (1 fp32), per layer
    assert layout.bytes_per_token(4) == 2 * (40 + 32 + 1) * 4
    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    for key in ("index_topk", "index_n_heads", "q_lora_rank"):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_dict({**raw, key: None}, "m")
    with pytest.raises(ValueError, match="index_head_dim"):
        ModelConfig.from_dict({**raw, "index_head_dim": 4}, "m")
    with pytest.raises(ValueError, match="mlp_layer_types"):
        ModelConfig.from_dict({**raw, "mlp_layer_types": ["dense"]}, "m")


def test_exact_ties_on_decode_rows_resolve_as_hf(model_path, tmp_path):
    """One indexer head: relu makes many keys score exactly 0, so the k-th best score is often
    shared past the boundary. A decode row is the call HF makes (torch.topk over the p + 1 visible
    keys), so with HF's tokens fed in, every decode row picks HF's keys, ties included. (HF's prefill
    rows also hold masked entries past p, where such a tie may resolve otherwise; >= 8 heads in
    the tests above make exact ties rare.)"""
    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version", "dtype")}
    cfg = transformers.AutoConfig.for_model("deepseek_v32", **{**keep, "index_n_heads": 1})
    torch.manual_seed(0)
    path = str(tmp_path / "one_head")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompt, steps = PROMPTS[1], 6
    hf_log, handles = capture([hf.model.layers[0].self_attn.indexer])
    with torch.no_grad():
        forced = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[0, len(prompt):].tolist()
    for h in handles:
        h.remove()

    runner = hf_ref.make_runner(path)
    indexer = runner.model.model.layers[0].self_attn.indexer
    scores, plain = [], indexer._scores
    indexer._scores = lambda *a: scores.append(plain(*a)) or scores[-1]
    our_log, handles = capture([indexer])
    driver = Driver(runner)
    req = driver.new_req(prompt)
    driver.extend([req], [len(prompt)])
    for t in forced[:-1]:
        req.token_ids.append(t)
        driver.decode([req])
    for h in handles:
        h.remove()
    n, tied = len(prompt), 0
    for s, (got, want) in enumerate(zip(our_log[0][1:], hf_log[0][1:], strict=True)):
        assert set(got[0].tolist()) == hf_choices(want[0], [n + s])[0], f"decode step {s}"
        row = scores[1 + s][0, : n + s + 1]
        kth = torch.topk(row, TOPK).values[-1]
        tied += int((row == kth).sum() > 1 and (row > kth).sum() < TOPK)
    assert tied > 0  # the boundary really was an exact tie on some decode rows
