"""Test registration markers, read by ``test/run_suite.py``.

Every file under ``test/registered/`` makes exactly one top-level call such as::

    register_cpu_ci(est_time=30, suite="per-commit-cpu")

with literal arguments. The calls do nothing at runtime: ``run_suite.py`` finds them by parsing
the file with ``ast``, so a test file is never imported (and never run) just to be listed.
"""

from __future__ import annotations

# The one table of suites. run_suite.py refuses any other name.
CPU_SUITES = ("per-commit-cpu", "nightly-cpu")
CUDA_SUITES = ("per-commit-1-gpu", "per-commit-2-gpu", "nightly-1-gpu")
SUITES_BY_HW = {"cpu": CPU_SUITES, "cuda": CUDA_SUITES}
REGISTER_FUNCS = {"register_cpu_ci": "cpu", "register_cuda_ci": "cuda"}


def register_cpu_ci(est_time: float, suite: str, disabled: str | None = None) -> None:
    """Mark the calling file as part of CPU suite ``suite`` (runtime no-op)."""


def register_cuda_ci(est_time: float, suite: str, disabled: str | None = None) -> None:
    """Mark the calling file as part of CUDA suite ``suite`` (runtime no-op)."""
