"""Run a registered test suite.

    python test/run_suite.py --hw cpu --suite per-commit-cpu [--list] [--timeout-per-file S]

Registrations are read with ``ast`` from every ``test_*.py`` under ``test/registered/``; each
such file must make at least one top-level ``register_*_ci`` call with literal arguments,
at most one per hardware we run (cpu, cuda). Upstream-style registrations (``stage=`` +
``runner_config=``, upstream suite names, ``nightly=``, ``register_amd_ci`` and the other
hardware's markers) are read as ``sglang.test.ci.ci_register`` documents: upstream suite names
map onto ours or are refused with the accepted names, and other hardware is never selected.
Each selected file runs in its own pytest process; the run ends with a pytest-style summary
line and a non-zero exit status when anything failed.

Each file gets ``SGLANG_TEST_DEVICE`` = the --hw value, and on cpu ``TRITON_INTERPRET=1``.

Outcome of one file, from pytest's exit status and its JUnit report: 0 passes; 5 with every
collected test skipped (a CUDA-only module on a machine without the hardware) is a skip; 5 with
nothing collected fails (a registered file that runs nothing), unless pytest arguments given
here (``-k``, ``-m``) deselected everything; anything else fails. A file past
``--timeout-per-file`` is killed with its whole process group (servers it started included).

Hypothesis: one seed per run, passed to every file as ``--hypothesis-seed`` and printed with a
replay command. ``--hypothesis-seed`` (or ``SGLANG_HYPOTHESIS_SEED``) fixes it; otherwise it is
drawn at random. The ``sglang.test.hypothesis_profile`` plugin keeps hypothesis' CI profile from
derandomizing, so the seed decides the examples under CI too. Tests with ``derandomize=True``
replay the same examples whatever the seed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent
REGISTERED = ROOT / "registered"
sys.path.insert(0, str(ROOT.parent / "python"))
from sglang.test.ci.ci_register import (  # noqa: E402
    MARKER_KEYWORDS,
    MARKER_POSITIONAL,
    NIGHTLY_SUITES,
    REGISTER_FUNCS,
    SUITES_BY_HW,
    UPSTREAM_SUITES,
)


@dataclass(frozen=True)
class Registration:
    path: Path
    hw: str
    suite: str
    est_time: float
    disabled: str | None


class RegistrationError(ValueError):
    pass


# keyword -> accepted literal type; the others are strings. None is accepted but for est_time.
_KEYWORD_TYPES = {"est_time": (int, float), "nightly": bool}


def _literal_kwargs(call: ast.Call, path: Path) -> dict:
    """The call's arguments by name: positional ones bound to the marker's leading parameters
    (upstream writes ``register_cpu_ci(5, "base-a-test-cpu")``), then the keywords."""
    name = call.func.id
    if len(call.args) > len(MARKER_POSITIONAL):
        raise RegistrationError(f"{path}: {name}() takes at most {len(MARKER_POSITIONAL)} positional arguments "
                                f"({', '.join(MARKER_POSITIONAL)}), got {len(call.args)}")
    named = list(zip(MARKER_POSITIONAL, call.args))
    for kw in call.keywords:
        if kw.arg not in MARKER_KEYWORDS:  # None for **kwargs
            raise RegistrationError(
                f"{path}: unknown argument {kw.arg!r} of {name}(); known: {', '.join(MARKER_KEYWORDS)}"
            )
        if kw.arg in MARKER_POSITIONAL[: len(call.args)]:
            raise RegistrationError(f"{path}: {name}() got argument {kw.arg!r} both by position and by keyword")
        named.append((kw.arg, kw.value))
    out = {}
    for arg, node in named:
        try:
            value = ast.literal_eval(node)
        except ValueError:
            raise RegistrationError(f"{path}: argument {arg!r} of {name}() must be a literal") from None
        expected = _KEYWORD_TYPES.get(arg, str)
        if not isinstance(value, expected) and not (value is None and arg != "est_time"):
            raise RegistrationError(f"{path}: argument {arg!r} of {name}() has the wrong type: {value!r}")
        out[arg] = value
    return out


def _suite_name(kwargs: dict, path: Path, name: str) -> str:
    """The registered suite: ``suite=``, or upstream's ``stage=`` + ``runner_config=`` pair."""
    pair = [kwargs.get(k) is not None for k in ("stage", "runner_config")]
    if kwargs.get("suite") is not None and not any(pair):
        return kwargs["suite"]
    if all(pair) and kwargs.get("suite") is None:
        return f"{kwargs['stage']}-test-{kwargs['runner_config']}"
    raise RegistrationError(
        f"{path}: {name}() needs either suite= or both of stage= and runner_config= (upstream's pair)"
    )


