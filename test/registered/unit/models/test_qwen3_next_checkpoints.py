"""Qwen3-Next state checkpoints where prefixes end (``managers/mamba_state.py``), served in process.

The multi-turn workload shape of issue 28 (page size 16): conversations sharing a 160-token system
prompt, 40-token questions, short answers, then the next turn of one conversation and a prompt that is
a prefix of an earlier one. Checkpoints taken inside a prefill forward (the branch point, the last page
before the prompt's end, every ``--mamba-track-interval`` tokens) make each of them hit at the last
checkpoint at or below its common prefix; every output equals HF transformers, with and without
chunked prefill, with HiCache (HiMambaRadixCache) and without it (MambaRadixCache, the default
invocation). Integrity (state slots included) is checked after every step.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.hf_reference import load_hf

register_cpu_ci(est_time=40, suite="per-commit-cpu")

PAGE, SYSTEM, QUESTION, NEW_TOKENS = 16, 160, 40, 8
_g = torch.Generator().manual_seed(11)


def _tokens(n):
    return torch.randint(5, 1000, (n,), generator=_g).tolist()


SYSTEM_PROMPT = _tokens(SYSTEM)
QUESTIONS = {name: _tokens(QUESTION) for name in ("a", "b", "c", "a2")}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("m") / "qwen3_next"), "qwen3_next", "--layers", "4")


@pytest.fixture(scope="module")
def hf_model(model_path):
    return load_hf(model_path)


def _hf_generate(hf_model, prompt):
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def _scheduler(model_path, **kwargs):
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    torch.set_num_threads(1)
    return Scheduler(ServerArgs(model_path=model_path, page_size=PAGE, max_total_tokens=4096, **kwargs))


def _run(sched, rid, prompt):
    """One request to the end; returns (tokens, cached_tokens by tier). Integrity after every step."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sched.handle_messages([TokenizedGenerateReqInput(rid, list(prompt), SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))])
    tokens, cached, steps = [], {}, 0
    while sched.has_work() or sched.transfers_in_flight():
        steps += 1
        assert steps < 2000, "no progress"
        for o in sched.step():
            tokens += o.token_ids
            if o.finish is not None:
                cached.update(o.cached_tokens)
        sched.check_integrity()
        sched.on_idle()
    return tokens, cached


def _workload(sched, hf_model):
    """Runs the workload, checks every output against HF; returns the device hits by request."""
    hits = {}

    def ask(rid, prompt):
        tokens, cached = _run(sched, rid, prompt)
        assert tokens == _hf_generate(hf_model, prompt), f"{rid}: output differs from HF"
        hits[rid] = cached.get("device", 0) + cached.get("host", 0)
        return tokens

    first = SYSTEM_PROMPT + QUESTIONS["a"]
    answer = ask("a1", first)
    ask("b1", SYSTEM_PROMPT + QUESTIONS["b"])
    ask("c1", SYSTEM_PROMPT + QUESTIONS["c"])
    ask("a2", first + answer + QUESTIONS["a2"])  # the conversation's next turn
    ask("prefix", first[:180])  # a prefix of an earlier prompt
    return hits


HICACHE = {"enable_hierarchical_cache": True, "hicache_ratio": 4}
TREES = {"hicache": HICACHE, "plain": {}}  # HiMambaRadixCache; MambaRadixCache (the default invocation)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("chunked_prefill_size", [-1, 64])
def test_multi_turn_hits_at_checkpoints_inside_prefill(model_path, hf_model, chunked_prefill_size, tree):
    """Default track interval (256, longer than every prompt): the checkpoints come from where prompts
    leave the cached prefix and from the last page of each prefill."""
    from sglang.srt.mem_cache.hi_mamba_radix_cache import HiMambaRadixCache
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    sched = _scheduler(model_path, chunked_prefill_size=chunked_prefill_size, **TREES[tree])
    assert type(sched.tree_cache) is (HiMambaRadixCache if tree == "hicache" else MambaRadixCache)
    hits = _workload(sched, hf_model)
    assert hits["a1"] == 0
    # b1 found the system prompt's KV but no state there: it checkpointed its branch point
    # (with 64-token chunks, a1 left states at the ends of its chunks: 64, 128, 192)
    assert hits["b1"] == (128 if chunked_prefill_size == 64 else 0)
    assert hits["c1"] == SYSTEM  # the shared system prompt
    assert hits["a2"] >= (SYSTEM + QUESTION) // PAGE * PAGE  # the last page of the first turn's prompt
    assert hits["prefix"] >= SYSTEM
    pool = sched.runner.state_pool
    tree_states = sum(n.mamba_value is not None for n in sched.tree_cache._all_nodes())
    assert pool.available_size() + tree_states == pool.size  # every checkpoint is counted
    sched.shutdown()


