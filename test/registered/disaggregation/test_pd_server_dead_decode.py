"""A dead decode server costs its clients seconds, not minutes (issue 27).

One prefill server and two decode servers behind the real sglang-router with its DEFAULT flags
(retries, circuit breaker, health checks), every server with default PD timeouts. Clients, some
streamed, are generating on both decode servers when one decode server is SIGKILLed. Every
client must end (an error, or a completed answer: the router retries a non-streamed request on
the other pair) within the issue's bound of 15 s, new requests must succeed on the surviving
decode server, and prefill must settle with no room left open.

Before the fix a retry the router sent to the dead decode server left prefill holding the
request for its decode peer for SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (300 s), and the router
waits for the prefill answer: the client hung for minutes. Now a decode server claims its room
as soon as the request reaches it; prefill fails a room nobody claimed within the claim timeout
(2 s) and a room whose claimer died as soon as its heartbeats stop.
"""

import threading
import time

import pytest
import requests

from pd_cluster import decode_flags, free_ports, kill_server, launch_servers, prefill_flags, scheduler_info, wait_settled
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_pd_router

register_cpu_ci(est_time=90, suite="nightly-cpu")

BOUND_S = 15  # the bound: a client of the killed server is answered within this
NUM_CLIENTS = 8
MAX_NEW = 300


class Client(threading.Thread):
    """One /generate through the router; ``first_token`` is set once a streamed client got a token."""

    def __init__(self, url: str, i: int, stream: bool):
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.body = {"input_ids": [11 + (i * 37 + j * 29) % 700 for j in range(120)], "stream": stream,
                     "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
        self.first_token = threading.Event()
        self.status, self.text, self.ended_at = None, "", None

    def run(self):
        try:
            resp = requests.post(self.url + "/generate", json=self.body, timeout=600, stream=self.stream)
            self.status = resp.status_code
            if self.stream:
                for line in resp.iter_lines():
                    self.first_token.set()
                    self.text = line.decode(errors="replace")[-300:] or self.text
            else:
                self.text = resp.text[-300:]
        except requests.RequestException as exc:
            self.status, self.text = "exception", repr(exc)[:300]
        finally:
            self.first_token.set()
            self.ended_at = time.monotonic()


def wait_for(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    (bootstrap_port,) = free_ports(1)
    logs = str(tmp_path_factory.mktemp("logs"))
    prefill, decode1, decode2 = launch_servers(model, [prefill_flags(bootstrap_port), decode_flags(), decode_flags()],
                                               log_dir=logs)
    router = None
    try:
        router = launch_pd_router([(prefill.url, bootstrap_port)], [decode1.url, decode2.url], log_dir=logs)
        yield {"prefill": prefill, "decode1": decode1, "decode2": decode2, "router": router}
    finally:
        for proc in (router, prefill, decode1, decode2):
            if proc is not None:
                proc.stop()


def test_sigkill_of_a_decode_server_mid_generation(cluster):
    router, decode1, decode2 = cluster["router"], cluster["decode1"], cluster["decode2"]
    clients = [Client(router.url, i, stream=i % 2 == 1) for i in range(NUM_CLIENTS)]
    for c in clients:
        c.start()
    streamed = [c for c in clients if c.stream]
    # mid-generation on both decode servers: every streamed client has tokens, both are decoding
    wait_for(lambda: all(c.first_token.is_set() for c in streamed)
             and scheduler_info(decode1)["num_running_reqs"] > 0 and scheduler_info(decode2)["num_running_reqs"] > 0,
             "clients generating on both decode servers")
    in_flight = [c for c in clients if c.ended_at is None]  # decode1's clients among them (it is decoding)
    killed_at = time.monotonic()
    kill_server(decode1)
    for c in in_flight:
        c.join(max(0.0, killed_at + BOUND_S + 60 - time.monotonic()))
    late = [(c.stream, c.status, round(c.ended_at - killed_at, 1) if c.ended_at else None, c.text[-120:])
            for c in in_flight if c.ended_at is None or c.ended_at - killed_at >= BOUND_S]
    assert not late, f"clients not answered within {BOUND_S} s of the kill: {late}"
    # new requests succeed on the surviving decode server, each within the same bound
    for i in range(6):
        body = {"input_ids": [5 + i + j for j in range(40)], "sampling_params": {"max_new_tokens": 8,
                                                                                 "temperature": 0}}
        t0 = time.monotonic()
        resp = requests.post(router.url + "/generate", json=body, timeout=600)
        took = time.monotonic() - t0
        assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 8, resp.text[:300]
        assert took < BOUND_S, f"new request {i} took {took:.1f} s"
    # nothing is left held: prefill and the surviving decode server settle with no room open
    for srv in (cluster["prefill"], decode2):
        info = wait_settled(srv, timeout=60)
        assert info["disaggregation"]["pd_active_rooms"] == 0, info["disaggregation"]
        assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
        assert srv.get("/health").status_code == 200


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
