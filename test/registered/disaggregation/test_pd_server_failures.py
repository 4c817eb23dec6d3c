"""PD serving failures: a peer killed mid-request, and bootstrap rooms nobody serves.

The request is pinned mid-flight without timing guesses: the prefill server's scheduler is
SIGSTOPped, so the decode server takes the request, pre-allocates its pages and waits in its
transfer queue (seen in its stats) while prefill holds it unprocessed; then one side is
SIGKILLed (the prefill scheduler is resumed first when decode is the victim, so it prefills
into a dead peer). The client must get an error within a bounded time, not a hang, and the
survivor must stay healthy, settle with no room open and pass its idle integrity check (every
slot free, in the tree or held; a failed check kills the server).
"""

import contextlib
import signal
import threading
import time

import pytest
import requests

from pd_cluster import (
    decode_flags,
    free_ports,
    generate_ids,
    kill_server,
    launch_servers,
    prefill_flags,
    scheduler_info,
    scheduler_pids,
    signal_pids,
    wait_settled,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_pd_router

register_cpu_ci(est_time=30, suite="per-commit-cpu")

TIMEOUT_S = 3  # bootstrap and KV-waiting timeouts, and the heartbeat death time, of every server
ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
       "SGLANG_DISAGGREGATION_CLAIM_TIMEOUT": str(TIMEOUT_S),  # rooms nobody claims: test_pd_server_dead_decode
       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S),
       "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.25", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "12"}
ERROR_BOUND_S = 15  # the client's error must come well before this (the timeouts are 3 s)
PROMPT = [11 + (i * 29) % 700 for i in range(300)]


