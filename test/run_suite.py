"""Run a registered test suite.

    python test/run_suite.py --hw cpu --suite per-commit-cpu [--list] [--timeout-per-file S]

Registrations are read with ``ast`` from every ``test_*.py`` under ``test/registered/``; each
such file must make exactly one top-level ``register_cpu_ci`` / ``register_cuda_ci`` call (or
one of each) with literal arguments. Each selected file runs in its own pytest process; the run
ends with a pytest-style summary line and a non-zero exit status when anything failed.

Each file gets ``SGLANG_TEST_DEVICE`` = the --hw value, and on cpu ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REGISTERED = ROOT / "registered"
sys.path.insert(0, str(ROOT.parent / "python"))
from sglang.test.ci.ci_register import REGISTER_FUNCS, SUITES_BY_HW  # noqa: E402


@dataclass(frozen=True)
class Registration:
    path: Path
    hw: str
    suite: str
    est_time: float
    disabled: str | None


class RegistrationError(ValueError):
    pass


def _literal_kwargs(call: ast.Call, path: Path) -> dict:
    if call.args:
        raise RegistrationError(f"{path}: {call.func.id}() takes keyword arguments only")
    out = {}
    for kw in call.keywords:
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            raise RegistrationError(
                f"{path}: argument {kw.arg!r} of {call.func.id}() must be a literal"
            ) from None
    return out


def read_registrations(path: Path) -> list[Registration]:
    """Parse one test file and return its registrations (top-level calls only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    regs = []
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
            continue
        call = stmt.value
        if not (isinstance(call.func, ast.Name) and call.func.id in REGISTER_FUNCS):
            continue
        hw = REGISTER_FUNCS[call.func.id]
        kwargs = _literal_kwargs(call, path)
        for key in ("est_time", "suite"):
            if key not in kwargs:
                raise RegistrationError(f"{path}: {call.func.id}() needs {key}=")
        suite = kwargs["suite"]
        if suite not in SUITES_BY_HW[hw]:
            raise RegistrationError(
                f"{path}: unknown {hw} suite {suite!r}; known: {', '.join(SUITES_BY_HW[hw])}"
            )
        regs.append(Registration(path, hw, suite, float(kwargs["est_time"]), kwargs.get("disabled")))
    hws = [r.hw for r in regs]
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


def run(selected: list[Registration], hw: str, timeout_per_file: float, pytest_args: list[str]) -> int:
    env = dict(os.environ)
    env["SGLANG_TEST_DEVICE"] = hw
    if hw == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run under the interpreter on CPU
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT.parent / "python"), env.get("PYTHONPATH", "")) if p
    )
    passed, failed, skipped = [], [], []
    start = time.monotonic()
    for reg in selected:
        rel = _shown(reg.path)
        if reg.disabled:
            print(f"SKIP {rel}: disabled ({reg.disabled})", flush=True)
            skipped.append(rel)
            continue
        print(f"RUN  {rel} (est {reg.est_time:.0f}s)", flush=True)
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(reg.path)]
        try:
            rc = subprocess.run(cmd + pytest_args, env=env, timeout=timeout_per_file).returncode
        except subprocess.TimeoutExpired:
            print(f"TIMEOUT {rel} after {timeout_per_file:.0f}s", flush=True)
            rc = -1
        took = time.monotonic() - t0
        (passed if rc == 0 else failed).append(rel)
        print(f"{'PASS' if rc == 0 else 'FAIL'} {rel} ({took:.1f}s)", flush=True)
    total = time.monotonic() - start
    for rel in failed:
        print(f"FAILED {rel}")
    parts = [f"{len(failed)} failed"] if failed else []
    parts.append(f"{len(passed)} passed")
    if skipped:
        parts.append(f"{len(skipped)} skipped")
    print(f"========== {', '.join(parts)} in {total:.1f}s ==========")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hw", choices=sorted(SUITES_BY_HW), required=True)
    parser.add_argument("--suite", required=True)
    parser.add_argument("--list", action="store_true", help="print the selected files and exit")
    parser.add_argument("--timeout-per-file", type=float, default=1800.0)
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
    return run(selected, args.hw, args.timeout_per_file, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
