"""scripts/bench/soak.py end to end for half a minute: the real deployment (reference server,
HiCache server with file L3 behind the router, PD pair behind the PD router), every fault kind
scheduled early, two windows. It must exit 0 and print both window lines with no mismatch and
no leaked slot, and the fault log must name every fault."""

import os
import re
import subprocess
import sys

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT

register_cpu_ci(est_time=120, suite="nightly-cpu")

SOAK = os.path.join(REPO_ROOT, "scripts", "bench", "soak.py")
FAULTS = ["l3_read_only", "l3_writable", "l3_corrupt", "l3_remove_recreate", "decode_kill_restart"]


def test_short_soak_exits_0_and_prints_each_window(tmp_path):
    cmd = [sys.executable, SOAK, "--minutes", "0.5", "--window-minutes", "0.25", "--first-fault-s", "2",
           "--fault-gap-s", "2", "--faults", ",".join(FAULTS), "--workers", "3", "--request-timeout", "60",
           "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    windows = re.findall(r"^window (\d+): ok (\d+) failed \d+ aborted \d+ .*\| mismatches (\d+) .*"
                         r"\| leaked slots (.*?) \| .*scheduler RSS MiB .*TTFT p50 .*ITL p50", proc.stdout, re.M)
    assert [int(w[0]) for w in windows] == [1, 2], out[-4000:]
    assert sum(int(w[1]) for w in windows) > 0, out[-4000:]
    for _, _, mismatches, leaks in windows:
        assert mismatches == "0", out[-4000:]
        assert re.fullmatch(r"(\w+=0 ?)+", leaks), out[-4000:]
    fault_line = next(line for line in proc.stdout.splitlines() if line.startswith("faults: "))
    for name in FAULTS:
        assert name in fault_line, fault_line
    assert "FAILED" not in fault_line, fault_line
    assert "soak passed" in proc.stdout, out[-4000:]
