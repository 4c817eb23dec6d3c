"""The upstream test harness: CustomTestCase's retries, the register_* markers' upstream
signature, and run_suite.py reading an upstream-style test file and running it unchanged."""

import inspect
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path

import pytest

from sglang.test import test_utils
from sglang.test.ci import ci_register
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, is_in_amd_ci, is_in_ci, max_test_retries

register_cpu_ci(est_time=12, suite="per-commit-cpu")

ROOT = Path(__file__).resolve().parents[4]  # the repository
sys.path.insert(0, str(ROOT / "test"))
import run_suite  # noqa: E402


class Scripted(CustomTestCase):
    """Each attempt of test_it takes the next outcome from ``script``; the last one repeats."""

    __test__ = False  # run by the tests below, not collected
    retry_delay_s = 0.0
    script: list = []

    def setUp(self):
        self.setups += 1

    def test_it(self):
        self.attempts += 1
        outcome = self.script[min(self.attempts, len(self.script)) - 1]
        if outcome == "fail":
            self.fail(f"scripted failure {self.attempts}")
        if outcome == "skip":
            self.skipTest("scripted skip")


def run_scripted(script, **attrs):
    case = type("Case", (Scripted,), {"script": script, "attempts": 0, "setups": 0, **attrs})("test_it")
    result = unittest.TestResult()
    case.run(result)
    return case, result


