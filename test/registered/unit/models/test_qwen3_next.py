"""Qwen3-Next (Gated DeltaNet + gated full attention + MoE with a shared expert) against HF transformers.

A tiny 4-layer model (linear, full, linear, full) built by transformers through make_tiny_model is
run by our ModelRunner with its state pool, and compared with HF in fp32 (eager attention):

- prefill and every decode step's next-token logits within LOGIT_TOL (max abs; the logits are
  O(1-10)), and greedy tokens identical to HF ``generate`` (do_sample=False), for prompts spanning
  several pages (page size 4);
- chunked prefill (the next chunk continues from the state the previous one left) and a prefix hit
  (KV reused, state restored from another slot) within CHUNK_TOL of one whole prefill, same tokens;
- batch composition does not change a request's logits (bitwise on CPU).

The chunked gated delta rule is checked against the token-by-token recurrence, and the causal conv
with carried state against one pass. In process, the scheduler's state slots
(``managers/mamba_state.py``): chunked prefill with more requests than running slots and no radix
cache; HiMambaRadixCache and MambaRadixCache (the default, no HiCache) prefix hits resuming from a
state checkpoint; a leaked state slot caught
by the integrity check; and the hybrid stack built on this model's pools at attention-CP rank 1/2
(coordinates reach the controller and the L3 config; KV and Mamba objects never share a name).
"""

import os

import pytest
import torch
from sglang.srt.layers.linear_attention import (
    ZERO_STATE,
    StateSlots,
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule_seq,
)
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.hf_reference import load_hf, make_runner

register_cpu_ci(est_time=15, suite="per-commit-cpu")

DEVICE = os.environ.get("SGLANG_TEST_DEVICE") or "cpu"
LOGIT_TOL = 1e-4  # ours vs HF, fp32 (observed ~6e-6)
CHUNK_TOL = 1e-4  # chunked / prefix-restored vs one prefill (observed ~1e-6)
NEW_TOKENS = 6
_g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(5, 1000, (n,), generator=_g).tolist() for n in (3, 41, 150)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("m") / "qwen3_next"), "qwen3_next", "--layers", "4")


@pytest.fixture(scope="module")
def hf_model(model_path):
    return load_hf(model_path)


@pytest.fixture(scope="module")
def runner(model_path):
    return make_runner(model_path, device=DEVICE, max_total_tokens=2048)