def _our_suite(hw: str, suite: str, nightly: bool, path: Path) -> str:
    """Map a registered suite onto ours (ci_register.UPSTREAM_SUITES); refuse what has no match."""
    ours = UPSTREAM_SUITES[hw].get(suite)
    if ours is None:
        upstream = sorted(set(UPSTREAM_SUITES[hw]) - set(SUITES_BY_HW[hw]))
        raise RegistrationError(
            f"{path}: unknown {hw} suite {suite!r}; known: {', '.join(SUITES_BY_HW[hw])} "
            f"(upstream names accepted: {', '.join(upstream)})"
        )
    if nightly and ours not in NIGHTLY_SUITES:
        raise RegistrationError(f"{path}: nightly=True but {hw} suite {suite!r} is per-commit here ({ours})")
    return ours


def read_registrations(path: Path) -> list[Registration]:
    """Parse one test file and return its registrations (top-level calls only), ours and
    other hardware's alike; a suite is mapped onto ours (see ``sglang.test.ci.ci_register``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    regs = []
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
            continue
        call = stmt.value
        if not (isinstance(call.func, ast.Name) and call.func.id in REGISTER_FUNCS):
            continue
        name, hw = call.func.id, REGISTER_FUNCS[call.func.id]
        kwargs = _literal_kwargs(call, path)
        if "est_time" not in kwargs:
            raise RegistrationError(f"{path}: {name}() needs est_time=")
        suite = _suite_name(kwargs, path, name)
        if hw in SUITES_BY_HW:
            suite = _our_suite(hw, suite, bool(kwargs.get("nightly")), path)
        regs.append(Registration(path, hw, suite, float(kwargs["est_time"]), kwargs.get("disabled")))
    hws = [r.hw for r in regs if r.hw in SUITES_BY_HW]
    if len(hws) != len(set(hws)):
        raise RegistrationError(f"{path}: more than one registration for the same hardware")
    return regs


def collect(root: Path = REGISTERED) -> list[Registration]:
    """All registrations; raise when a test file has none."""
    regs = []
    for path in sorted(root.rglob("test_*.py")):
        found = read_registrations(path)
        if not found:
            raise RegistrationError(
                f"{path} is not registered: add a top-level register_cpu_ci(...) or "
                "register_cuda_ci(...) call"
            )
        regs.extend(found)
    return regs


def select(regs: list[Registration], hw: str, suite: str) -> list[Registration]:
    if suite not in SUITES_BY_HW[hw]:
        raise RegistrationError(
            f"unknown suite {suite!r} for --hw {hw}; known: {', '.join(SUITES_BY_HW[hw])}"
        )
    return [r for r in regs if r.hw == hw and r.suite == suite]


def _shown(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it."""
    try:
        return path.relative_to(ROOT.parent)
    except ValueError:
        return path


# Wall-clock budget per suite on a 2-core runner (the summary warns past it); per-commit plus
# nightly stay under 45 minutes.
BUDGET_S = {"per-commit-cpu": 900.0, "nightly-cpu": 1800.0}