@pytest.mark.parametrize(
    "env, script, attempts, passed",
    [
        ({}, ["fail", "pass"], 1, False),  # no retry by default
        ({"SGLANG_IS_IN_CI": "1"}, ["fail", "pass"], 1, False),  # nor in CI (upstream retries once there)
        ({"SGLANG_TEST_MAX_RETRY": ""}, ["fail", "pass"], 1, False),
        ({"SGLANG_TEST_MAX_RETRY": "2"}, ["fail", "fail", "pass"], 3, True),
        ({"SGLANG_TEST_MAX_RETRY": "5"}, ["pass"], 1, True),
        ({"SGLANG_TEST_MAX_RETRY": "1"}, ["fail"], 2, False),
    ],
)
def test_a_failing_method_runs_again_only_as_often_as_the_env_var_says(monkeypatch, env, script, attempts, passed):
    for name in ("SGLANG_TEST_MAX_RETRY", "SGLANG_IS_IN_CI"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    case, result = run_scripted(script)
    assert case.attempts == attempts and case.setups == 1
    assert result.wasSuccessful() is passed and not result.errors
    if not passed:  # the test's own assertion from its last attempt, still a failure
        assert len(result.failures) == 1 and f"scripted failure {attempts}" in result.failures[0][1]


def test_a_skip_is_never_retried(monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_MAX_RETRY", "3")
    case, result = run_scripted(["skip"])
    assert case.attempts == 1 and len(result.skipped) == 1 and result.wasSuccessful()


def test_retries_back_off_doubling_up_to_a_minute(monkeypatch):
    slept = []
    monkeypatch.setattr(test_utils.time, "sleep", slept.append)
    monkeypatch.setenv("SGLANG_TEST_MAX_RETRY", "4")
    case, result = run_scripted(["fail"], retry_delay_s=20.0)
    assert case.attempts == 5 and len(result.failures) == 1
    assert slept == [20.0, 40.0, 60.0, 60.0]


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_retry_count_is_refused_with_the_variable_named(monkeypatch, value):
    monkeypatch.setenv("SGLANG_TEST_MAX_RETRY", value)
    with pytest.raises(ValueError, match=f"SGLANG_TEST_MAX_RETRY='{value}': expected a whole number >= 0"):
        max_test_retries()


def test_ci_flags_read_upstream_variables(monkeypatch):
    for name in ("SGLANG_IS_IN_CI", "SGLANG_IS_IN_CI_AMD"):
        monkeypatch.delenv(name, raising=False)
    assert not is_in_ci() and not is_in_amd_ci()
    monkeypatch.setenv("SGLANG_IS_IN_CI", "true")
    monkeypatch.setenv("SGLANG_IS_IN_CI_AMD", "0")
    assert is_in_ci() and not is_in_amd_ci()


def test_upstream_only_names_fail_to_import_with_what_to_use_instead():
    with pytest.raises(ImportError, match="make_tiny_model"):
        from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST  # noqa: F401
    with pytest.raises(ImportError, match="launch_server_process"):
        from sglang.test.test_utils import popen_launch_server  # noqa: F401
    assert not hasattr(test_utils, "no_such_name")


def test_importing_the_harness_is_cheap_and_the_kernel_stub_serves_mocks():
    code = textwrap.dedent("""
        import sys
        from sglang.test.test_utils import maybe_stub_sgl_kernel
        heavy = sorted(m for m in ("torch", "requests", "aiohttp", "numpy") if m in sys.modules)
        maybe_stub_sgl_kernel(); maybe_stub_sgl_kernel()
        from sgl_kernel.kvcacheio import transfer_kv_all_layer
        import sgl_kernel
        print(heavy, type(transfer_kv_all_layer).__name__, type(sgl_kernel.anything).__name__,
              sum(type(f).__name__ == "_StubKernelFinder" for f in sys.meta_path))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]", "MagicMock", "MagicMock", "1"]


UPSTREAM_KEYWORDS = ("est_time", "suite", "nightly", "disabled", "stage", "runner_config", "in_process_group")


@pytest.mark.parametrize("hw", ["cpu", "cuda", "amd", "npu", "xpu", "musa", "mlx"])
def test_every_marker_has_upstreams_signature_and_does_nothing(hw):
    marker = getattr(ci_register, f"register_{hw}_ci")
    assert marker.__name__ == f"register_{hw}_ci" and ci_register.REGISTER_FUNCS[marker.__name__] == hw
    params = inspect.signature(marker).parameters
    assert tuple(params) == UPSTREAM_KEYWORDS
    assert [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY] == ["stage", "runner_config", "in_process_group"]
    assert marker(est_time=1, stage="base-b", runner_config="1-gpu-small", in_process_group="g") is None
    assert marker(5, "base-a-test-cpu", True, "flaky") is None


IMPORTS = "from sglang.test.ci.ci_register import register_amd_ci, register_cpu_ci, register_cuda_ci, register_npu_ci\n"


def write(tmp_path, name, body, header=IMPORTS):
    path = tmp_path / name
    path.write_text(header + textwrap.dedent(body))
    return path


def test_upstream_registrations_map_onto_our_suites_and_other_hardware_is_never_selected(tmp_path):
    write(tmp_path, "test_pair.py", """
        register_cuda_ci(est_time=15, stage="base-b", runner_config="1-gpu-small")
        register_amd_ci(est_time=15, stage="stage-b", runner_config="1-gpu-small-amd")
    """)
    write(tmp_path, "test_cpu.py", """
        register_cpu_ci(est_time=5, suite="base-a-test-cpu", in_process_group="mem_cache")
        register_cuda_ci(est_time=60, suite="nightly-1-gpu", nightly=True, disabled="needs a model")
    """)
    write(tmp_path, "test_large.py", 'register_cuda_ci(est_time=9, suite="stage-b-test-large-2-gpu")\n')
    write(tmp_path, "test_positional.py", 'register_cpu_ci(4, "stage-a-test-cpu", False, "flaky upstream")\n')
    write(tmp_path, "test_amd_only.py", """
        register_amd_ci(est_time=5, suite="stage-b-test-1-gpu-small-amd")
        register_npu_ci(est_time=400, suite="stage-b-test-2-npu-a3", nightly=False)
        register_npu_ci(est_time=400, suite="nightly-2-npu-a3", nightly=True)
    """)
    regs = run_suite.collect(tmp_path)
    got = sorted((r.path.name, r.hw, r.suite, r.disabled) for r in regs)
    assert got == [
        ("test_amd_only.py", "amd", "stage-b-test-1-gpu-small-amd", None),
        ("test_amd_only.py", "npu", "nightly-2-npu-a3", None),
        ("test_amd_only.py", "npu", "stage-b-test-2-npu-a3", None),
        ("test_cpu.py", "cpu", "per-commit-cpu", None),
        ("test_cpu.py", "cuda", "nightly-1-gpu", "needs a model"),
        ("test_large.py", "cuda", "per-commit-2-gpu", None),
        ("test_pair.py", "amd", "stage-b-test-1-gpu-small-amd", None),
        ("test_pair.py", "cuda", "per-commit-1-gpu", None),
        ("test_positional.py", "cpu", "per-commit-cpu", "flaky upstream"),
    ]
    selected = {(hw, suite): [r.path.name for r in run_suite.select(regs, hw, suite)]
                for hw, suites in ci_register.SUITES_BY_HW.items() for suite in suites}
    assert selected == {
        ("cpu", "per-commit-cpu"): ["test_cpu.py", "test_positional.py"], ("cpu", "nightly-cpu"): [],
        ("cuda", "per-commit-1-gpu"): ["test_pair.py"], ("cuda", "per-commit-2-gpu"): ["test_large.py"],
        ("cuda", "nightly-1-gpu"): ["test_cpu.py"],
    }


@pytest.mark.parametrize(
    "call, fragment",
    [
        ('register_cuda_ci(est_time=1, suite="base-c-test-8-gpu-h200")',
         "unknown cuda suite 'base-c-test-8-gpu-h200'; known: per-commit-1-gpu, per-commit-2-gpu, nightly-1-gpu "
         "(upstream names accepted: base-a-test-1-gpu-small,"),
        ('register_cpu_ci(est_time=1, suite="base-b-test-cpu-arm64")', "unknown cpu suite 'base-b-test-cpu-arm64'"),
        ('register_cpu_ci(est_time=1, suite="base-a-test-cpu", nightly=True)',
         "nightly=True but cpu suite 'base-a-test-cpu' is per-commit here (per-commit-cpu)"),
        ('register_cuda_ci(est_time=1, stage="base-b")', "needs either suite= or both of stage= and runner_config="),
        ('register_cuda_ci(est_time=1, suite="nightly-1-gpu", stage="base-b", runner_config="1-gpu-small")',
         "needs either suite= or both of stage="),
        ('register_amd_ci(est_time=1)', "register_amd_ci() needs either suite="),
        ('register_cpu_ci(est_time=1, suite="base-a-test-cpu", partition=2)',
         "unknown argument 'partition' of register_cpu_ci(); known: est_time, suite, nightly, disabled, stage,"),
        ('register_cpu_ci(est_time="fast", suite="base-a-test-cpu")',
         "argument 'est_time' of register_cpu_ci() has the wrong type"),
        ('register_cpu_ci(est_time=1, suite="base-a-test-cpu", nightly="yes")',
         "argument 'nightly' of register_cpu_ci() has the wrong type"),
        ('register_amd_ci(est_time=1, suite=AMD_SUITE)', "argument 'suite' of register_amd_ci() must be a literal"),
    ],
)
def test_an_upstream_registration_we_cannot_honour_is_refused_with_the_file_named(tmp_path, call, fragment):
    path = write(tmp_path, "test_bad.py", call + "\n")
    with pytest.raises(run_suite.RegistrationError) as err:
        run_suite.collect(tmp_path)
    assert fragment in str(err.value) and str(path) in str(err.value)


# A contributor's upstream-style file, as upstream writes it: a CustomTestCase, AMD registration
# beside ours, an upstream suite name, unittest's main guard.
CONTRIBUTED = """
from sglang.test.ci.ci_register import register_amd_ci, register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")
register_amd_ci(est_time=2, suite="stage-b-test-1-gpu-small-amd")

import unittest

from sglang.test.test_utils import CustomTestCase, is_in_ci


class TestContributed(CustomTestCase):
    attempts = 0

    def test_flaky_once(self):
        type(self).attempts += 1
        self.assertGreater(type(self).attempts, 1, "first attempt fails")

    @unittest.skipIf(not is_in_ci(), "CI only")
    def test_ci_only(self):
        pass


if __name__ == "__main__":
    unittest.main()
"""


def test_a_contributed_upstream_file_runs_unchanged_in_our_suite(tmp_path, capsys, monkeypatch):
    write(tmp_path, "test_contributed.py", CONTRIBUTED, header="")
    regs = run_suite.select(run_suite.collect(tmp_path), "cpu", "per-commit-cpu")
    assert [r.path.name for r in regs] == ["test_contributed.py"]
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    monkeypatch.delenv("SGLANG_TEST_MAX_RETRY", raising=False)
    assert run_suite.run(regs, "cpu", 120, []) == 1  # no retry by default: the flaky test fails
    assert "1 failed, 0 passed" in capsys.readouterr().out
    monkeypatch.setenv("SGLANG_TEST_MAX_RETRY", "1")
    assert run_suite.run(regs, "cpu", 120, []) == 0
    assert "1 passed" in capsys.readouterr().out