class StateDriver:
    """Requests with a KV row, whole KV pages and one state slot each; builds the ForwardBatches."""

    def __init__(self, runner):
        self.r = runner

    def new(self, prompt):
        r = self.r
        return {"row": r.req_to_token_pool.alloc(1)[0], "slot": int(r.state_pool.alloc(1)[0]), "ids": list(prompt),
                "kv": [], "pages": [], "shared": 0, "src": ZERO_STATE}

    def _slots(self, req, n):
        P, own = self.r.page_size, len(req["kv"]) - req["shared"]  # slots past a borrowed prefix
        while len(req["pages"]) < own + n:
            req["pages"] += self.r.token_to_kv_pool_allocator.alloc(P).tolist()
        new = req["pages"][own : own + n]
        req["kv"] += new
        return new

    def extend(self, reqs, counts):
        prefix = [len(q["kv"]) for q in reqs]
        inputs = [q["ids"][p : p + n] for q, p, n in zip(reqs, prefix, counts)]
        loc = [s for q, n in zip(reqs, counts) for s in self._slots(q, n)]
        slots = StateSlots(tuple(q["src"] for q in reqs), tuple(q["slot"] for q in reqs))
        for q in reqs:
            q["src"] = q["slot"]
        batch = ForwardBatch.init_extend(self.r, [q["row"] for q in reqs], prefix, inputs, torch.tensor(loc),
                                         mamba_slots=slots)
        return self.r.forward(batch).next_token_logits

    def decode(self, reqs):
        loc = [s for q in reqs for s in self._slots(q, 1)]
        slots = StateSlots(tuple(q["slot"] for q in reqs), tuple(q["slot"] for q in reqs))
        batch = ForwardBatch.init_decode(self.r, [q["row"] for q in reqs], [q["ids"][-1] for q in reqs],
                                         [len(q["ids"]) for q in reqs], torch.tensor(loc), mamba_slots=slots)
        return self.r.forward(batch).next_token_logits

    def generate(self, prompts, new_tokens, chunk=None, batch=True):
        """Greedy; returns per prompt (tokens, [logits of each step])."""
        reqs = [self.new(p) for p in prompts]
        out = [([], []) for _ in reqs]
        for group in ([reqs] if batch else [[q] for q in reqs]):
            plen = {id(q): len(q["ids"]) for q in group}
            while any(len(q["kv"]) < plen[id(q)] for q in group):
                todo = [q for q in group if len(q["kv"]) < plen[id(q)]]
                logits = self.extend(todo, [min(plen[id(q)] - len(q["kv"]), chunk or 1 << 30) for q in todo])
                for q, lg in zip(todo, logits):
                    if len(q["kv"]) == plen[id(q)]:
                        self._push(q, lg, out[reqs.index(q)])
            for _ in range(new_tokens - 1):
                for q, lg in zip(group, self.decode(group)):
                    self._push(q, lg, out[reqs.index(q)])
        for q in reqs:
            self.release(q)
        return out

    @staticmethod
    def _push(q, logits, out):
        token = int(logits.argmax())
        q["ids"].append(token)
        out[0].append(token)
        out[1].append(logits.float().cpu())

    def release(self, q):
        self.r.req_to_token_pool.free(q["row"])
        self.r.state_pool.free(torch.tensor([q["slot"]]))
        if q["pages"]:
            self.r.token_to_kv_pool_allocator.free(torch.tensor(q["pages"]))


@pytest.fixture(scope="module")
def reference(runner):
    """Each prompt alone, whole prompt in one prefill."""
    return StateDriver(runner).generate(PROMPTS, NEW_TOKENS, batch=False)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_config_and_pool_layout(model_path, runner):
    hf = runner.model_config.hf_config
    assert hf.layer_types == ["linear_attention", "full_attention"] * 2
    layout = runner.kv_pool_layout
    assert layout.anchor.kind is PoolKind.MHA and layout.anchor.args["layer_num"] == 2  # full-attention layers
    assert layout.state.kind is PoolKind.MAMBA
    assert layout.state.args["temporal_state_shape"] == (4, 16, 16)  # (value heads, dk, dv)
    assert layout.state.args["conv_state_shapes"] == [(2 * 2 * 16 + 4 * 16, 3)]  # q|k|v channels, K - 1
    assert runner.state_pool.layer_num == 2 and runner.token_to_kv_pool.layer_num == 2


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention"] * 4}, "no 'full_attention' layer"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types must list 4 entries"),
    ({"linear_num_value_heads": 3}, "must be a multiple of linear_num_key_heads"),
])
def test_bad_config_is_refused(model_path, change, message):
    import json

    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**raw, **change}, model_path)


def test_chunked_delta_rule_matches_recurrence():
    g = torch.Generator().manual_seed(0)
    T, Hk, Hv, dk, dv = 150, 2, 4, 16, 8
    q, k = torch.randn(T, Hk, dk, generator=g), torch.randn(T, Hk, dk, generator=g)
    v = torch.randn(T, Hv, dv, generator=g)
    decay, beta = -torch.rand(T, Hv, generator=g), torch.rand(T, Hv, generator=g)
    s0 = 0.1 * torch.randn(Hv, dk, dv, generator=g)
    out, s = chunk_gated_delta_rule(q, k, v, decay, beta, s0)
    ref_out, ref_s = recurrent_gated_delta_rule_seq(q, k, v, decay, beta, s0)
    assert float((out - ref_out).abs().max()) < 1e-5 and float((s - ref_s).abs().max()) < 1e-5
    a_out, a_s = chunk_gated_delta_rule(q[:70], k[:70], v[:70], decay[:70], beta[:70], s0)
    b_out, b_s = chunk_gated_delta_rule(q[70:], k[70:], v[70:], decay[70:], beta[70:], a_s)
    assert float((torch.cat([a_out, b_out]) - out).abs().max()) < 1e-5 and float((b_s - s).abs().max()) < 1e-5


