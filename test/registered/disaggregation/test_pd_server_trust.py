"""PD servers that trust only their peers, end to end (issue 27).

A prefill and a decode server sharing ``SGLANG_DISAGGREGATION_SECRET`` serve through the real
router as before. A request that names a bootstrap host outside the decode server's allow-list,
or a malformed one, is refused with 400 before anything is contacted; the prefill bootstrap
server refuses registrations and lookups that do not carry the secret's MAC; a decode server
without the secret cannot pair with that prefill server. Real processes, NIXL UCX, the router.
"""

import urllib.error
import urllib.request

import pytest

from pd_cluster import decode_flags, free_ports, generate_ids, launch_servers, prefill_flags, wait_settled
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_pd_router

register_cpu_ci(est_time=15, suite="nightly-cpu")

SECRET = {"SGLANG_DISAGGREGATION_SECRET": "pd-deployment-secret-0123456789abcdef"}
PROMPT = [11 + (i * 29) % 700 for i in range(40)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    (bootstrap_port,) = free_ports(1)
    logs = str(tmp_path_factory.mktemp("logs"))
    prefill, decode, stranger = launch_servers(model, [prefill_flags(bootstrap_port), decode_flags(), decode_flags()],
                                               envs=[SECRET, SECRET, {}], log_dir=logs)
    router = None
    try:
        router = launch_pd_router([(prefill.url, bootstrap_port)], [decode.url], log_dir=logs)
        yield {"prefill": prefill, "decode": decode, "stranger": stranger, "router": router, "port": bootstrap_port}
    finally:
        for proc in (router, prefill, decode, stranger):
            if proc is not None:
                proc.stop()


def body(**extra) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}


def test_pair_with_a_secret_serves_through_the_router(cluster):
    assert len(generate_ids(cluster["router"].url, PROMPT, 8)) == 8
    assert len(generate_ids(cluster["router"].url, PROMPT, 8, stream=True)) == 8


@pytest.mark.parametrize("host,match", [("10.9.8.7", "'10.9.8.7' is not in this server's allowed bootstrap hosts"),
                                        ("127.0.0.1/route?", "neither an IP address nor a DNS name"),
                                        ("evil.example", "'evil.example' is not in this server's allowed")])
def test_decode_refuses_bootstrap_hosts_it_may_not_contact(cluster, host, match):
    resp = cluster["decode"].post("/generate", body(bootstrap_host=host, bootstrap_port=cluster["port"],
                                                    bootstrap_room=77), timeout=30)
    assert resp.status_code == 400 and match in resp.text, resp.text


def test_prefill_bootstrap_server_requires_the_secret(cluster):
    url = f"http://127.0.0.1:{cluster['port']}/route"
    for method, data in (("PUT", b"{}"), ("GET", None)):
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=10)
        assert exc.value.code == 401
    # a decode server without the secret cannot pair: the lookup is refused, nothing is registered
    resp = cluster["stranger"].post("/generate", body(bootstrap_host="127.0.0.1", bootstrap_port=cluster["port"],
                                                      bootstrap_room=78), timeout=60)
    assert resp.status_code == 400 and "refused the lookup" in resp.text, resp.text
    for srv in (cluster["prefill"], cluster["decode"], cluster["stranger"]):
        info = wait_settled(srv)
        assert info["disaggregation"]["pd_active_rooms"] == 0, info["disaggregation"]
        assert srv.get("/health").status_code == 200


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
