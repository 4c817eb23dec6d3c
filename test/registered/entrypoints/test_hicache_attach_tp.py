"""Runtime L3 attach / detach with TP=2: both ranks attach and detach in lockstep. An attach
whose backend fails on one rank only is undone on the other (nothing attached anywhere); then a
good attach and a detach; the cache uses L3 only while attached, and greedy outputs stay the same
throughout (a rank out of step would hang or kill the server). The failing backend comes through
``dynamic``, which a request may attach only as the server was started: the server starts with
it (failing on no rank), and the test detaches it first."""

import json
import os

import pytest
from admin_client import (ADMIN_FLAGS, GREEDY, PROMPT_IDS, attach, detach, file_config, flush, status, storage_hit,
                          until_not_busy)

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT, make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=15, suite="per-commit-cpu")


DYNAMIC = {"module_path": "rank_failing_backend", "class_name": "FailOnRankBackend"}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return tmp_path_factory.mktemp("l3roots")


@pytest.fixture(scope="module")
def server(tmp_path_factory, roots):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "llama")
    here = os.path.dirname(os.path.abspath(__file__))  # rank_failing_backend.py, for the ``dynamic`` backend
    env = {"PYTHONPATH": os.pathsep.join([os.path.join(REPO_ROOT, "python"), here])}
    startup = {**DYNAMIC, "fail_rank": -1, "storage_dir": str(roots / "startup")}
    srv = launch_server_process(model, "--tp-size", "2", "--enable-hierarchical-cache", "--page-size", "4",
                                "--context-length", "2048", "--max-total-tokens", "1024",
                                "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                                json.dumps(startup), "--hicache-storage-roots", str(roots), *ADMIN_FLAGS, env=env)
    try:
        yield srv
    finally:
        srv.stop()


def test_tp2_attach_detach_in_lockstep(server, roots):
    assert until_not_busy(lambda: detach(server)).status_code == 200
    reference = server.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)["output_ids"]
    for fail_rank, reason in ((1, "another TP rank"), (0, "on purpose")):
        extra = {**DYNAMIC, "fail_rank": fail_rank, "storage_dir": str(roots / f"fail{fail_rank}")}
        bad = until_not_busy(lambda: attach(server, "dynamic", json.dumps(extra)))
        assert bad.status_code == 400 and reason in bad.json()["error"]["message"], bad.text
        assert status(server)["hicache_storage_backend"] is None
        flush(server)
        assert storage_hit(server, reference) == 0
        flush(server)
        assert storage_hit(server, reference) == 0  # the rank that had built it closed it again

    l3 = roots / "l3"
    ok = until_not_busy(lambda: attach(server, "file", file_config(l3),
                                       hicache_storage_prefetch_policy="wait_complete"))
    assert ok.status_code == 200, ok.text
    flush(server)
    assert storage_hit(server, reference) == 0
    flush(server)
    assert storage_hit(server, reference) > 0  # both ranks found their shards in L3

    done = until_not_busy(lambda: detach(server))
    assert done.status_code == 200, done.text
    flush(server)
    assert storage_hit(server, reference) == 0
    assert status(server)["hicache_storage_backend"] is None
    assert server.get("/health").status_code == 200
