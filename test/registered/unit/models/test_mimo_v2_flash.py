"""MiMo-V2-Flash against HF transformers: a tiny checkpoint written by transformers itself
(make_tiny_model --arch mimo_v2_flash: q/k head 24, v head 16, layers full / sliding(40) / sliding /
full, sinks on the sliding layers, layer 0 dense, 8 routed experts with a nonzero selection bias)
is served by our engine and by HF (eager attention, fp32).

* Prefill logits and every decode step's logits within LOGIT_ATOL of HF's (observed ~2e-6 on
  logits of scale ~3), greedy tokens identical to HF ``generate``, on prompts longer than the
  window and than a 128-key attention block, over 4-token pages.
* Chunked prefill, batching and cached prefixes change nothing (bitwise on CPU).
* The window and the sinks are live in these checks: dropping either moves the logits far off HF.
* The pool is the asymmetric MHA pool sized by the sliding layers' (doubled) KV heads.
* Bad configs fail naming the key.
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang.srt.layers.attention.torch_native_backend import (
    TorchNativeAttnBackend,
    tree_sum_blocks,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.memory_pool.mha import AsymmetricMHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.req_to_token import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.engine_utils import Driver, make_tiny_model
from sglang.test.hf_reference import greedy_steps, hf_greedy, load_hf
from sglang.test.hf_reference import make_runner as _make_runner

register_cpu_ci(est_time=20, suite="per-commit-cpu")
register_cuda_ci(est_time=30, suite="per-commit-1-gpu")

transformers = pytest.importorskip("transformers")

DEVICE = os.environ.get("SGLANG_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
CUDA_LOGPROB_TOL = 1e-3  # cuBLAS picks kernels by shape: same tokens, logprobs close
LOGIT_ATOL = 1e-4
NEW_TOKENS = 8
WINDOW = 40
_g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(5, 990, (n,), generator=_g).tolist() for n in (5, 90, 300)]
PREFIX_LENS = [0, 44, 200]  # cached prefixes, whole 4-token pages


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("m") / "mimo"), "mimo_v2_flash", "--layers", "4", "--seed", "1")
    # HF initialises the router's selection bias to zeros; make it matter.
    weights = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    for name in weights:
        if name.endswith("e_score_correction_bias"):
            weights[name] = 0.3 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def hf_model(model_path):
    return load_hf(model_path)


@pytest.fixture(scope="module")
def hf_outputs(hf_model):
    """Per prompt: (generated tokens, logits of the prefill and of each decode step) from HF generate."""
    outs = []
    for prompt in PROMPTS:
        tokens, logits = hf_greedy(hf_model, prompt, NEW_TOKENS)
        outs.append((tokens, torch.stack(logits).float()))
    return outs


def make_runner(path, page_size=4, **kw):
    return _make_runner(path, page_size, device=DEVICE, **kw)


@pytest.fixture(scope="module")
def runner(model_path):
    return make_runner(model_path)


def greedy_step_logits(runner, prompt, steps):
    """Our greedy tokens and the logits of the prefill and of each decode step, (steps, V) on CPU."""
    tokens, rows = greedy_steps(runner, prompt, steps)
    return tokens, torch.stack(rows).float().cpu()


def test_logits_and_greedy_match_hf(runner, hf_outputs):
    for prompt, (hf_tokens, hf_logits) in zip(PROMPTS, hf_outputs):
        tokens, logits = greedy_step_logits(runner, prompt, NEW_TOKENS)
        diff = (logits - hf_logits).abs().max().item()
        scale = hf_logits.abs().max().item()
        assert diff < LOGIT_ATOL, f"prompt of {len(prompt)}: max |logit diff| {diff} (logit scale {scale})"
        assert tokens == hf_tokens, f"prompt of {len(prompt)}: {tokens} != HF {hf_tokens}"
    assert len({t for toks, _ in hf_outputs for t in toks}) > 4  # not a degenerate repetition


def test_window_and_sinks_are_live(runner, hf_outputs):
    """Without the window (or without the sinks) our logits on the long prompt leave HF's."""
    prompt, (_, hf_logits) = PROMPTS[2], hf_outputs[2]
    attns = [layer.self_attn.attn for layer in runner.model.model.layers]
    assert [a.sliding_window for a in attns] == [None, WINDOW, WINDOW, None]
    assert [a.sinks is not None for a in attns] == [False, True, True, False]
    for field in ("sliding_window", "sinks"):
        saved = [getattr(a, field) for a in attns]
        try:
            for a in attns:
                setattr(a, field, None)
            _, logits = greedy_step_logits(runner, prompt, 1)
        finally:
            for a, value in zip(attns, saved):
                setattr(a, field, value)
        assert (logits[0] - hf_logits[0]).abs().max().item() > 1e-2, field


