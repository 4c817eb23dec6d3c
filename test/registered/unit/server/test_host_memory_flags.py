"""Upstream's host memory flags: --hicache-host-memory-fraction (default 0.8, in (0, 1], auto-sizing
only when neither --hicache-ratio nor --hicache-size is given; --hicache-ratio unset by default,
resolved to 2.0) and --hicache-host-memory-mode (cache; buffer_only refused after upstream's own
prerequisite checks, naming what to use instead)."""

from __future__ import annotations

import pytest

from sglang.srt.server_args import ServerArgs, parse_args
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

HICACHE = dict(model_path="/m", enable_hierarchical_cache=True)


def test_defaults_are_upstreams_and_auto_size_the_default_ratio():
    args = parse_args(["--model-path", "/m", "--enable-hierarchical-cache"])
    assert (args.hicache_ratio, args.hicache_host_memory_fraction, args.hicache_host_memory_mode) == (None, 0.8,
                                                                                                       "cache")
    assert (args.resolved_hicache_ratio, args.resolved_host_memory_fraction) == (2.0, 0.8)
    args = parse_args(["--model-path", "/m", "--enable-hierarchical-cache", "--hicache-host-memory-fraction", "0.25"])
    assert args.resolved_host_memory_fraction == 0.25


@pytest.mark.parametrize("explicit", [dict(hicache_ratio=2.0), dict(hicache_ratio=3.5), dict(hicache_size=4)])
def test_an_explicit_ratio_or_size_turns_auto_sizing_off(explicit):
    args = ServerArgs(**HICACHE, hicache_host_memory_fraction=0.5, **explicit)
    assert args.resolved_host_memory_fraction is None
    assert args.resolved_hicache_ratio == explicit.get("hicache_ratio", 2.0)


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01, 2])
def test_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match=rf"--hicache-host-memory-fraction {fraction!r} is invalid; must be in "
                                         r"\(0, 1\]"):
        ServerArgs(**HICACHE, hicache_host_memory_fraction=fraction)


def test_fraction_one_and_zero_ratio_rules():
    assert ServerArgs(**HICACHE, hicache_host_memory_fraction=1.0).resolved_host_memory_fraction == 1.0
    with pytest.raises(ValueError, match="--hicache-ratio 0 is invalid; must be > 0 when --hicache-size is 0"):
        ServerArgs(**HICACHE, hicache_ratio=0)


def test_buffer_only_prerequisites_come_first():
    with pytest.raises(ValueError, match="buffer_only needs --enable-hierarchical-cache"):
        ServerArgs(model_path="/m", hicache_host_memory_mode="buffer_only")
    with pytest.raises(ValueError, match="buffer_only needs --hicache-storage-backend"):
        ServerArgs(**HICACHE, hicache_host_memory_mode="buffer_only")
    with pytest.raises(ValueError, match="buffer_only is not supported with --disaggregation-mode decode"):
        ServerArgs(**HICACHE, hicache_host_memory_mode="buffer_only", hicache_storage_backend="file",
                   disaggregation_mode="decode")


def test_buffer_only_is_refused_with_the_reason_and_the_alternative():
    with pytest.raises(ValueError) as err:
        ServerArgs(**HICACHE, hicache_host_memory_mode="buffer_only", hicache_storage_backend="file")
    message = str(err.value)
    for part in ("--hicache-host-memory-mode buffer_only is not supported", "UnifiedRadixCache",
                 "unified radix tree", "allowed: cache", "--hicache-ratio or --hicache-size"):
        assert part in message
    with pytest.raises(SystemExit):  # argparse's choices
        parse_args(["--model-path", "/m", "--hicache-host-memory-mode", "buffer"])
    assert ServerArgs(**HICACHE, hicache_host_memory_mode="cache").hicache_host_memory_mode == "cache"
