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
import test_mimo_e2e as e2e
from hicache_workload import tier_totals
from model_e2e import COMMON, SMALL_DEVICE, check_host_then_storage, run_checked

from sglang.srt.mem_cache.kvcacheio.dispatch import supported_cells
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=90, suite="nightly-cpu")

LOGPROB_TOL = 1e-4


mimo, reference = e2e.mimo, e2e.reference  # fixtures: the tiny checkpoint, the reference run


@pytest.mark.parametrize("layout, io_backend", supported_cells(PoolKind.ASYMMETRIC_MHA))
def test_layout_io_cell_with_file_l3(mimo, reference, tmp_path, layout, io_backend):
    check_host_then_storage(mimo, reference, str(tmp_path / "l3"), "--hicache-mem-layout", layout,
                            "--hicache-io-backend", io_backend)


def test_tp2_hicache_matches_tp1(mimo, reference):
    turns = run_checked(mimo, reference, *COMMON, "--tp-size", "2", *SMALL_DEVICE, "--hicache-mem-layout",
                        "page_first_direct", "--hicache-io-backend", "direct", logprob_tol=LOGPROB_TOL)
    assert tier_totals(turns)["host"] > 0
