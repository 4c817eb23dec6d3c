"""MiMo-V2-Flash served with HiCache on the asymmetric MHA host pool, over HTTP.

The tiny checkpoint is written by transformers (make_tiny_model --arch mimo_v2_flash: q/k head
24, v head 16, full / 40-token sliding window with sinks, MoE). A multi-turn workload (prompts of
88-270 tokens, so every sliding layer masks) runs on a server whose device pool (512 tokens) is
far smaller than the working set, with ``--hicache-io-backend direct --hicache-mem-layout
page_first_direct`` and the file L3 backend: prefixes come back from host, and after
/flush_cache from storage (both counted in meta_info); greedy tokens and logprobs equal a
reference server's (device pool holding everything) bit for bit, and the tokens equal HF
transformers' ``generate`` on the same prompts. The other layout x io backend cells are in
test_mimo_layouts.py (nightly).

A cell the asymmetric pool does not support (page_head) stops the server at start-up, naming
the pool and its supported cells.
"""

import pytest
from model_e2e import assert_cell_refused, assert_equal_hf_generate, check_host_then_storage, run_reference

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=25, suite="nightly-cpu")

WINDOW = 40  # the tiny config's sliding window


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("mimo")), "mimo_v2_flash", "--layers", "4")


@pytest.fixture(scope="module")
def reference(mimo):
    return run_reference(mimo)


def test_hicache_direct_page_first_direct_with_file_l3(mimo, reference, tmp_path):
    check_host_then_storage(mimo, reference, str(tmp_path / "l3"), "--hicache-mem-layout", "page_first_direct",
                            "--hicache-io-backend", "direct", log_words=("asymmetric_mha", "page_first_direct"))


def test_reference_tokens_equal_hf_generate(mimo, reference):
    assert_equal_hf_generate(mimo, reference, min_prompt_len=2 * WINDOW)  # longer than the sliding window


def test_unsupported_cell_is_refused_naming_the_supported_cells(mimo):
    assert_cell_refused(mimo, PoolKind.ASYMMETRIC_MHA, "page_head", "kernel")
