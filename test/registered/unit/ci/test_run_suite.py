"""test/run_suite.py: registrations are read with ast; bad ones are refused with the file named."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="per-commit-cpu")

ROOT = Path(__file__).resolve().parents[4]  # the repository
sys.path.insert(0, str(ROOT / "test"))
import run_suite  # noqa: E402


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text("from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci\n" + body)
    return path


def test_reads_registrations_without_importing(tmp_path):
    write(tmp_path, "test_a.py", 'register_cpu_ci(est_time=3, suite="per-commit-cpu")\nraise SystemExit("imported")\n')
    write(tmp_path, "test_b.py", 'register_cpu_ci(est_time=5, suite="nightly-cpu")\nregister_cuda_ci(est_time=7, suite="per-commit-1-gpu")\n')
    regs = run_suite.collect(tmp_path)
    got = sorted((r.path.name, r.hw, r.suite, r.est_time) for r in regs)
    assert got == [
        ("test_a.py", "cpu", "per-commit-cpu", 3.0),
        ("test_b.py", "cpu", "nightly-cpu", 5.0),
        ("test_b.py", "cuda", "per-commit-1-gpu", 7.0),
    ]
    assert [r.path.name for r in run_suite.select(regs, "cpu", "per-commit-cpu")] == ["test_a.py"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("def test_x():\n    pass\n", "is not registered"),
        ('register_cpu_ci(est_time=3, suite="per-commit-gpu")\n', "unknown cpu suite 'per-commit-gpu'; known: per-commit-cpu"),
        ('SUITE = "per-commit-cpu"\nregister_cpu_ci(est_time=3, suite=SUITE)\n', "'suite' of register_cpu_ci() must be a literal"),
        ('register_cpu_ci(suite="per-commit-cpu")\n', "needs est_time="),
        ('register_cpu_ci(3, "per-commit-cpu", False, None, 1)\n', "at most 4 positional arguments"),
        ('register_cpu_ci(3, "per-commit-cpu", est_time=4)\n', "'est_time' both by position and by keyword"),
        ('register_cpu_ci(est_time=1, suite="per-commit-cpu")\nregister_cpu_ci(est_time=1, suite="nightly-cpu")\n',
         "more than one registration"),
    ],
)
def test_bad_registration_names_the_file(tmp_path, body, fragment):
    path = write(tmp_path, "test_bad.py", body)
    with pytest.raises(run_suite.RegistrationError) as err:
        run_suite.collect(tmp_path)
    assert fragment in str(err.value) and str(path) in str(err.value)


def test_unknown_suite_is_refused_on_the_command_line():
    res = subprocess.run(
        [sys.executable, str(ROOT / "test" / "run_suite.py"), "--hw", "cpu", "--suite", "per-commit-gpu", "--list"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2
    assert "unknown suite 'per-commit-gpu' for --hw cpu; known: per-commit-cpu, nightly-cpu" in res.stderr


def test_run_prints_a_summary_and_fails_on_a_failing_file(tmp_path):
    ok = write(tmp_path, "test_ok.py", 'register_cpu_ci(est_time=1, suite="per-commit-cpu")\ndef test_ok():\n    assert True\n')
    bad = write(tmp_path, "test_bad.py", 'register_cpu_ci(est_time=1, suite="per-commit-cpu")\ndef test_bad():\n    assert False\n')
    regs = [r for p in (ok, bad) for r in run_suite.read_registrations(p)]
    rc = run_suite.run(regs, "cpu", 120, [])
    assert rc == 1


def run_files(tmp_path, capsys, bodies: dict, *args, **kwargs):
    paths = [write(tmp_path, name, 'register_cpu_ci(est_time=1, suite="per-commit-cpu")\n' + body)
             for name, body in bodies.items()]
    regs = [r for p in paths for r in run_suite.read_registrations(p)]
    rc = run_suite.run(regs, "cpu", kwargs.pop("timeout", 120), list(args), **kwargs)
    return rc, capsys.readouterr().out


def test_exit_5_is_a_skip_only_when_every_test_was_skipped(tmp_path, capsys):
    rc, out = run_files(tmp_path, capsys, {
        "test_cuda_only.py": 'import pytest\npytest.skip("needs CUDA", allow_module_level=True)\n',
    })
    assert rc == 0 and "SKIP " in out and "every test skipped" in out and "0 passed, 1 skipped" in out
    rc, out = run_files(tmp_path, capsys, {"test_nothing.py": "X = 1\n"})
    assert rc == 1 and "collected no tests" in out and "FAILED" in out


def test_exit_5_after_a_selection_given_here_is_not_a_failure(tmp_path, capsys):
    body = "def test_alpha():\n    pass\n"
    rc, out = run_files(tmp_path, capsys, {"test_a.py": body}, "-k", "beta")
    assert rc == 0 and "no test selected" in out
    rc, out = run_files(tmp_path, capsys, {"test_a.py": body}, "-k", "alpha")
    assert rc == 0 and "1 passed" in out


def test_summary_lists_every_file_time_and_the_total(tmp_path, capsys):
    rc, out = run_files(tmp_path, capsys, {"test_one.py": "def test_x():\n    pass\n",
                                           "test_two.py": "def test_y():\n    pass\n"}, budget_s=1e-3)
    assert rc == 0
    table = out[out.index("per-file times"):]
    assert "test_one.py" in table and "test_two.py" in table and "total: " in table
    assert "over its 0s budget" in out  # a warning, not a failure


def test_a_file_past_its_timeout_is_killed_with_its_children(tmp_path, capsys):
    marker = tmp_path / "child.pid"
    body = textwrap.dedent(f"""
        import subprocess, sys, time
        def test_hangs():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            open({str(marker)!r}, "w").write(str(child.pid))
            time.sleep(300)
    """)
    rc, out = run_files(tmp_path, capsys, {"test_hang.py": body}, timeout=5)
    assert rc == 1 and "TIMEOUT" in out and "1 timed out" in out
    pid = int(marker.read_text())
    deadline = time.monotonic() + 30
    while is_running(pid):
        assert time.monotonic() < deadline, f"the hung file's child {pid} survived its timeout"
        time.sleep(0.05)


def is_running(pid: int) -> bool:
    """False once ``pid`` is gone or a zombie (an init that does not reap leaves zombies)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


HYPOTHESIS_BODY = """
from hypothesis import given, settings, strategies as st
SEEN = []
@settings(max_examples=5, database=None)
@given(st.integers(0, 10**12))
def test_draws(x):
    SEEN.append(x)
def test_zz_record():
    open({out!r}, "a").write(repr(SEEN) + "\\n")
"""


def test_one_hypothesis_seed_per_run_is_printed_and_replays(tmp_path, capsys):
    out_file = tmp_path / "draws.txt"
    files = {"test_h.py": HYPOTHESIS_BODY.format(out=str(out_file))}
    for seed in (1234, 1234, 99):
        rc, out = run_files(tmp_path, capsys, files, seed=seed)
        assert rc == 0 and f"hypothesis seed: {seed}" in out
    first, again, other = out_file.read_text().splitlines()
    assert first == again and first != other


def test_seed_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_HYPOTHESIS_SEED", "77")
    assert run_suite.hypothesis_seed(5) == 5
    assert run_suite.hypothesis_seed(None) == 77
    monkeypatch.delenv("SGLANG_HYPOTHESIS_SEED")
    assert 0 <= run_suite.hypothesis_seed(None) < 2**32
