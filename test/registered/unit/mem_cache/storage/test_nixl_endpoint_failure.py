"""NIXL OBJ against an S3 endpoint that dies and comes back (moto_server, killed and restarted on
the same port): exists, get and set miss within ``transfer_timeout_s`` instead of waiting out the
S3 SDK's retries, and the same backend hits again once the endpoint answers, without a restart."""

import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import fill_random, host_pool, obj_extra, page_keys, pages_of, slots, storage_config

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="per-commit-cpu")

TIMEOUT_S = 1.0
# What "within the bound" allows: the timeout plus ample process noise on 2 shared cores. A call that
# waited for the SDK's retries takes ~25 s per object.
BOUND_S = TIMEOUT_S + 10.0  # generous: only tells a timed-out call from one that waited out the retries


class Moto:
    """A moto_server that the test can kill and restart on one port."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def moto():
    server = Moto()
    server.start()
    try:
        yield server
    finally:
        server.kill()


def timed(fn):
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def test_dead_endpoint_misses_within_the_bound_then_recovers(moto):
    host = host_pool(PoolKind.MHA, "layer_first")
    fill_random(host, seed=3)
    extra = {**obj_extra(moto.endpoint, bucket="hicache-failover"), "transfer_timeout_s": TIMEOUT_S}
    store = StorageBackendFactory.create_backend("nixl", storage_config(host, extra), host)
    try:
        keys = page_keys(6)
        assert store.batch_set_v1(keys[:4], slots(host, 0, 4)) == [True] * 4
        assert store.batch_exists(keys) == 4
        moto.kill()

        hit, took = timed(lambda: store.batch_exists(keys))
        assert hit == 0 and took < BOUND_S, took
        flags, took = timed(lambda: store.batch_get_v1(keys[:4], slots(host, 8, 4)))
        assert flags == [False] * 4 and took < BOUND_S, took
        assert all(int(p.count_nonzero()) == 0 for p in pages_of(host, 8, 4))  # nothing unverified kept
        flags, took = timed(lambda: store.batch_set_v1(keys[4:], slots(host, 4, 2)))
        assert flags == [False, False] and took < BOUND_S, took
        stats = store.get_stats()
        assert stats["timeouts"] >= 3 and stats["pages_hit"] == 0 and stats["corruptions"] == 0

        moto.start()  # the same port; moto keeps no state, so recreate the bucket and one page
        extra_again = obj_extra(moto.endpoint, bucket="hicache-failover")
        assert extra_again["plugin_params"]["bucket"] == "hicache-failover"
        deadline = time.monotonic() + 120  # the overdue SDK call ends at its next retry
        while store.batch_set_v1(keys[:2], slots(host, 0, 2)) != [True, True]:
            assert time.monotonic() < deadline, "the backend did not recover after the endpoint returned"
            time.sleep(0.5)
        assert store.batch_exists(keys) == 2
        assert store.batch_get_v1(keys[:2], slots(host, 8, 2)) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(pages_of(host, 8, 2), pages_of(host, 0, 2)))
    finally:
        store.close()