class Outcome(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"
    TIMEOUT = "TIMEOUT"


@dataclass(frozen=True)
class FileResult:
    rel: Path
    outcome: Outcome
    seconds: float
    est_time: float
    note: str = ""


# pytest options that select a subset: with them, a file where nothing is left is not a failure
_SELECTING_ARGS = ("-k", "-m", "--deselect", "--lf", "--last-failed")


def _junit_counts(path: Path) -> tuple[int, int]:
    """(tests, skipped) from a JUnit report; (0, 0) when pytest wrote none."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return 0, 0
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return sum(int(x.get("tests", 0)) for x in suites), sum(int(x.get("skipped", 0)) for x in suites)


def classify(rc: int, tests: int, skipped: int, selecting: bool) -> tuple[Outcome, str]:
    """The outcome of one pytest process (see the module docstring)."""
    if rc == 0:
        return Outcome.PASS, ""
    if rc == 5:
        if tests and skipped == tests:
            return Outcome.SKIP, "every test skipped"
        if selecting:
            return Outcome.SKIP, "no test selected"
        return Outcome.FAIL, "collected no tests"
    return Outcome.FAIL, f"pytest exit {rc}"


def _run_file(cmd: list[str], env: dict, timeout: float) -> int | None:
    """Run one pytest process in its own session; None when it ran past ``timeout`` (killed)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:  # the file's process group: pytest itself on a timeout, and any leftover server
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def hypothesis_seed(given: int | None) -> int:
    if given is not None:
        return given
    env = os.environ.get("SGLANG_HYPOTHESIS_SEED", "").strip()
    return int(env) if env else random.SystemRandom().randrange(2**32)


def run(
    selected: list[Registration],
    hw: str,
    timeout_per_file: float,
    pytest_args: list[str],
    seed: int | None = None,
    budget_s: float | None = None,
) -> int:
    env = dict(os.environ)
    env["SGLANG_TEST_DEVICE"] = hw
    if hw == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run under the interpreter on CPU
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT.parent / "python"), env.get("PYTHONPATH", "")) if p
    )
    seed_args = []
    if seed is not None and importlib.util.find_spec("hypothesis") is not None:
        seed_args = ["-p", "sglang.test.hypothesis_profile", f"--hypothesis-seed={seed}"]
        print(f"hypothesis seed: {seed} (replay a run: --hypothesis-seed {seed})", flush=True)
    selecting = any(a.split("=")[0] in _SELECTING_ARGS for a in pytest_args)
    results: list[FileResult] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="run_suite_") as tmp:
        for n, reg in enumerate(selected):
            rel = _shown(reg.path)
            if reg.disabled:
                print(f"SKIP {rel}: disabled ({reg.disabled})", flush=True)
                results.append(FileResult(rel, Outcome.SKIP, 0.0, reg.est_time, f"disabled: {reg.disabled}"))
                continue
            print(f"RUN  {rel} (est {reg.est_time:.0f}s)", flush=True)
            junit = Path(tmp) / f"{n}.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--junit-xml={junit}",
                   str(reg.path), *seed_args, *pytest_args]
            t0 = time.monotonic()
            rc = _run_file(cmd, env, timeout_per_file)
            took = time.monotonic() - t0
            if rc is None:
                outcome, note = Outcome.TIMEOUT, f"killed after {timeout_per_file:.0f}s"
            else:
                outcome, note = classify(rc, *_junit_counts(junit), selecting)
            results.append(FileResult(rel, outcome, took, reg.est_time, note))
            print(f"{outcome.value} {rel} ({took:.1f}s{', ' + note if note else ''})", flush=True)
    total = time.monotonic() - start
    _print_summary(results, total, seed if seed_args else None, budget_s)
    return 1 if any(r.outcome in (Outcome.FAIL, Outcome.TIMEOUT) for r in results) else 0


def _print_summary(results: list[FileResult], total: float, seed: int | None, budget_s: float | None) -> None:
    print("\nper-file times (slowest first; est = registered est_time):")
    for r in sorted(results, key=lambda r: -r.seconds):
        print(f"  {r.seconds:7.1f}s  est {r.est_time:5.0f}s  {r.outcome.value:7s} {r.rel}")
    bad = [r for r in results if r.outcome in (Outcome.FAIL, Outcome.TIMEOUT)]
    for r in bad:
        replay = f" -p sglang.test.hypothesis_profile --hypothesis-seed={seed}" if seed is not None else ""
        print(f"FAILED {r.rel} ({r.note}); replay: python -m pytest {r.rel}{replay}")
    counts = {o: sum(r.outcome is o for r in results) for o in Outcome}
    parts = [f"{counts[Outcome.FAIL]} failed"] if counts[Outcome.FAIL] else []
    if counts[Outcome.TIMEOUT]:
        parts.append(f"{counts[Outcome.TIMEOUT]} timed out")
    parts.append(f"{counts[Outcome.PASS]} passed")
    if counts[Outcome.SKIP]:
        parts.append(f"{counts[Outcome.SKIP]} skipped")
    est = sum(r.est_time for r in results)
    print(f"total: {total:.1f}s wall, est {est:.0f}s" + (f", budget {budget_s:.0f}s" if budget_s else ""))
    if budget_s and total > budget_s:
        print(f"WARNING: the suite took {total:.0f}s, over its {budget_s:.0f}s budget: move files to a nightly suite")
    print(f"========== {', '.join(parts)} in {total:.1f}s ==========")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hw", choices=sorted(SUITES_BY_HW), required=True)
    parser.add_argument("--suite", required=True)
    parser.add_argument("--list", action="store_true", help="print the selected files and exit")
    parser.add_argument("--timeout-per-file", type=float, default=1800.0)
    parser.add_argument("--hypothesis-seed", type=int, default=None,
                        help="seed for every hypothesis test (default: $SGLANG_HYPOTHESIS_SEED, else random)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the suite (default: BUDGET_S); the summary warns past it")
    args, pytest_args = parser.parse_known_args(argv)
    try:
        selected = select(collect(), args.hw, args.suite)
    except RegistrationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for reg in selected:
            print(f"{_shown(reg.path)}\t{reg.est_time:.0f}s")
        print(f"{len(selected)} files, est {sum(r.est_time for r in selected):.0f}s")
        return 0
    if not selected:
        print(f"error: suite {args.suite!r} selects no test files", file=sys.stderr)
        return 2
    seed = hypothesis_seed(args.hypothesis_seed)
    budget = args.budget_s if args.budget_s is not None else BUDGET_S.get(args.suite)
    return run(selected, args.hw, args.timeout_per_file, pytest_args, seed, budget)


if __name__ == "__main__":
    sys.exit(main())
