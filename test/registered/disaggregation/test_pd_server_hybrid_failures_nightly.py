"""PD failures for a state model (tiny Qwen3-Next: KV pages + a Mamba state slot per request):
a decode or prefill server SIGKILLed while the request is pinned in decode's transfer queue
(prefill's scheduler SIGSTOPped, as in test_pd_server_failures.py). The client gets an error
within the bound; the survivor stays healthy, settles with no room open and passes its idle
integrity check, whose Mamba check counts every state slot free or held: decode's quarantined
request keeps its state slot with its pages until the quarantine ends, then frees both."""

import signal

import pytest

from pd_cluster import kill_server, scheduler_info, signal_pids
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from test_pd_server_failures import (
    ERROR_BOUND_S,
    TIMEOUT_S,
    _pin_in_decode_transfer_queue,
    assert_settled_clean,
    killable_cluster,
    wait_for,
)

register_cpu_ci(est_time=40, suite="nightly-cpu")

FLAGS = ("--disable-radix-cache",)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next", "--layers", "4")
    with killable_cluster(model, str(tmp_path_factory.mktemp("logs")), *FLAGS) as c:
        yield c


def test_decode_killed_mid_request(cluster):
    client, pids = _pin_in_decode_transfer_queue(cluster, "router1", "decode1")
    kill_server(cluster["decode1"])
    signal_pids(pids, signal.SIGCONT)  # prefill now prefills and sends KV + state into a dead peer
    client.join(ERROR_BOUND_S + 40)
    assert client.elapsed is not None and client.elapsed < ERROR_BOUND_S, "the client hung"
    assert client.status != 200, client.text
    pd = assert_settled_clean(cluster["prefill"], 1)
    assert pd["pd_bootstrap_queue"] == pd["pd_inflight_queue"] == 0


def test_prefill_killed_mid_request(cluster):
    client, _ = _pin_in_decode_transfer_queue(cluster, "router2", "decode2")
    decode = cluster["decode2"]
    failed_before = scheduler_info(decode)["disaggregation"]["pd_failed"]
    kill_server(cluster["prefill"])
    client.join(ERROR_BOUND_S + 40)
    assert client.elapsed is not None and client.elapsed < ERROR_BOUND_S, "the client hung"
    assert client.status != 200, client.text
    held = scheduler_info(decode)
    assert held["disaggregation"]["pd_quarantined"] == 1  # pages and state slot
    wait_for(lambda: scheduler_info(decode)["disaggregation"]["pd_quarantined"] == 0, "the quarantine to end",
             timeout=TIMEOUT_S + 10)
    idle_checks = held["counters"]["num_idle_checks"]
    wait_for(lambda: scheduler_info(decode)["counters"]["num_idle_checks"] > idle_checks, "an idle check")
    pd = assert_settled_clean(decode, failed_before + 1)
    assert pd["pd_prealloc_queue"] == pd["pd_transfer_queue"] == pd["pd_quarantined"] == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
