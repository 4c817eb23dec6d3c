"""DeepSeek-V4 on HiCache, the longer stories (nightly): every (layout, io_backend) cell the V4
state pool supports (``supported_cells(PoolKind.DSV4_STATE)``; the anchor takes all of them), each
with the file L3 backend, against a reference server (device pool holding everything): greedy tokens
and logprobs identical, prefixes back from host, and after /flush_cache from storage. Then the NIXL
backend (POSIX plugin): a TP=2 server writes (rank 0 only: the anchor's marker object and the
``dsv4_state`` sidecar object per page), a fresh TP=1 server on the same store reads. V4 weights
are replicated on every rank and the vocab-parallel embedding / LM head are exact, so TP=2 is
bitwise equal to TP=1.

The per-commit cell (layer_first + direct, the default) is in test_deepseek_v4_e2e.py. Kernel cells
run the Triton copy kernel under TRITON_INTERPRET=1 on CPU.
"""

import glob
import os

import pytest
import test_deepseek_v4_e2e as e2e
from hicache_workload import assert_same_tokens, run_workload, tier_totals, wait_idle_check
from model_e2e import WORKLOAD, check_host_then_storage
from test_hicache_storage import storage_flags as backend_flags
from test_hicache_storage import wait_backed_up

from sglang.srt.mem_cache.kvcacheio.dispatch import supported_cells
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=150, suite="nightly-cpu")


v4, reference = e2e.v4, e2e.reference  # fixtures: the tiny checkpoint, the reference run


@pytest.mark.parametrize("layout, io_backend", supported_cells(PoolKind.DSV4_STATE))
def test_layout_io_cell_with_file_l3(v4, reference, tmp_path, layout, io_backend):
    check_host_then_storage(v4, reference, str(tmp_path / "l3"), "--hicache-mem-layout", layout,
                            "--hicache-io-backend", io_backend)


def test_nixl_tp2_rank0_writes_then_tp1_reads(v4, reference, tmp_path):
    pytest.importorskip("nixl")
    store = str(tmp_path / "nixl")
    with launch_server_process(v4, *backend_flags("nixl", store), "--tp-size", "2") as srv:
        tp2 = run_workload(srv, **WORKLOAD)
        written = wait_backed_up(srv)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_same_tokens(reference, tp2)
    objects = [p for p in glob.glob(os.path.join(store, "**", "*"), recursive=True) if os.path.isfile(p)]
    assert written > 0 and objects, (written, objects[:5])
    assert any("dsv4_state" in os.path.basename(p) for p in objects), objects[:5]
    with launch_server_process(v4, *backend_flags("nixl", store)) as srv:  # TP=1, empty device and host
        tp1 = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_same_tokens(reference, tp1)
    assert tier_totals(tp1)["storage"] > 0, tier_totals(tp1)
