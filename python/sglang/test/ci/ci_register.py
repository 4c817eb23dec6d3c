"""Test registration markers, read by ``test/run_suite.py``.

Every file under ``test/registered/`` makes a top-level call such as::

    register_cpu_ci(est_time=30, suite="per-commit-cpu")

with literal keyword arguments. The calls do nothing at runtime: ``run_suite.py`` finds them by
parsing the file with ``ast``, so a test file is never imported (and never run) just to be listed.

Upstream compatibility. The markers have upstream sglang's names and signature, so a test file
written for upstream registers here unchanged:

- ``register_{cpu,cuda,amd,npu,xpu,musa,mlx}_ci(est_time, suite=None, nightly=False,
  disabled=None, *, stage=None, runner_config=None, in_process_group=None)``.
- A registration names its suite either with ``suite=`` or with the pair ``stage=`` +
  ``runner_config=``, which means the suite ``f"{stage}-test-{runner_config}"`` (upstream's rule).
  Giving both, or half the pair, is refused.
- ``in_process_group`` is accepted and ignored: every file runs in its own pytest process here.
- ``nightly=True`` is accepted when the suite it resolves to is a nightly suite here, and refused
  otherwise (upstream runs such a file only in its nightly schedule; so do we).
- Unlike upstream, ``run_suite.py`` takes keyword arguments only (a positional ``est_time`` or
  ``suite`` is refused), and a file registers at most once per hardware we run (cpu, cuda).

Suites. This fork runs two kinds of hardware, cpu and cuda, with the suites in ``SUITES_BY_HW``;
ours are split only by the number of GPUs. An upstream suite name is mapped onto ours by
``UPSTREAM_SUITES`` (cpu per-commit suites to ``per-commit-cpu``; 1-GPU per-commit suites, small
or large runner, to ``per-commit-1-gpu``; 2-GPU ones to ``per-commit-2-gpu``). Any other name
(4/8-GPU, B200/H200-only, arm64, upstream nightlies other than ``nightly-1-gpu``) is refused
with the list of accepted names: move such a test to one of ours or leave it out.

Other hardware (amd, npu, xpu, musa, mlx) is recognised but never run: its registrations count
as registering the file (a file registered only for AMD is valid and selected by no suite here),
their arguments must still be literals, and their suite names are not checked.
"""

from __future__ import annotations

import inspect

# The hardware and suites this fork runs. run_suite.py refuses any other name.
CPU_SUITES = ("per-commit-cpu", "nightly-cpu")
CUDA_SUITES = ("per-commit-1-gpu", "per-commit-2-gpu", "nightly-1-gpu")
SUITES_BY_HW = {"cpu": CPU_SUITES, "cuda": CUDA_SUITES}
NIGHTLY_SUITES = ("nightly-cpu", "nightly-1-gpu")

# Hardware upstream registers for that this fork never runs.
FOREIGN_HW = ("amd", "npu", "xpu", "musa", "mlx")
REGISTER_FUNCS = {f"register_{hw}_ci": hw for hw in (*SUITES_BY_HW, *FOREIGN_HW)}

_CPU_PER_COMMIT = ("base-a-test-cpu", "base-b-test-cpu", "base-c-test-cpu", "stage-a-test-cpu")
_CUDA_1_GPU = (
    "base-a-test-1-gpu-small", "base-b-test-1-gpu-small", "base-b-test-1-gpu-large",
    "extra-a-test-1-gpu-small", "extra-a-test-1-gpu-large",
    "stage-a-test-1-gpu-small", "stage-b-test-1-gpu-small", "stage-b-test-1-gpu-large",
    "stage-b-test-small-1-gpu", "stage-b-test-large-1-gpu",
)
_CUDA_2_GPU = (
    "base-b-test-2-gpu-large", "extra-a-test-2-gpu-large",
    "stage-b-test-2-gpu-large", "stage-b-test-large-2-gpu",
)

# Upstream suite name -> ours, per hardware. Our own names map to themselves.
UPSTREAM_SUITES = {
    "cpu": {**{s: s for s in CPU_SUITES}, **{s: "per-commit-cpu" for s in _CPU_PER_COMMIT}},
    "cuda": {
        **{s: s for s in CUDA_SUITES},
        **{s: "per-commit-1-gpu" for s in _CUDA_1_GPU},
        **{s: "per-commit-2-gpu" for s in _CUDA_2_GPU},
    },
}


def _marker(hw: str):
    def register(
        est_time: float,
        suite: str | None = None,
        nightly: bool = False,
        disabled: str | None = None,
        *,
        stage: str | None = None,
        runner_config: str | None = None,
        in_process_group: str | None = None,
    ) -> None:
        pass

    register.__name__ = register.__qualname__ = f"register_{hw}_ci"
    register.__doc__ = f"Mark the calling file as registered for {hw} CI (runtime no-op; see the module docstring)."
    return register


register_cpu_ci = _marker("cpu")
register_cuda_ci = _marker("cuda")
register_amd_ci = _marker("amd")
register_npu_ci = _marker("npu")
register_xpu_ci = _marker("xpu")
register_musa_ci = _marker("musa")
register_mlx_ci = _marker("mlx")

# The keywords a registration may use: the markers' own parameters, one source of truth; the
# leading ones may also be given by position, as upstream's files do.
MARKER_KEYWORDS = tuple(inspect.signature(register_cpu_ci).parameters)
MARKER_POSITIONAL = tuple(name for name, p in inspect.signature(register_cpu_ci).parameters.items()
                          if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