def assert_same_outputs(got, want):
    """Same greedy tokens; logprobs bitwise equal on CPU, within CUDA_LOGPROB_TOL on CUDA."""
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        diff = max(abs(a - b) for (_, a), (_, b) in zip(g, w))
        assert diff <= (0.0 if DEVICE == "cpu" else CUDA_LOGPROB_TOL), f"logprob diff {diff}"


def test_chunked_batched_and_cached_prefill_are_bitwise_equal(model_path):
    reference = Driver(make_runner(model_path, page_size=1)).generate(PROMPTS, NEW_TOKENS, batch=False)
    driver = Driver(make_runner(model_path, page_size=4))
    assert_same_outputs(driver.generate(PROMPTS, NEW_TOKENS, batch=True, chunk=37), reference)
    assert_same_outputs(driver.generate(PROMPTS[::-1], NEW_TOKENS, batch=True)[::-1], reference)
    donors = []
    for prompt, n in zip(PROMPTS, PREFIX_LENS):
        donor = driver.new_req(prompt[:n] if n else prompt[:1])
        driver.extend([donor], [len(donor.token_ids)])
        donors.append((donor, n))
    assert_same_outputs(driver.generate(PROMPTS, NEW_TOKENS, reuse=donors), reference)
    for donor, _ in donors:
        driver.release(donor)


def test_pool_is_asymmetric_and_sized_by_sliding_layers(runner):
    greedy_step_logits(runner, PROMPTS[1], 1)
    pool = runner.token_to_kv_pool
    assert isinstance(pool, AsymmetricMHATokenToKVPool) and pool.kind is PoolKind.ASYMMETRIC_MHA
    assert (pool.head_num, pool.head_dim, pool.v_head_dim, pool.layer_num) == (4, 24, 16, 4)  # 2 x 2 KV heads
    layout = runner.model_config.kv_pool_layout(tp_size=2)
    assert layout.anchor.args["head_num"] == 2 and layout.anchor.kind is PoolKind.ASYMMETRIC_MHA
    # a full-attention layer (2 KV heads) leaves its pool heads 2..3 zero
    assert torch.count_nonzero(pool.get_key_buffer(0)[:, 2:]) == 0
    assert torch.count_nonzero(pool.get_key_buffer(1)[:, 2:]) > 0


def _config(model_path) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.pop("v_head_dim"), ["v_head_dim"]),
    (lambda c: c.update(layer_types=["full_attention", "swa", "full_attention", "full_attention"]),
     ["layer_types", "sliding_attention"]),
    (lambda c: c.update(mlp_layer_types=["dense"]), ["mlp_layer_types", "4 layers"]),
    (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="yarn"), ["rope_type", "'yarn'"]),
    (lambda c: c.update(topk_group=5), ["topk_group", "n_group=4"]),
    (lambda c: c.update(num_experts_per_tok=5), ["num_experts_per_tok", "[1, 4]"]),
    (lambda c: c.update(n_routed_experts=6), ["n_routed_experts (6)", "n_group (4)"]),
])
def test_bad_config_is_refused_naming_the_key(model_path, edit, words):
    raw = _config(model_path)
    edit(raw)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(raw, model_path)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_release_window_key_and_default_pattern(model_path):
    raw = _config(model_path)
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window"):
        raw.pop(key)
    raw.update(num_hidden_layers=7, sliding_window_size=128)
    hf = ModelConfig.from_dict(raw, model_path).hf_config
    assert hf.sliding_window == 129
    assert hf.layer_types == ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention", "sliding_attention"]
    assert hf.mlp_layer_types == ["dense"] + ["sparse"] * 6
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 5_000_000.0


