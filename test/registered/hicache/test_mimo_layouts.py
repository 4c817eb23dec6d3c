"""MiMo-V2-Flash on HiCache, every (layout, io_backend) cell the asymmetric MHA host pool supports
(``supported_cells(PoolKind.ASYMMETRIC_MHA)``), each with the file L3 backend: against a reference
server (device pool holding everything) greedy tokens and logprobs are identical, prefixes come
back from host, and after /flush_cache from storage. Plus TP=2 with HiCache against the TP=1
reference (same tokens, logprobs within 1e-4: all-reduce order), which shards the sliding layers'
doubled KV heads, the sinks and the experts.

The per-commit cell (page_first_direct + direct) is in test_mimo_e2e.py; it runs here too, so
the matrix is whole. Kernel cells run the Triton copy kernel under TRITON_INTERPRET=1 on CPU.
"""

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals, wait_idle_check
from model_e2e import COMMON, SMALL_DEVICE, WORKLOAD, check_host_then_storage, run_reference

from sglang.srt.mem_cache.kvcacheio.dispatch import supported_cells
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=90, suite="nightly-cpu")

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("mimo")), "mimo_v2_flash", "--layers", "4")


@pytest.fixture(scope="module")
def reference(mimo):
    return run_reference(mimo)


@pytest.mark.parametrize("layout, io_backend", supported_cells(PoolKind.ASYMMETRIC_MHA))
def test_layout_io_cell_with_file_l3(mimo, reference, tmp_path, layout, io_backend):
    check_host_then_storage(mimo, reference, str(tmp_path / "l3"), "--hicache-mem-layout", layout,
                            "--hicache-io-backend", io_backend)


def test_tp2_hicache_matches_tp1(mimo, reference):
    flags = [*COMMON, "--tp-size", "2", *SMALL_DEVICE, "--hicache-mem-layout", "page_first_direct",
             "--hicache-io-backend", "direct"]
    with launch_server_process(mimo, *flags) as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_same_tokens(reference, turns, logprob_tol=LOGPROB_TOL)
    assert tier_totals(turns)["host"] > 0