def test_causal_conv_carries_state():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(12, 40, generator=g), torch.randn(12, 4, generator=g)
    out, state = causal_conv1d(x, w, None)
    ref = torch.nn.functional.conv1d(x[None], w[:, None, :], padding=3, groups=12)[0, :, :40]
    assert float((out - ref).abs().max()) < 1e-5
    assert torch.equal(state, x[:, -3:])
    a, sa = causal_conv1d(x[:, :17], w, None)
    b, sb = causal_conv1d(x[:, 17:], w, sa)
    assert torch.equal(torch.cat([a, b], dim=-1), out) and torch.equal(sb, state)


def test_matches_hf_logits_and_generate(hf_model, reference):
    for prompt, (tokens, logits) in zip(PROMPTS, reference):
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        assert out.sequences[0, len(prompt):].tolist() == tokens
        hf_logits = [lg[0] for lg in out.logits]
        diff = _max_diff(logits, hf_logits)
        assert diff < LOGIT_TOL, f"prompt of {len(prompt)}: max logit diff {diff} vs HF"
    assert len({t for tokens, _ in reference for t in tokens}) > 4  # not degenerate


def test_chunked_prefill_and_batching(runner, reference):
    driver = StateDriver(runner)
    for chunk in (16, 37):  # page-aligned chunks and unaligned ones
        got = driver.generate(PROMPTS, NEW_TOKENS, chunk=chunk, batch=False)
        for (tokens, logits), (ref_tokens, ref_logits) in zip(got, reference):
            assert tokens == ref_tokens and _max_diff(logits, ref_logits) < CHUNK_TOL
    batched = driver.generate(PROMPTS, NEW_TOKENS, batch=True)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(batched, reference):
        assert tokens == ref_tokens
        if DEVICE == "cpu":
            assert _max_diff(logits, ref_logits) == 0.0  # batch composition changes nothing
    assert runner.state_pool.available_size() == runner.state_pool.size


def test_prefix_hit_restores_state(runner, reference):
    """A request reusing another's first 128 tokens (KV slots and the state slot after them)."""
    driver = StateDriver(runner)
    prompt, n = PROMPTS[2], 128
    donor = driver.new(prompt[:n])
    driver.extend([donor], [n])
    req = driver.new(prompt)
    req["src"], req["kv"], req["shared"] = donor["slot"], list(donor["kv"]), n
    runner.req_to_token_pool.write((req["row"], slice(0, n)), torch.tensor(donor["kv"]))
    out = ([], [])
    driver._push(req, driver.extend([req], [len(prompt) - n])[0], out)
    for _ in range(NEW_TOKENS - 1):
        driver._push(req, driver.decode([req])[0], out)
    ref_tokens, ref_logits = reference[2]
    assert out[0] == ref_tokens and _max_diff(out[1], ref_logits) < CHUNK_TOL
    # the donor's state is untouched (the hit read it and wrote the request's own slot)
    again = driver.new(prompt[:n])
    driver.extend([again], [n])
    pool = runner.state_pool
    for m in range(pool.layer_num):
        assert torch.equal(pool.temporal[m, donor["slot"]], pool.temporal[m, again["slot"]])
    for q in (donor, req, again):
        driver.release(q)
    assert pool.available_size() == pool.size