# --- the backend's window and sinks on their own, against a dense float64 reference -------------

HEADS, KV_HEADS, HEAD_DIM, V_DIM = 4, 2, 12, 8


def dense_window_sink_reference(q, k, v, first_pos, window, sinks):
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    pos = torch.arange(first_pos, first_pos + q.shape[0]).view(1, -1, 1)
    keys = torch.arange(k.shape[0]).view(1, 1, -1)
    scores = scores.masked_fill((keys > pos) | (keys <= pos - window), float("-inf"))
    scores = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
    probs = scores.softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("window", [1, 6, 19, 60])
def test_backend_window_and_sinks_match_dense_and_are_chunk_invariant(window):
    """Keys in 8-slot blocks, queries in chunks of 5: equals dense attention with a window and
    sinks; a token's output is bitwise the same as one prefill row and as a decode step."""
    n, page = 45, 4
    g = torch.Generator().manual_seed(window)
    q, k, v = torch.randn(n, HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g), \
        torch.randn(n, KV_HEADS, V_DIM, generator=g)
    layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, 0, v_head_dim=V_DIM, sliding_window=window,
                           with_sinks=True)
    layer.sinks.data.copy_(torch.randn(HEADS, generator=g))
    layer.to(DEVICE)

    def fresh():
        pool = AsymmetricMHATokenToKVPool(256, page, torch.float32, KV_HEADS, HEAD_DIM, V_DIM, 1, DEVICE)
        return pool, PagedTokenToKVPoolAllocator(256, page, kvcache=pool), ReqToTokenPool(2, 64, DEVICE)

    def run(state, prefix, rows, loc, backend):
        pool, _, req_to_token = state
        runner = SimpleNamespace(device=torch.device(DEVICE), token_to_kv_pool=pool, req_to_token_pool=req_to_token,
                                 attn_backend=backend, model_config=SimpleNamespace(vocab_size=2))
        batch = ForwardBatch.init_extend(runner, [0], [prefix], [[1] * len(rows)], loc)
        backend.init_forward_metadata(batch)
        return backend.forward(q[rows].to(DEVICE), k[rows].to(DEVICE), v[rows].to(DEVICE), layer, batch)

    state = fresh()
    slots = state[1].alloc(48)[:n]
    whole = run(state, 0, list(range(n)), slots, TorchNativeAttnBackend(DEVICE, key_block=8, q_block=5))
    want = dense_window_sink_reference(q, k, v, 0, window, layer.sinks.cpu())
    torch.testing.assert_close(whole.cpu().double(), want, atol=1e-5, rtol=1e-5)
    state2 = fresh()
    slots2 = state2[1].alloc(48)[:n]
    backend = TorchNativeAttnBackend(DEVICE, key_block=8, q_block=5)
    run(state2, 0, list(range(23)), slots2[:23], backend)  # other chunk boundaries, other skipped blocks
    rest = run(state2, 23, list(range(23, n - 1)), slots2[23 : n - 1], backend)
    last = run(state2, n - 1, [n - 1], slots2[n - 1 :], backend)  # a decode step
    for got, want in ((rest, whole[23 : n - 1]), (last, whole[n - 1 :])):
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("zeros, live", [(1, 1), (1, 4), (3, 5), (4, 4), (6, 3), (13, 7)])
def test_tree_sum_with_leading_zero_blocks_is_bitwise_the_padded_tree(zeros, live):
    x = torch.randn(2, live, 3, 5, generator=torch.Generator().manual_seed(zeros * 10 + live))
    padded = torch.cat([torch.zeros(2, zeros, 3, 5), x], dim=1)
    assert torch.equal(tree_sum_blocks(x, zeros), tree_sum_blocks(padded))


def test_dummy_weights_build_and_run(model_path):
    """``--load-format dummy`` fills every tensor the checkpoint would hold (the loader refuses a
    missing one) and the model runs on them."""
    r = make_runner(model_path, load_format="dummy")
    tokens, logits = greedy_step_logits(r, PROMPTS[1], 2)
    assert torch.isfinite(logits).all() and len(tokens) == 2
