"""bench_pd_transfer.py --backend mooncake runs end to end (real rank processes, Mooncake's
transfer engine on TCP): the PD path and the raw engine baselines move the same bytes, and the
raw baselines post more ranges than one Mooncake batch takes (split as the transport splits)."""

import json
import os
import subprocess
import sys

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT

register_cpu_ci(est_time=20, suite="nightly-cpu")


def test_bench_runs_with_mooncake(tmp_path):
    out = tmp_path / "pd.json"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "bench", "bench_pd_transfer.py"), "--backend",
           "mooncake", "--tokens", "2048", "--page-size", "1", "--layers", "2", "--cases", "1x1x2,2x1x2",
           "--iters", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = json.loads(out.read_text())
    assert [(r["prefill_tp"], r["decode_tp"]) for r in records] == [(1, 1), (2, 1)]
    for rec in records:
        assert rec["backend"] == "mooncake" and rec["descriptors_per_pair"] > 1024
        assert rec["gbps"] > 0 and rec["baseline_gbps"] > 0 and rec["raw_pages_gbps"] > 0
