"""The control plane under load: bench_scheduler_overhead runs end to end at a tiny size, and a
scheduler whose waiting requests are short of memory only because host writes hold it locked
waits for those writes within the step instead of returning with nothing done (a spin)."""

import importlib.util
import json
import threading
from pathlib import Path

import pytest
from scheduler_fixtures import make_scheduler, prompts, request

from sglang.srt.mem_cache.controller.transfer_lane import CpuEvent
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=6, suite="per-commit-cpu")

BENCH = Path(__file__).resolve().parents[4] / "scripts" / "bench" / "bench_scheduler_overhead.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_scheduler_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_runs_at_a_tiny_size(model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    records = load_bench().main(["--waiting", "3,6", "--prompt-len", "64", "--steps", "6", "--warmup", "2",
                                 "--page-size", "4", "--chunked-prefill-size", "32", "--check",
                                 "--model", model, "--json", str(out)])
    assert json.loads(out.read_text()) == records
    assert [(r["waiting"], r["prompt_len"], r["hicache"]) for r in records] == [
        (3, 64, False), (3, 64, True), (6, 64, False), (6, 64, True)]
    for r in records:
        assert r["steps"] == 6 and r["mean_ms"] > 0 and r["p50_ms"] > 0 and r["thread_cpu_ms"] > 0
    for off, on in zip(records[::2], records[1::2]):
        assert on["on_off_ratio"] == pytest.approx(on["mean_ms"] / off["mean_ms"])
    printed = capsys.readouterr().out
    assert "on/off" in printed and len([line for line in printed.splitlines() if line.split()[:2] == ["6", "64"]]) == 1
    # null copies: the HiCache bookkeeping runs and every backup is still acknowledged
    off, on = load_bench().main(["--waiting", "4", "--prompt-len", "64", "--steps", "12", "--warmup", "2",
                                 "--page-size", "4", "--chunked-prefill-size", "32", "--repeat", "1",
                                 "--null-copies", "--check", "--model", model])
    assert (off["hicache"], on["hicache"]) == (False, True) and on["steps"] == off["steps"] == 12
    assert on["finished"] > 0 and off["finished"] > 0


def test_instruction_bench_runs_its_counted_workload_in_both_modes(model, monkeypatch):
    """bench_step_instructions' child (what valgrind runs) drives the same workload, off and on;
    the valgrind wrapper itself needs valgrind, which CI machines do not have."""
    from sglang.srt.mem_cache.controller import transfer_lane

    monkeypatch.setattr(transfer_lane, "INLINE_MAX_S", transfer_lane.INLINE_MAX_S)  # the child raises it
    path = BENCH.with_name("bench_step_instructions.py")
    spec = importlib.util.spec_from_file_location("bench_step_instructions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for mode in ("off", "on"):
        assert module.main(["--child", mode, "--model-dir", model, "--waiting", "3", "--prompt-len", "64",
                            "--steps", "8", "--warmup", "2"]) == {}
    assert transfer_lane.INLINE_MAX_S == 1.0  # the counted run keeps a native run's inline copy path


def test_step_waits_for_host_writes_holding_the_memory(model):
    sched = make_scheduler(model, page_size=4, max_total_tokens=64, enable_hierarchical_cache=True,
                           hicache_ratio=4)
    lane = sched.tree_cache.cache_controller.write_lane
    gate, started = threading.Event(), CpuEvent(armed=True)
    lane.submit(lambda: gate.wait(30), [started])  # holds back every write queued after it
    first, second = prompts(2, 40, seed=21)
    sched.handle_messages([request("a", first, max_new=1)])
    sched.step()  # "a" is computed, finishes, and its 40 tokens are queued for backup (locked)
    writes_of_a = set(sched.tree_cache.ongoing_write_through)
    assert sched.stats.counters.num_requests == 1 and writes_of_a
    sched.handle_messages([request("b", second, max_new=1)])
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    try:
        sched.step()  # "b" needs the locked 40 tokens: the step waits for the write, then admits
    finally:
        gate.set()
        timer.cancel()
    c = sched.stats.counters
    assert c.num_prefill_batches == 2 and c.num_requests == 2 and not sched.waiting
    assert not writes_of_a & set(sched.tree_cache.ongoing_write_through)  # acknowledged within the step
    sched.check_integrity()
    sched.shutdown()