@contextlib.contextmanager
def killable_cluster(model: str, logs: str, *flags: str):
    """One prefill server and two decode servers, each decode behind its own PD router (no retries:
    a dead decode server is reported at once; with retries the router backs off five times first,
    ~12 s). A SIGSTOPped prefill scheduler is resumed before everything is stopped."""
    (bootstrap_port,) = free_ports(1)
    prefill, decode1, decode2 = launch_servers(
        model, [prefill_flags(bootstrap_port, *flags), decode_flags(*flags), decode_flags(*flags)], env=ENV,
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    with killable_cluster(model, str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


class Client(threading.Thread):
    """One /generate in the background: status, body and how long it took."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status, self.text, self.elapsed = None, "", None

    def run(self):
        t0 = time.monotonic()
        try:
            resp = requests.post(self.url + "/generate", json=self.body, timeout=60)
            self.status, self.text = resp.status_code, resp.text
        except requests.RequestException as exc:
            self.status, self.text = "exception", repr(exc)
        self.elapsed = time.monotonic() - t0


def body(**extra) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
            **extra}


def wait_for(predicate, what: str, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def assert_settled_clean(server, min_failed: int) -> dict:
    info = wait_settled(server)
    pd = info["disaggregation"]
    assert pd["pd_active_rooms"] == 0 and pd["pd_failed"] >= min_failed, pd
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
    assert info["counters"]["num_idle_checks"] > 0
    assert server.get("/health").status_code == 200
    return pd


def test_unknown_bootstrap_rooms_fail_cleanly(cluster):
    """A room only one side ever sees: decode gives up waiting for KV, prefill for its decode
    peer, each within its timeout, with a clear 400; both stay healthy and leak nothing."""
    prefill, decode = cluster["prefill"], cluster["decode2"]
    generate_ids(cluster["router2"].url, PROMPT, 4)  # both sides up and paired
    t0 = time.monotonic()
    resp = decode.post("/generate", body(bootstrap_host="127.0.0.1", bootstrap_port=cluster["bootstrap_port"],
                                          bootstrap_room=123456789), timeout=60)
    assert resp.status_code == 400 and "PD transfer failed" in resp.text, resp.text
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    t0 = time.monotonic()
    resp = prefill.post("/generate", body(bootstrap_room=987654321), timeout=60)
    assert resp.status_code == 400 and "decode destinations arrived" in resp.text, resp.text
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    assert_settled_clean(decode, 1)
    assert_settled_clean(prefill, 1)


def test_client_gone_while_waiting_for_its_peer(cluster):
    """The client leaves while its request waits for the other side (a room only this side
    sees): the server aborts it at once (its waiting queue, pages and room released; not
    counted as a transfer failure) long before the peer timeout would have failed it."""
    prefill, decode = cluster["prefill"], cluster["decode2"]
    cases = [(decode, body(bootstrap_host="127.0.0.1", bootstrap_port=cluster["bootstrap_port"], bootstrap_room=42)),
             (prefill, body(bootstrap_room=43))]
    for srv, req in cases:
        before = scheduler_info(srv)
        with pytest.raises(requests.exceptions.ReadTimeout):
            srv.post("/generate", req, timeout=0.8)  # the tokenizer manager notices within 0.5 s
        info = wait_settled(srv, timeout=TIMEOUT_S - 0.5)  # before the peer timeout could fail it
        assert info["counters"]["num_aborted"] == before["counters"]["num_aborted"] + 1
        assert info["disaggregation"]["pd_failed"] == before["disaggregation"]["pd_failed"]
        assert_settled_clean(srv, 0)


def _pin_in_decode_transfer_queue(cluster, router_key: str, decode_key: str) -> tuple[Client, list[int]]:
    """Stop prefill's scheduler, send a request through the router, return once decode holds it
    in its transfer queue (its pages reserved, its KV not sent)."""

    generate_ids(cluster[router_key].url, PROMPT[:50], 4)  # paired; the bootstrap lookup is cached
    pids = scheduler_pids(cluster["prefill"])
    assert pids, "no scheduler process found under the prefill server"
    signal_pids(pids, signal.SIGSTOP)
    client = Client(cluster[router_key].url, body())
    client.start()
    decode = cluster[decode_key]
    wait_for(lambda: scheduler_info(decode)["disaggregation"]["pd_transfer_queue"] == 1,
             "the decode server to hold the request in its transfer queue")
    return client, pids


def test_decode_killed_mid_request(cluster):

    client, pids = _pin_in_decode_transfer_queue(cluster, "router1", "decode1")
    kill_server(cluster["decode1"])
    signal_pids(pids, signal.SIGCONT)  # prefill now prefills and sends into a dead peer
    client.join(ERROR_BOUND_S + 40)
    assert client.elapsed is not None and client.elapsed < ERROR_BOUND_S, "the client hung"
    assert client.status != 200, client.text
    pd = assert_settled_clean(cluster["prefill"], 1)
    assert pd["pd_bootstrap_queue"] == pd["pd_inflight_queue"] == 0


def test_prefill_killed_mid_request(cluster):
    client, _ = _pin_in_decode_transfer_queue(cluster, "router2", "decode2")
    failed_before = scheduler_info(cluster["decode2"])["disaggregation"]["pd_failed"]
    kill_server(cluster["prefill"])
    client.join(ERROR_BOUND_S + 40)
    assert client.elapsed is not None and client.elapsed < ERROR_BOUND_S, "the client hung"
    assert client.status != 200, client.text
    # the failed request's pages stay quarantined for the heartbeat death time (TIMEOUT_S): a
    # write prefill had posted could still land in them; the client got its error already
    decode = cluster["decode2"]
    held = scheduler_info(decode)
    assert held["disaggregation"]["pd_quarantined"] == 1
    wait_for(lambda: scheduler_info(decode)["disaggregation"]["pd_quarantined"] == 0, "the quarantine to end",
             timeout=TIMEOUT_S + 10)
    idle_checks = held["counters"]["num_idle_checks"]  # then the freed pages pass a new integrity check
    wait_for(lambda: scheduler_info(decode)["counters"]["num_idle_checks"] > idle_checks, "an idle check")
    pd = assert_settled_clean(decode, failed_before + 1)
    assert pd["pd_prealloc_queue"] == pd["pd_transfer_queue"] == pd["pd_quarantined"] == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
