"""DeepSeek-V4 served with HiCache on the logical-anchor + state pools, over HTTP, with file L3.

The tiny checkpoint is written by transformers (make_tiny_model --arch deepseek_v4, 4 layers CSA /
HCA / sliding / CSA; the tensors HF initializes to zero are randomized so they matter). Every
cached quantity lives in the DSV4_STATE sidecar (sliding-window KV rows, raw compressor rows,
compressed block entries at each block's last slot), addressed by the anchor's slots, so HiCache
moves it with the anchor's pages. A multi-turn workload (prompts of 88-270 tokens: many CSA and
HCA blocks, far past the 16-token window) runs on a server whose device pool (512 tokens) is
smaller than its working set: prefixes come back from host (``meta_info``), are written to the
file backend, and a server restarted on the same directory serves them from storage. Greedy tokens
and logprobs equal a reference server's (device pool holding everything) bit for bit, the tokens
equal HF ``generate``, and the idle integrity check (every pool, device and host) passes.

A layout / io backend cell the V4 pools cannot honour (page_head) stops the server at start-up,
naming the pool and its supported cells. (The one cell the anchor takes and the state pool does not,
page_first + direct, is rewritten to page_first_direct by server_args before the pools see it.)
"""

import pytest
from hicache_workload import tier_totals
from model_e2e import assert_cell_refused, assert_equal_hf_generate, check_host_then_storage, run_reference

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.hf_reference import DSV4_ZERO_INITS, randomize_zero_inits

transformers = pytest.importorskip("transformers")

register_cpu_ci(est_time=30, suite="nightly-cpu")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("v4")), "deepseek_v4", "--layers", "4")
    randomize_zero_inits(path, DSV4_ZERO_INITS)
    return path


@pytest.fixture(scope="module")
def reference(v4):
    return run_reference(v4)


def test_host_hits_then_storage_hits_after_restart(v4, reference, tmp_path):
    check_host_then_storage(v4, reference, str(tmp_path / "l3"), restart=True, log_words=("dsv4_anchor", "dsv4_state"))
    assert tier_totals(reference)["host"] == 0


def test_reference_tokens_equal_hf_generate(v4, reference):
    assert_equal_hf_generate(v4, reference, min_prompt_len=5 * 16)  # several HCA blocks, far past the window


def test_unsupported_cell_is_refused_naming_the_v4_pool_cells(v4):
    assert_cell_refused(v4, PoolKind.DSV4_ANCHOR, "page_head", "kernel", "LogicalAnchorPool")
