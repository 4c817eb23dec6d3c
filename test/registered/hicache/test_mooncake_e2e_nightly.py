"""Mooncake L3 shared by two servers, the longer stories (one real ``mooncake_master`` on
127.0.0.1 per test):

- MLA (tiny DeepSeek-V2) and hybrid (tiny Qwen3-Next: KV pages and linear-attention states):
  server B, fresh, serves what only server A has seen from storage, with the outputs of a server
  without HiCache.
- The master killed under two running servers: every request still succeeds, each within the
  transfer timeout, with the reference's outputs (L3 misses); the master restarted (same ports,
  empty store): without restarting either server, pages A writes become storage hits on B again
  (polled with a deadline).
"""

from __future__ import annotations

import random
import time

import pytest
import test_qwen3_next_e2e as qwen3_next_e2e
from hicache_workload import GREEDY, assert_same_tokens, run_workload, tier_totals, wait_idle_check
from model_e2e import COMMON, REFERENCE, SMALL_DEVICE, WORKLOAD
from test_hicache_storage import wait_backed_up
from test_mooncake_e2e import mooncake_l3_flags

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.mooncake_master import MooncakeMaster, mooncake_or_skip
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=90, suite="nightly-cpu")

TRANSFER_TIMEOUT_S = 10.0  # the backend's bound on a call whose master or peer is gone
RECOVERY_DEADLINE_S = 90.0  # the restarted master found again by both clients' heartbeats

qwen3_next, reference = qwen3_next_e2e.qwen3_next, qwen3_next_e2e.reference  # fixtures


@pytest.fixture
def master():
    mooncake_or_skip()
    with MooncakeMaster() as m:
        yield m


def test_mla_server_b_serves_from_pages_server_a_wrote(master, tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("deepseek_v2")), "deepseek_v2")
    with launch_server_process(model, *COMMON, *REFERENCE) as srv:
        expected = run_workload(srv, **WORKLOAD)
    flags = [*COMMON, *SMALL_DEVICE, *mooncake_l3_flags(master)]
    with launch_server_process(model, *flags) as a, launch_server_process(model, *flags) as b:
        assert_same_tokens(expected, run_workload(a, **WORKLOAD))
        assert wait_backed_up(a) > 0
        seen_by_b = run_workload(b, **WORKLOAD)
        assert_same_tokens(expected, seen_by_b)
        assert tier_totals(seen_by_b)["storage"] > 0, tier_totals(seen_by_b)
        assert wait_idle_check(b)["num_idle_checks"] > 0


def test_hybrid_server_b_restores_kv_and_state_server_a_wrote(master, qwen3_next, reference):
    flags = [*qwen3_next_e2e.COMMON, *qwen3_next_e2e.SMALL_DEVICE, *mooncake_l3_flags(master)]
    with launch_server_process(qwen3_next, *flags) as a, launch_server_process(qwen3_next, *flags) as b:
        assert_same_tokens(reference, run_workload(a, **qwen3_next_e2e.WORKLOAD), qwen3_next_e2e.LOGPROB_TOL)
        assert wait_backed_up(a) > 0
        # later rounds' histories end where A's turns left a state: only storage holds it for B
        assert qwen3_next_e2e.run_later_rounds(b, reference) > 0
        assert wait_idle_check(b)["num_idle_checks"] > 0
        stats = b.get("/get_server_info").json()["scheduler"]["storage"]
        assert stats["pages_hit"] > 0 and stats["corruptions"] == 0, stats


def _prompts(seed: int, n: int, length: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 999) for _ in range(length)] for _ in range(n)]


def _timed(srv, prompt: list[int]) -> tuple[dict, float]:
    start = time.monotonic()
    out = srv.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, **GREEDY}, timeout=60)
    return out, time.monotonic() - start


def test_master_killed_then_restarted_under_running_servers(master, model):
    flags = [*COMMON, *SMALL_DEVICE, *mooncake_l3_flags(master, transfer_timeout_s=TRANSFER_TIMEOUT_S)]
    seen_by_a, during_outage = _prompts(1, 4), _prompts(2, 4)
    with launch_server_process(model, *COMMON, *REFERENCE) as ref, \
            launch_server_process(model, *flags) as a, launch_server_process(model, *flags) as b:
        def expected(prompt):
            return ref.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, **GREEDY})["output_ids"]

        for prompt in seen_by_a:
            assert a.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, **GREEDY})["output_ids"] \
                == expected(prompt)
        assert wait_backed_up(a) > 0

        master.kill()
        for srv, prompts in ((b, seen_by_a), (a, during_outage), (b, during_outage)):
            for prompt in prompts:
                out, elapsed = _timed(srv, prompt)
                assert out["output_ids"] == expected(prompt)
                assert elapsed < TRANSFER_TIMEOUT_S, (elapsed, out["meta_info"]["cached_tokens_details"])
                assert out["meta_info"]["cached_tokens_details"]["storage"] == 0

        master.start()  # same ports, an empty store
        deadline, seed, hit = time.monotonic() + RECOVERY_DEADLINE_S, 100, None
        while hit is None and time.monotonic() < deadline:
            seed += 1
            prompt = _prompts(seed, 1)[0]
            backups_before = _backups(a)
            assert a.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, **GREEDY})["output_ids"] \
                == expected(prompt)
            _wait_backup_settled(a, backups_before, deadline)
            out, elapsed = _timed(b, prompt)
            assert out["output_ids"] == expected(prompt)
            assert elapsed < TRANSFER_TIMEOUT_S
            if out["meta_info"]["cached_tokens_details"]["storage"] > 0:
                hit = out
        assert hit is not None, (a.get("/get_server_info").json()["scheduler"]["storage"],
                                 b.get("/get_server_info").json()["scheduler"]["storage"], master.log_tail())
        for srv in (a, b):
            assert srv.get("/health").status_code == 200
            assert wait_idle_check(srv)["num_idle_checks"] > 0


def _backups(srv) -> int:
    """Pages A's backups have finished with: stored, already there, or failed."""
    stats = srv.get("/get_server_info").json()["scheduler"]["storage"]
    return stats["pages_written"] + stats["backup_pages_existing"] + stats["backup_pages_failed"]


def _wait_backup_settled(srv, before: int, deadline: float) -> None:
    """Poll until a backup submitted after ``before`` was counted (or ``deadline``)."""
    while _backups(srv) == before and time.monotonic() < deadline:
        time.sleep(0.1)
