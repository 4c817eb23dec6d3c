"""Shared pieces of the --pp-size and --attn-cp-size server tests: the tiny checkpoints and their
single-rank reference runs (module fixtures), and what every rank of a split server reports."""

import os
import time

import pytest
from hicache_workload import run_workload
from model_e2e import COMMON, REFERENCE, WORKLOAD
from test_qwen3_next_e2e import COMMON as NEXT_COMMON
from test_qwen3_next_e2e import WORKLOAD as NEXT_WORKLOAD

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