@pytest.mark.parametrize("tree", TREES)
def test_track_interval_of_one_page_hits_at_every_page(model_path, hf_model, tree):
    sched = _scheduler(model_path, chunked_prefill_size=-1, mamba_track_interval=PAGE, **TREES[tree])
    hits = _workload(sched, hf_model)
    assert hits["b1"] == SYSTEM  # a1 left a checkpoint at every page
    assert hits["prefix"] == (180 - 1) // PAGE * PAGE  # the last checkpoint at or below the common prefix
    sched.shutdown()


@pytest.mark.parametrize("tree", TREES)
def test_checkpoints_are_evicted_when_requests_need_state_slots(model_path, hf_model, tree):
    """A state pool too small to keep every checkpoint: requests still run (checkpoints are evicted
    or skipped), outputs stay equal to HF, and the counts add up after every step."""
    sched = _scheduler(model_path, chunked_prefill_size=-1, mamba_track_interval=PAGE, max_running_requests=2,
                       max_mamba_cache_size=4, **TREES[tree])
    _workload(sched, hf_model)
    pool = sched.runner.state_pool
    tree_states = sum(n.mamba_value is not None for n in sched.tree_cache._all_nodes())
    assert pool.size == 4 and pool.available_size() + tree_states == pool.size
    sched.shutdown()


# ---- the forward's checkpoints and where they are taken --------------------------------------------
def test_checkpoint_inside_a_prefill_equals_the_state_of_a_prefill_ending_there(model_path):
    """``StateSlots.track``: the states written at offsets 64 and 96 of a 150-token prefill equal
    (bitwise: the same chunk grid) those of prefills of the first 64 / 96 tokens, and the request's
    own outputs are unchanged by the checkpoints."""
    from sglang.srt.layers.linear_attention import ZERO_STATE, StateSlots
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.test.hf_reference import make_runner

    runner = make_runner(model_path, device="cpu", max_total_tokens=1024)
    pool, prompt = runner.state_pool, _tokens(150)

    def prefill(ids, track=()):
        row, own = runner.req_to_token_pool.alloc(1)[0], int(pool.alloc(1)[0])
        loc = runner.token_to_kv_pool_allocator.alloc(-(-len(ids) // PAGE) * PAGE)[: len(ids)]
        slots = StateSlots((ZERO_STATE,), (own,), (tuple(track),) if track else ())
        batch = ForwardBatch.init_extend(runner, [row], [0], [ids], loc, mamba_slots=slots)
        return runner.forward(batch).next_token_logits, own

    a, b = (int(pool.alloc(1)[0]) for _ in range(2))
    logits, own = prefill(prompt, [(64, a), (96, b)])
    plain_logits, plain_own = prefill(prompt)
    assert torch.equal(logits, plain_logits) or float((logits - plain_logits).abs().max()) < 1e-5
    for slot, n in ((a, 64), (b, 96)):
        _, ref = prefill(prompt[:n])
        for name, buf in pool.buffers.items():
            assert torch.equal(buf[:, slot], buf[:, ref]), (name, n)


def test_track_positions_interval_branch_and_last_page():
    from types import SimpleNamespace

    from sglang.srt.managers.mamba_state import MambaStateSlots

    tree = SimpleNamespace(page_size=PAGE, disable=False, supports_mamba=lambda: True)
    slots = MambaStateSlots(tree, state_pool=None, track_interval=64)
    req = SimpleNamespace(mamba_branch_len=160)
    assert slots._track_positions(req, 0, 200) == [64, 128, 160, 192]
    assert slots._track_positions(req, 160, 200) == [192]  # the branch is where it started
    assert slots._track_positions(req, 192, 208) == []  # ends on a page: the end state is the request's own
    assert slots._track_positions(req, 0, 17) == [16]
    assert MambaStateSlots(tree, None, track_interval=24).track_interval == 48  # rounded to whole pages