# ---- the scheduler's state slots (managers/mamba_state.py), in process ----------------------------
def _scheduler(model_path, **kwargs):
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    torch.set_num_threads(1)
    kwargs.setdefault("max_total_tokens", 2048)
    return Scheduler(ServerArgs(model_path=model_path, **kwargs))


def _drive(sched, msgs) -> dict:
    """Hand ``msgs`` over, step until idle checking integrity (Mamba pool included) after every step."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sched.handle_messages([TokenizedGenerateReqInput(rid, list(ids), SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), return_logprob=True) for rid, ids in msgs])
    out, steps = {}, 0
    while sched.has_work() or sched.transfers_in_flight():
        steps += 1
        assert steps < 2000, "no progress"
        for o in sched.step():
            tokens, logprobs, cached = out.setdefault(o.rid, ([], [], {}))
            tokens += o.token_ids
            logprobs += o.logprobs or []
            if o.finish is not None:
                cached.update(o.cached_tokens)
        sched.check_integrity()
        sched.on_idle()
    return out


def test_scheduler_chunked_and_concurrent_without_radix_cache(model_path, reference):
    """More requests than running slots, prefill chunks of 16: every request's own state slot
    carries its state across chunks and decode; tokens equal the one-prefill reference."""
    sched = _scheduler(model_path, disable_radix_cache=True, page_size=4, chunked_prefill_size=16,
                       max_running_requests=2)
    pool = sched.runner.state_pool
    out = _drive(sched, [(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    for i, (ref_tokens, ref_logits) in enumerate(reference):
        assert out[f"r{i}"][0] == ref_tokens
    assert pool.available_size() == pool.size and sched.stats.counters.num_idle_checks == 1
    sched.shutdown()


def test_scheduler_hicache_prefix_hits_resume_from_tree_states(model_path, reference):
    """HiMambaRadixCache: a second request sharing a finished one's history resumes from the state
    the tree kept (a decode checkpoint at a page boundary), with the reference's tokens."""
    from sglang.srt.mem_cache.hi_mamba_radix_cache import HiMambaRadixCache

    sched = _scheduler(model_path, page_size=4, enable_hierarchical_cache=True, hicache_ratio=4,
                       chunked_prefill_size=32)
    assert isinstance(sched.tree_cache, HiMambaRadixCache)
    prompt = PROMPTS[2]
    first = _drive(sched, [("a", prompt[:100])])
    history = prompt[:100] + first["a"][0]
    again = _drive(sched, [("b", history + prompt[100:120])])
    assert again["b"][2]["device"] >= 100  # matched up to the checkpoint past the first prompt
    want = StateDriver(sched.runner).generate([history + prompt[100:120]], NEW_TOKENS)[0][0]
    assert again["b"][0] == want
    pool = sched.runner.state_pool
    tree_states = sum(n.mamba_value is not None for n in sched.tree_cache._all_nodes())
    assert tree_states >= 1 and pool.available_size() + tree_states == pool.size
    sched.shutdown()


@pytest.mark.parametrize("hicache", [False, True])
def test_scheduler_integrity_catches_a_leaked_state_slot(model_path, hicache):
    from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError

    flags = {"enable_hierarchical_cache": True, "page_size": 4} if hicache else {"disable_radix_cache": True}
    sched = _scheduler(model_path, **flags)
    sched.check_integrity()
    sched.runner.state_pool.alloc(1)  # held by nobody
    with pytest.raises(CacheIntegrityError, match="mamba pool"):
        sched.check_integrity()
    sched.shutdown()


