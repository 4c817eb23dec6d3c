"""Nightly: the HiRadixCache and HiMambaRadixCache state machines with many more runs."""

import pytest
from hypothesis import HealthCheck, settings
from test_hi_mamba_radix_cache_stateful import HiMambaMachine
from test_hiradix_cache_stateful import HiCacheMachine

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=200, suite="nightly-cpu")

# 1,000 runs of 80 steps per machine (~100 s on 2 cores); each CI run draws its own seed, so the
# runs add up across nights
NIGHTLY = settings(max_examples=1000, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck))


class NightlyHiCacheMachine(HiCacheMachine):
    pass


class NightlyHiMambaMachine(HiMambaMachine):
    pass


NightlyHiCacheMachine.TestCase.settings = NIGHTLY
NightlyHiMambaMachine.TestCase.settings = NIGHTLY
TestHiCacheStatefulNightly = NightlyHiCacheMachine.TestCase
TestHiMambaStatefulNightly = NightlyHiMambaMachine.TestCase


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
