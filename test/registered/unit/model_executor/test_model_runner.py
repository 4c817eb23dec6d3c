"""ModelRunner on the tiny model: greedy outputs do not depend on whether a prefix's KV was
computed earlier (cache hit) or now, on chunked prefill, on batch composition or on page size.

Tolerance: on CPU (MKL) the logprobs are bitwise identical across all of these (asserted); on
CUDA tokens must match and logprobs within CUDA_LOGPROB_TOL.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache.memory_pool.req_to_token import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.engine_utils import Driver, make_tiny_model

register_cpu_ci(est_time=25, suite="per-commit-cpu")
register_cuda_ci(est_time=30, suite="per-commit-1-gpu")

DEVICE = os.environ.get("SGLANG_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
CUDA_LOGPROB_TOL = 1e-3
NEW_TOKENS = 6
_g = torch.Generator().manual_seed(123)
PROMPTS = [torch.randint(5, 1000, (n,), generator=_g).tolist() for n in (3, 40, 150, 600)]
PREFIX_LENS = [0, 32, 128, 520]  # cached prefix of each prompt (page multiples of 4 and 8)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("m") / "qwen3"), "qwen3")


def make_runner(path, page_size=1, **kw):
    kw.setdefault("max_total_tokens", 8192)
    return ModelRunner(ModelRunnerConfig(path, device=DEVICE, page_size=page_size, max_running_requests=16, **kw))


def assert_same_outputs(got, want):
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        diff = max(abs(a - b) for (_, a), (_, b) in zip(g, w))
        tol = 0.0 if DEVICE == "cpu" else CUDA_LOGPROB_TOL
        assert diff <= tol, f"logprob diff {diff} > {tol}"


@pytest.fixture(scope="module")
def reference(model_path):
    """Each prompt alone, whole prompt in one prefill, nothing cached."""
    return Driver(make_runner(model_path)).generate(PROMPTS, NEW_TOKENS, batch=False)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cached_prefix_equals_recompute(model_path, reference, page_size):
    driver = Driver(make_runner(model_path, page_size))
    donors = []
    for prompt, n in zip(PROMPTS, PREFIX_LENS):  # earlier requests that left their KV behind
        donor = driver.new_req(prompt[:n] if n else prompt[:1])
        driver.extend([donor], [len(donor.token_ids)])
        donors.append((donor, n))
    got = driver.generate(PROMPTS, NEW_TOKENS, reuse=donors)
    assert_same_outputs(got, reference)
    for donor, _ in donors:
        driver.release(donor)
    assert driver.runner.token_to_kv_pool_allocator.available_size() == driver.runner.max_total_num_tokens


def test_batched_and_chunked_prefill_equal_reference(model_path, reference):
    driver = Driver(make_runner(model_path, page_size=8))
    assert_same_outputs(driver.generate(PROMPTS, NEW_TOKENS, batch=True), reference)
    assert_same_outputs(driver.generate(PROMPTS, NEW_TOKENS, batch=True, chunk=37), reference)
    assert_same_outputs(driver.generate(PROMPTS[::-1], NEW_TOKENS, batch=True)[::-1], reference)


def test_generation_is_not_degenerate(reference):
    assert len({t for out in reference for t, _ in out}) > 4
    assert all(-10 < lp <= 0 for out in reference for _, lp in out)


def test_forward_batch_rejects_bad_input(model_path):
    r = make_runner(model_path, max_total_tokens=64)
    ctx = r.model_config.context_len
    cases = [
        (dict(req_pool_indices=[0], prefix_lens=[0], input_ids=[[1, 2]], out_cache_loc=[1]), "one slot per new token"),
        (dict(req_pool_indices=[0], prefix_lens=[ctx], input_ids=[[1]], out_cache_loc=[1]), "exceeds the context length"),
        (dict(req_pool_indices=[0], prefix_lens=[0], input_ids=[[5000]], out_cache_loc=[1]), r"token ids must be in \[0, 1000\)"),
        (dict(req_pool_indices=[99], prefix_lens=[0], input_ids=[[1]], out_cache_loc=[1]), "req_pool_indices must be in"),
        (dict(req_pool_indices=[0], prefix_lens=[0], input_ids=[[]], out_cache_loc=[]), ">= 1 new token"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ForwardBatch.init_extend(r, **kwargs)


def test_pool_sizing(model_path):
    r = make_runner(model_path, page_size=16, max_total_tokens=1000)
    assert r.max_total_num_tokens == 992
    assert r.token_to_kv_pool.size == r.token_to_kv_pool_allocator.size == 992
    assert r.token_to_kv_pool.head_num == 2 and r.token_to_kv_pool.layer_num == 2
    auto = make_runner(model_path, max_total_tokens=None, mem_fraction_static=1e-6)
    assert 0 < auto.max_total_num_tokens <= 16 * auto.model_config.context_len


def test_runner_config_errors(model_path):
    with pytest.raises(ValueError, match="dist_init_method"):
        ModelRunnerConfig(model_path, tp_size=2)
    with pytest.raises(ValueError, match=r"device 'tpu' is not supported; supported: \['cpu', 'cuda'\]"):
        ModelRunnerConfig(model_path, device="tpu")
    with pytest.raises(ValueError, match="page_size=0"):
        ModelRunnerConfig(model_path, page_size=0)
    with pytest.raises(ValueError, match="context_length"):
        make_runner(model_path, context_length=10**6)


def test_forward_sets_hicache_consumer(model_path):
    r = make_runner(model_path, max_total_tokens=64)
    calls = []
    counter = SimpleNamespace(set_consumer=lambda i: calls.append(("consumer", i)), wait_until=lambda i: calls.append(i))
    r.token_to_kv_pool.register_layer_transfer_counter(counter)
    req = r.req_to_token_pool.alloc(1)
    r.forward(ForwardBatch.init_extend(r, req, [0], [[1, 2, 3]], r.token_to_kv_pool_allocator.alloc(3), hicache_consumer_index=2))
    r.forward(ForwardBatch.init_decode(r, req, [4], [4], r.token_to_kv_pool_allocator.alloc(1)))
    assert calls == [("consumer", 2), 0, 0, 1, 1, ("consumer", -1), 0, 0, 1, 1]


def test_req_to_token_pool():
    pool = ReqToTokenPool(3, 8)
    assert pool.alloc(2) == [0, 1] and pool.alloc(2) is None
    pool.free(0)
    assert pool.alloc(1) == [0]
    with pytest.raises(ValueError, match="double free"):
        pool.free([2])
    with pytest.raises(ValueError, match="out of range"):
        pool.free(3)
    pool.write((1, slice(2, 5)), torch.tensor([7, 8, 9]))
    assert pool.req_to_token[1].tolist() == [0, 0, 7, 8, 9, 0, 0, 0]
