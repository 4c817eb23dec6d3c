"""A rank killed mid-transfer: the survivor's request becomes Failed within the heartbeat
timeout, its pages go back to the allocator, and no process hangs.

Prefill sends the first chunk, pauses; decode reports that the chunk arrived; then one side is
SIGKILLed. The survivor is judged on its own report (state, reason, time, free pages).
"""

import time

import pytest

from mp_harness import Cluster
from sglang.srt.disaggregation.base import KVPoll
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="nightly-cpu")

HB_TIMEOUT = 3.0
SLACK = 20.0  # generous: tells the heartbeat (HB_TIMEOUT) apart from a hang, not how fast it fired


def _start_mid_transfer(cluster: Cluster) -> None:
    cluster.wait_for({("paused", 0), ("progress", 0)}, timeout=60)


def test_prefill_killed_mid_transfer_fails_decode_and_frees_pages():
    with Cluster({"pause_after_chunks": 1, "hb_timeout": HB_TIMEOUT}, 1, 1) as cluster:
        _start_mid_transfer(cluster)
        killed_at = time.monotonic()
        cluster.kill("prefill", 0)
        cluster.wait_for({("decode", 0)}, timeout=HB_TIMEOUT + 30)
        rep = cluster.reports[("decode", 0)]
    assert rep["state"] == KVPoll.Failed
    assert "prefill peer lost" in rep["failure"], rep["failure"]
    assert rep["t_end"] - killed_at < HB_TIMEOUT + SLACK
    assert rep["available"] == 64, "decode pages were not returned to the allocator"
    assert rep["active_rooms"] == 0


def test_decode_killed_mid_transfer_fails_prefill_and_frees_pages():
    with Cluster({"pause_after_chunks": 1, "hb_timeout": HB_TIMEOUT}, 1, 1) as cluster:
        _start_mid_transfer(cluster)
        killed_at = time.monotonic()
        cluster.kill("decode", 0)
        cluster.command("prefill", 0, "go")  # prefill tries to send the rest to a dead peer
        cluster.wait_for({("prefill", 0)}, timeout=HB_TIMEOUT + 30)
        rep = cluster.reports[("prefill", 0)]
    assert rep["state"] == KVPoll.Failed, rep
    assert rep["failure"], "a failed request must say why"
    assert rep["t_fail"] - killed_at < HB_TIMEOUT + SLACK
    assert rep["available"] == 64, "prefill pages were not returned to the allocator"
    assert rep["active_rooms"] == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