def test_default_invocation_gets_a_plain_prefix_cache_with_hits(model_path, reference):
    """No --enable-hierarchical-cache: MambaRadixCache (device only) serves a state model, and a
    request extending a finished one's history resumes from the state the tree kept."""
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    sched = _scheduler(model_path, page_size=4)
    assert type(sched.tree_cache) is MambaRadixCache
    prompt = PROMPTS[2]
    first = _drive(sched, [("a", prompt[:100])])
    assert first["a"][0] == StateDriver(sched.runner).generate([prompt[:100]], NEW_TOKENS)[0][0]
    history = prompt[:100] + first["a"][0]
    again = _drive(sched, [("b", history + prompt[100:120])])
    assert again["b"][2]["device"] >= 96  # the checkpoint at the last page of the first prompt
    assert again["b"][0] == StateDriver(sched.runner).generate([history + prompt[100:120]], NEW_TOKENS)[0][0]
    sched.shutdown()


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_hybrid_stack_on_model_pools_carries_cp_coords_and_keeps_pool_keys_apart(model_path, tmp_path, backend):
    """build_mamba_hybrid_stack over this model's own pools (MHA anchor + MambaPool) at attention-CP
    rank 1 of 2: the controller and the L3 storage config carry exactly CacheInitParams'
    coordinates, every pool's key namespace says cp 1/2, and the KV and Mamba objects of one page
    hash never share a name."""
    if backend == "nixl":
        pytest.importorskip("nixl")
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams, ParallelCoords
    from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_mamba_hybrid_stack,
    )
    from sglang.srt.mem_cache.pool_host.group import PoolName

    r = ModelRunner(ModelRunnerConfig(model_path, page_size=4, max_total_tokens=256, max_running_requests=2))
    coords = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 1, "attn_cp_size": 2}
    params = CacheInitParams(page_size=4, token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
                             req_to_token_pool=r.req_to_token_pool, **coords)
    cfg = HiCacheConfig(hicache_ratio=2, storage_backend=backend, model_name="tiny-qwen3-next",
                        storage_backend_extra_config={"storage_dir": str(tmp_path)})
    stack = build_mamba_hybrid_stack(params, r.state_pool, cfg)
    try:
        controller = stack.cache_controller
        assert controller.parallel_coords() == ParallelCoords(**coords)
        for field, value in coords.items():
            assert getattr(controller.storage_config, field) == value, field
        codecs = controller.storage_backend.codecs
        assert set(codecs) == {PoolName.KV, PoolName.MAMBA}
        assert {c.namespace.cp for c in codecs.values()} == {"1/2"}
        page_hash = "ab" * 32
        kv_names, mamba_names = (set(codecs[n].object_names(page_hash)) for n in (PoolName.KV, PoolName.MAMBA))
        assert kv_names and mamba_names and not kv_names & mamba_names
        assert all("_mamba" in n for n in mamba_names) and not any("_mamba" in n for n in kv_names)
    finally:
        stack.cache_controller.close()


@pytest.mark.parametrize("hicache", [False, True])
def test_scheduler_abort_mid_prefill_and_decode_frees_state_slots(model_path, hicache):
    """One request aborted while part-prefilled, one after its prefill: their state slots go back
    (to the free list, or to the tree with their cached pages), integrity checked every step."""
    from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    flags = {"enable_hierarchical_cache": True} if hicache else {"disable_radix_cache": True}
    sched = _scheduler(model_path, page_size=4, chunked_prefill_size=16, **flags)
    sp = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    sched.handle_messages([TokenizedGenerateReqInput("short", PROMPTS[0], sp),
                           TokenizedGenerateReqInput("long", PROMPTS[2], sp)])
    for _ in range(4):
        sched.step()
        sched.check_integrity()
    assert sched.chunked_req is not None and sched.chunked_req.rid == "long"  # still prefilling
    assert [r.rid for r in sched.running] == ["short"]  # prefilled, holds its state slot
    sched.handle_messages([AbortReq("long"), AbortReq("short")])
    _drive(sched, [])
    pool = sched.runner.state_pool
    tree_states = sum(n.mamba_value is not None for n in sched.tree_cache._all_nodes()) if hicache else 0
    assert pool.available_size() + tree_states == pool.size
    sched.on_idle()  # the idle check (request rows, KV and state slots) passes
    assert sched.stats.counters.num_idle_checks == 1
    sched.shutdown()
