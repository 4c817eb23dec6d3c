"""Real transfers between separate processes over UCX on loopback, one process per rank.

Each decode rank must end up with exactly the bytes of the heads it owns (values are a function
of the GLOBAL head), at scattered destination pages, sent in two chunks; slots outside the
destination pages stay untouched; aux comes from the first target only; Mamba state rows are
sliced by TP shard. With the default staging, 2->1 travels through decode staging and 1->2
through a prefill gather; the per-token route is covered in-process by test_nixl_hetero.py.
"""

import pytest

from mp_harness import Cluster
from sglang.srt.disaggregation.base import KVPoll
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="nightly-cpu")


def _check_success(reports: dict, prefill_tp: int, decode_tp: int, cfg_pages: int = 7) -> None:
    for r in range(decode_tp):
        rep = reports[("decode", r)]
        assert rep["state"] == KVPoll.Success, f"decode {r}: {rep['failure']}"
        assert rep["errors"] == [], f"decode {r}: {rep['errors']}"
        assert rep["active_rooms"] == 0
        assert rep["available"] == 64 - cfg_pages * 4  # the request still holds its pages
    for r in range(prefill_tp):
        rep = reports[("prefill", r)]
        assert rep["state"] == KVPoll.Success, f"prefill {r}: {rep['failure']}"
        assert rep["active_rooms"] == 0


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,cfg",
    [
        pytest.param(2, 1, {"heads": 4, "state_rows": 8}, id="tp2-to-tp1-mha-state"),
        pytest.param(1, 2, {"heads": 4, "state_rows": 8}, id="tp1-to-tp2-mha-state"),
        pytest.param(4, 2, {"heads": 2}, id="tp4-to-tp2-gqa-replicated"),
        pytest.param(2, 1, {"mla": True, "head_dim": 6}, id="mla-tp2-to-tp1"),
    ],
)
def test_real_transfer(prefill_tp, decode_tp, cfg):
    with Cluster(cfg, prefill_tp, decode_tp) as cluster:
        reports = cluster.all_reports(timeout=90)
    _check_success(reports, prefill_tp, decode_tp)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
