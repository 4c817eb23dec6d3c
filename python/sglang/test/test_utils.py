"""Upstream sglang's test-harness names that unit tests import, for tests written against upstream.

Upstream's ``sglang.test.test_utils`` is the whole end-to-end toolbox (server launchers, model
constants, eval runners). This module keeps the part unit tests use and that means something in
this fork, and imports nothing but the standard library (no torch, no HTTP stack, no model):

- ``CustomTestCase``: a ``unittest.TestCase`` that retries a failing test method
  ``SGLANG_TEST_MAX_RETRY`` times (see the class).
- ``is_in_ci()`` / ``is_in_amd_ci()``: ``SGLANG_IS_IN_CI`` / ``SGLANG_IS_IN_CI_AMD`` set to 1 or true.
- ``maybe_stub_sgl_kernel()``: lets a module that imports ``sgl_kernel`` load where the kernel
  package is not installed (this fork never imports it).

Names upstream has for things this fork does not have are in ``UNSUPPORTED``; importing one
raises ImportError saying what to use here instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import time
import unittest

logger = logging.getLogger(__name__)

MAX_RETRY_ENV = "SGLANG_TEST_MAX_RETRY"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true")


def is_in_ci() -> bool:
    """True when ``SGLANG_IS_IN_CI`` is 1 or true (upstream's CI marker)."""
    return _env_flag("SGLANG_IS_IN_CI")


def is_in_amd_ci() -> bool:
    """True when ``SGLANG_IS_IN_CI_AMD`` is 1 or true; nothing here sets it."""
    return _env_flag("SGLANG_IS_IN_CI_AMD")


def max_test_retries() -> int:
    """Retries per failing test method: ``SGLANG_TEST_MAX_RETRY``, 0 when unset or empty."""
    raw = os.environ.get(MAX_RETRY_ENV, "").strip()
    try:
        retries = int(raw) if raw else 0
    except ValueError:
        retries = -1
    if retries < 0:
        raise ValueError(f"{MAX_RETRY_ENV}={raw!r}: expected a whole number >= 0")
    return retries


class CustomTestCase(unittest.TestCase):
    """``unittest.TestCase`` whose failing test method is run again, upstream's way.

    A test method that raises is run up to ``SGLANG_TEST_MAX_RETRY`` more times on the same
    instance (``setUp`` and ``tearDown`` are not repeated), sleeping
    ``min(retry_delay_s * 2**attempt, 60)`` seconds between attempts; the first attempt that
    passes makes the test pass. After the last attempt the last exception propagates unchanged,
    so an assertion still reads as a failure. ``unittest.SkipTest`` and exceptions that are not
    ``Exception`` (KeyboardInterrupt) are never retried; failures inside ``self.subTest()`` are
    recorded by unittest rather than raised, so they are not retried either.

    Differences from upstream: the default is no retry everywhere (upstream retries once when
    ``SGLANG_IS_IN_CI`` is set), so a flaky test fails our CI; the final error is the test's own
    exception rather than a generic "exceeded maximum number of retries"; setUp prints nothing.
    """

    retry_delay_s: float = 2.0

    def _callTestMethod(self, method):
        retries = max_test_retries()
        for attempt in range(retries + 1):
            try:
                return super()._callTestMethod(method)
            except unittest.SkipTest:
                raise
            except Exception as exc:
                if attempt == retries:
                    raise
                delay = min(self.retry_delay_s * 2**attempt, 60.0)
                logger.warning("%s failed (attempt %d of %d), retrying in %.1fs: %r",
                               self.id(), attempt + 1, retries + 1, delay, exc)
                time.sleep(delay)


class _StubKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel`` and its submodules as packages whose every attribute is a MagicMock."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        from unittest.mock import MagicMock

        module.__getattr__ = lambda name: MagicMock(name=f"{module.__name__}.{name}")


def maybe_stub_sgl_kernel() -> None:
    """Make ``import sgl_kernel`` (and its submodules) succeed when the real package is missing
    or fails to load: a finder at the front of ``sys.meta_path`` then serves stub modules whose
    attributes are MagicMocks. Does nothing when ``sgl_kernel`` imports; idempotent."""
    if any(isinstance(f, _StubKernelFinder) for f in sys.meta_path):
        return
    try:
        import sgl_kernel  # noqa: F401
    except (ImportError, OSError):
        sys.meta_path.insert(0, _StubKernelFinder())


_TINY_MODEL = ("real Hugging Face checkpoints are not downloaded here: build a tiny random one with "
               "sglang.test.engine_utils.make_tiny_model(out_dir, arch)")
_SERVER = ("start a server with sglang.test.server_utils.launch_server_process(model_path, *flags), "
           "which picks a free port, waits for /health and returns a handle")

# Upstream names this fork deliberately does not provide, and what to use instead.
UNSUPPORTED = {
    **dict.fromkeys((
        "DEFAULT_MODEL_NAME_FOR_TEST", "DEFAULT_SMALL_MODEL_NAME_FOR_TEST",
        "DEFAULT_MLA_MODEL_NAME_FOR_TEST", "DEFAULT_MODEL_NAME_FOR_TEST_MLA",
        "DEFAULT_HYBRID_MAMBA_MODEL_NAME_FOR_TEST", "DEFAULT_DRAFT_MODEL_EAGLE3",
        "DEFAULT_TARGET_MODEL_EAGLE3", "DEFAULT_SMALL_MODEL_NAME_FOR_TEST_QWEN",
    ), _TINY_MODEL),
    **dict.fromkeys((
        "popen_launch_server", "DEFAULT_URL_FOR_TEST", "DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH",
    ), _SERVER),
    "popen_launch_pd_server": _SERVER + "; route with sglang.test.router_utils.launch_pd_router",
    "kill_process_tree": "the handle's stop() kills the server's whole process group",
    "find_available_port": "use sglang.test.multiprocess.free_port()",
    "run_mmlu_test": "no eval harness here: check outputs against sglang.test.hf_reference",
    "run_bench_serving": "benchmarks are scripts under scripts/bench/, not tests",
}


def __getattr__(name: str):
    if name in UNSUPPORTED:
        # ImportError, not AttributeError: `from ... import name` would swallow the reason
        raise ImportError(f"sglang.test.test_utils.{name} is upstream-only: {UNSUPPORTED[name]}", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
