"""PD failures for a state model (tiny Qwen3-Next: KV pages + a Mamba state slot per request):
a decode or prefill server SIGKILLed while the request is pinned in decode's transfer queue
(prefill's scheduler SIGSTOPped, as in test_pd_server_failures.py). The client gets an error
within the bound; the survivor stays healthy, settles with no room open and passes its idle
integrity check, whose Mamba check counts every state slot free or held: decode's quarantined
request keeps its state slot with its pages until the quarantine ends, then frees both."""

import signal

import pytest

from pd_cluster import (
    decode_flags,
    free_ports,
    kill_server,
    launch_servers,
    prefill_flags,
    scheduler_info,
    signal_pids,
    scheduler_pids,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_pd_router
from test_pd_server_failures import (
    ENV,
    ERROR_BOUND_S,
    TIMEOUT_S,
    _pin_in_decode_transfer_queue,
    assert_settled_clean,
    wait_for,
)

register_cpu_ci(est_time=40, suite="nightly-cpu")

FLAGS = ("--disable-radix-cache",)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next", "--layers", "4")
    (bootstrap_port,) = free_ports(1)
    logs = str(tmp_path_factory.mktemp("logs"))
    prefill, decode1, decode2 = launch_servers(
        model, [prefill_flags(bootstrap_port, *FLAGS), decode_flags(*FLAGS), decode_flags(*FLAGS)], env=ENV,
        log_dir=logs)
    routers = []
    try:
        for dec in (decode1, decode2):
            routers.append(launch_pd_router([(prefill.url, bootstrap_port)], [dec.url], "--disable-retries",
                                            log_dir=logs))
        yield {"prefill": prefill, "decode1": decode1, "decode2": decode2, "router1": routers[0],
               "router2": routers[1], "bootstrap_port": bootstrap_port}
    finally:
        if prefill.proc.poll() is None:
            signal_pids(scheduler_pids(prefill), signal.SIGCONT)
        for proc in (*routers, prefill, decode1, decode2):
            proc.stop()


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
