"""A process that exits while a worker lane is copying waits for the lane: the job completes and
the process exits cleanly (a daemon thread frozen inside torch's C++ code aborted it before)."""

import subprocess
import sys
import textwrap

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

SCRIPT = textwrap.dedent("""
    import sys, threading, torch
    from sglang.srt.mem_cache.controller.transfer_lane import ThreadLane
    started = threading.Event()
    src, dst = torch.randn(2048, 2048), torch.empty(2048, 2048)

    def job():
        started.set()
        for _ in range(40):  # native copies that release the GIL, well past the main thread's exit
            dst.copy_(src)
        open(sys.argv[1], "w").write("done")

    lane = ThreadLane("exit-test")
    lane.submit(job, [])
    started.wait(30)
""")


def test_exit_waits_for_the_running_lane_job(tmp_path):
    marker = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.read_text() == "done", "the interpreter exited before the lane finished its job"
