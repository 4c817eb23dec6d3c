"""The Mooncake transport under the PD layer, between separate processes on 127.0.0.1 (TCP):
the same rank processes and checks as test_nixl_transfer_mp.py / test_nixl_failures_mp.py, with
``--disaggregation-transfer-backend mooncake``'s classes.

Prefill TP 2 -> decode TP 1 (MHA with Mamba state): each prefill rank's heads land in decode's
pool (through decode staging, scattered as each chunk's NOTIF arrives), aux and state rows
exactly, nothing else touched. Then a decode rank SIGKILLed mid-room: prefill's room fails
within the heartbeat bound (never a hang) and its pages go back.
"""

import time

from mp_harness import Cluster
from sglang.srt.disaggregation.base import KVPoll
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="per-commit-cpu")

MOONCAKE = {"backend": "mooncake", "transfer_timeout": 6.0}
HB_TIMEOUT = 3.0
SLACK = 20.0  # tells the heartbeat bound apart from a hang, not how fast it fired


def test_tp2_to_tp1_heads_state_and_aux_land_exactly():
    with Cluster({**MOONCAKE, "heads": 4, "state_rows": 8}, 2, 1) as cluster:
        reports = cluster.all_reports(timeout=90)
    rep = reports[("decode", 0)]
    assert rep["state"] == KVPoll.Success, rep["failure"]
    assert rep["errors"] == [], rep["errors"]
    assert rep["active_rooms"] == 0
    for r in range(2):
        assert reports[("prefill", r)]["state"] == KVPoll.Success, reports[("prefill", r)]["failure"]
        assert reports[("prefill", r)]["active_rooms"] == 0


def test_decode_killed_mid_room_fails_prefill_within_the_bound():
    with Cluster({**MOONCAKE, "pause_after_chunks": 1, "hb_timeout": HB_TIMEOUT}, 1, 1) as cluster:
        cluster.wait_for({("paused", 0), ("progress", 0)}, timeout=60)  # chunk 1 landed and was filed
        killed_at = time.monotonic()
        cluster.kill("decode", 0)
        cluster.command("prefill", 0, "go")  # the rest goes to a dead peer
        cluster.wait_for({("prefill", 0)}, timeout=HB_TIMEOUT + 30)
        rep = cluster.reports[("prefill", 0)]
    assert rep["state"] == KVPoll.Failed, rep
    assert rep["failure"], "a failed room must say why"
    assert rep["t_fail"] - killed_at < HB_TIMEOUT + SLACK
    assert rep["available"] == 64, "prefill pages were not returned to the allocator"
    assert rep["active_rooms"] == 0


if __name__ == "__main__":
    import pytest

    raise SystemExit(pytest.main([__file__, "-q"]))
