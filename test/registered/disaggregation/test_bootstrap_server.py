"""The HTTP bootstrap server: registration, lookup, refusals naming both values, bad requests."""

import json
import urllib.error
import urllib.request

import pytest
import torch

from sglang.srt.disaggregation.base import IncompatiblePeerError, KVArgs
from sglang.srt.disaggregation.common.bootstrap import CommonKVBootstrapServer
from sglang.srt.disaggregation.common.bootstrap_client import BootstrapClient
from sglang.srt.disaggregation.common.compat import PeerInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")


def record(tp_rank: int, tp_size: int = 2, page_size: int = 4) -> dict:
    pool = MHATokenToKVPool(16, page_size, torch.float16, 2, 8, 2)
    args = KVArgs.from_pools(pool, engine_rank=tp_rank, tp_rank=tp_rank, tp_size=tp_size, total_kv_head_num=4)
    return {"engine_rank": tp_rank, "tp_rank": tp_rank, "ip": "127.0.0.1", "port": 5000 + tp_rank,
            "agent_name": f"prefill-{tp_rank}", "peer": PeerInfo.from_kv_args(args).to_json()}


@pytest.fixture()
def server():
    srv = CommonKVBootstrapServer()
    yield srv
    srv.close()


def raw(server, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server.addr}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_lookup_waits_until_every_rank_registered(server):
    client = BootstrapClient(server.addr)
    assert raw(server, "GET", "/health") == (200, "OK")
    assert client.parallel_info() is None
    client.register_rank(record(1))
    assert client.parallel_info() is None and client.rank_record(0) is None
    assert raw(server, "GET", "/route") == (503, "1 of 2 prefill ranks registered")
    client.register_rank(record(0))
    info = client.parallel_info()
    assert info["tp_size"] == 2 and info["ranks"] == [0, 1]
    assert client.rank_record(1)["agent_name"] == "prefill-1"


def test_mismatched_rank_refused_naming_both_values(server):
    client = BootstrapClient(server.addr)
    client.register_rank(record(0))
    with pytest.raises(IncompatiblePeerError, match="page_size: this rank 8 vs registered 4"):
        client.register_rank(record(1, page_size=8))
    assert client.parallel_info() is None  # the refused rank is not counted


def test_duplicate_engine_rank_refused(server):
    client = BootstrapClient(server.addr)
    client.register_rank(record(0))
    with pytest.raises(IncompatiblePeerError, match="tp_rank 1 claims engine_rank 0, already held by tp_rank 0"):
        client.register_rank(dict(record(1), engine_rank=0))
    client.register_rank(record(0))  # a restarted rank may register again


@pytest.mark.parametrize("body,match", [
    (b"{not json", "Expecting property name"),
    (json.dumps({"tp_rank": 0}).encode(), "field 'engine_rank' must be int"),
    (json.dumps(dict(record(0), tp_rank=5)).encode(), "tp_rank 5 outside"),
    (json.dumps(dict(record(0), peer={"tp_size": 2})).encode(), "peer info lacks field 'page_size'"),
])
def test_bad_registrations_get_400_and_server_keeps_serving(server, body, match):
    code, text = raw(server, "PUT", "/route", body)
    assert code == 400 and match in text
    BootstrapClient(server.addr).register_rank(record(0))  # still serving


def test_unknown_routes_and_bad_queries(server):
    assert raw(server, "GET", "/nope")[0] == 404
    assert raw(server, "PUT", "/nope", b"{}")[0] == 404
    assert raw(server, "GET", "/route?tp_rank=abc") == (400, "tp_rank must be an int, got 'abc'")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
