"""test/run_suite.py: registrations are read with ast; bad ones are refused with the file named."""

import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

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
        ('register_cpu_ci(3, "per-commit-cpu")\n', "keyword arguments only"),
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
