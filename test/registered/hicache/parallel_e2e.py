"""Shared pieces of the --pp-size and --attn-cp-size server tests: the tiny checkpoints and their
single-rank reference runs (module fixtures), and what every rank of a split server reports."""

import os
import time

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals
from model_e2e import COMMON, REFERENCE, WORKLOAD, file_l3_flags
from test_hicache_storage import wait_backed_up
from test_qwen3_next_e2e import COMMON as NEXT_COMMON
from test_qwen3_next_e2e import LOGPROB_TOL as NEXT_LOGPROB_TOL
from test_qwen3_next_e2e import SMALL_DEVICE as NEXT_SMALL_DEVICE
from test_qwen3_next_e2e import WORKLOAD as NEXT_WORKLOAD
from test_qwen3_next_e2e import run_later_rounds

from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

# Qwen3-Next without a prefix cache: every request runs from a zero state (the reference)
NEXT_PLAIN = [*NEXT_COMMON, "--page-size", "4", "--disable-radix-cache", "--max-total-tokens", "8192"]


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    """Qwen3 of 3 layers with tied embeddings: splits of 2 and 3 stages, a head that is the embedding."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny3")), "qwen3", "--layers", "3", "--tie")


@pytest.fixture(scope="module")
def reference(model3):
    with launch_server_process(model3, *COMMON, *REFERENCE) as srv:
        return run_workload(srv, **WORKLOAD)


@pytest.fixture(scope="module")
def next4(tmp_path_factory):
    """Qwen3-Next: linear, full, linear, full."""
    return make_tiny_model(str(tmp_path_factory.mktemp("next4")), "qwen3_next", "--layers", "4")


@pytest.fixture(scope="module")
def next_reference(next4):
    with launch_server_process(next4, *NEXT_PLAIN) as srv:
        return run_workload(srv, **NEXT_WORKLOAD)


def idle_checks_per_rank(srv, timeout: float = 30) -> list[int]:
    """Every rank's idle integrity checks once each has run one (ranks drain their transfers at
    their own pace, so rank 0's first check does not mean the others')."""
    deadline = time.monotonic() + timeout
    while True:
        per_rank = scheduler_info(srv)["idle_checks_per_rank"]
        if min(per_rank) > 0 or time.monotonic() > deadline:
            return per_rank
        time.sleep(0.1)


def scheduler_info(srv) -> dict:
    return srv.get("/get_server_info").json()["scheduler"]


def stored_objects(storage_dir: str) -> int:
    return sum(len(files) for _, _, files in os.walk(storage_dir))


def check_split_l3(model: str, reference, flags: list[str], split: list[str], other: list[str] = (),
                   storage_dir: str | None = None, tol: float = 0.0) -> tuple[list[int], int]:
    """HiCache with L3 (in ``flags``) on a server split by ``split``: tokens equal the reference,
    host hits, every rank ran its idle check; a restart with the same split serves from storage,
    and one split by ``other`` instead finds nothing. Returns the pages each rank wrote and the
    objects in ``storage_dir`` after the first server."""
    with launch_server_process(model, *flags, *split) as srv:
        first = run_workload(srv, **WORKLOAD)
        assert wait_backed_up(srv) > 0
        assert min(idle_checks_per_rank(srv)) > 0
        info = scheduler_info(srv)
    assert_same_tokens(reference, first, tol)
    assert tier_totals(first)["host"] > 0, tier_totals(first)
    objects = stored_objects(storage_dir) if storage_dir else 0
    with launch_server_process(model, *flags, *split) as srv:
        again = run_workload(srv, **WORKLOAD)
        assert min(idle_checks_per_rank(srv)) > 0
    assert_same_tokens(reference, again, tol)
    assert tier_totals(again)["storage"] > 0, tier_totals(again)
    with launch_server_process(model, *flags, *other) as srv:
        other_turns = run_workload(srv, **WORKLOAD)
    assert_same_tokens(reference, other_turns, tol)
    assert tier_totals(other_turns)["storage"] == 0, tier_totals(other_turns)
    return [s["pages_written"] for s in info["storage_per_rank"]], objects


def check_qwen3_next_split_l3(next4: str, next_reference, storage_dir: str, split: list[str],
                              on_start=None) -> list[int]:
    """``check_split_l3`` for Qwen3-Next (KV pages and the states after them); ``on_start`` sees the
    first server's /get_server_info scheduler section before any request. Returns the pages each
    rank wrote."""
    flags = [*NEXT_COMMON, *NEXT_SMALL_DEVICE, *file_l3_flags(storage_dir)]
    with launch_server_process(next4, *flags, *split) as srv:
        if on_start is not None:
            on_start(scheduler_info(srv))
        turns = run_workload(srv, **NEXT_WORKLOAD)
        assert wait_backed_up(srv) > 0
        assert min(idle_checks_per_rank(srv)) > 0
        info = scheduler_info(srv)
    assert_same_tokens(next_reference, turns, NEXT_LOGPROB_TOL)
    assert tier_totals(turns)["host"] > 0, tier_totals(turns)
    with launch_server_process(next4, *flags, *split) as srv:  # same split: KV pages and states from storage
        assert run_later_rounds(srv, next_reference) > 0
        assert min(idle_checks_per_rank(srv)) > 0
    with launch_server_process(next4, *flags) as srv:  # unsplit: another namespace, nothing to read
        assert run_later_rounds(srv, next_reference) == 0
    return [s["pages_written"] for s in info["storage_per_rank"]]
