"""Decode-side offload through the real router: with --disaggregation-decode-enable-offload-kvcache
the decode server writes each finished turn's KV (prompt and answer) to the file L3 it shares with
the prefill server (HiCache on), so the next turn's prefill gets storage hits covering the
previous answer, which that prefill server never computed. Outputs equal a plain server's. The
decode server is started with upstream's command line (the flag and --hicache-storage-backend,
no --enable-hierarchical-cache). Qwen3 (KV only) and Qwen3-Next (KV + Mamba state: decode
checkpoints the state at page boundaries, so the answer's pages are resumable). Without the flag
the same workload gets no storage hit. With a decode L3 whose every write raises, requests finish
normally and both servers settle clean."""

import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import requests

from pd_cluster import decode_flags, free_ports, launch_servers, prefill_flags, scheduler_info, wait_settled
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_pd_router

register_cpu_ci(est_time=90, suite="nightly-cpu")

P = 4  # page size
CONVERSATIONS, TURNS, MAX_NEW = 2, 3, 9
OFFLOAD = "--disaggregation-decode-enable-offload-kvcache"
BACKENDS_DIR = str(Path(__file__).resolve().parents[1] / "unit" / "mem_cache")  # storage_test_backends.py
sys.path.insert(0, BACKENDS_DIR)
from storage_test_backends import scripted_extra  # noqa: E402


def storage_flags(l3: str, backend: str = "file", **extra) -> tuple[str, ...]:
    # wait_complete: a turn's prefill waits for its whole L3 read (the test counts every hit page);
    # prefetch_threshold 4: these prompts are far below the default 256 tokens
    return ("--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config",
            json.dumps({"storage_dir": l3, "prefetch_threshold": 4, **extra}))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


@pytest.fixture(scope="module")
def state_model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_next")), "qwen3_next")


@contextlib.contextmanager
def deployment(model: str, log_dir: str, l3: str, decode_storage: tuple[str, ...]):
    """A plain server, a prefill server (HiCache, file L3 at ``l3``) and a decode server with the
    offload flag and ``decode_storage``, behind the router."""
    (bootstrap_port,) = free_ports(1)
    env = {"PYTHONPATH": os.pathsep.join([BACKENDS_DIR, os.environ.get("PYTHONPATH", "")])}
    servers = launch_servers(model, [
        ("--page-size", str(P)),
        prefill_flags(bootstrap_port, "--page-size", str(P), "--enable-hierarchical-cache", *storage_flags(l3)),
        decode_flags("--page-size", str(P), OFFLOAD, *decode_storage),
    ], env=env, log_dir=log_dir)
    single, prefill, decode = servers
    router = None
    try:
        router = launch_pd_router([(prefill.url, bootstrap_port)], [decode.url], log_dir=log_dir)
        yield {"single": single, "prefill": prefill, "decode": decode, "router": router}
    finally:
        for proc in (router, *servers):
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def cluster(request, tmp_path_factory):
    """qwen3: KV only; qwen3_next: KV + the Mamba state, checkpointed by decode at page boundaries."""
    model = request.getfixturevalue("model" if request.param == "qwen3" else "state_model")
    l3 = str(tmp_path_factory.mktemp("l3"))
    with deployment(model, str(tmp_path_factory.mktemp("logs")), l3, storage_flags(l3)) as servers:
        yield servers


def generate(url: str, input_ids: list[int]) -> list[int]:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                        "ignore_eos": True}}
    resp = requests.post(url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()["output_ids"]


def wait_offloaded(decode, idle_checks_before: int, timeout: float = 30) -> dict:
    """The decode server's scheduler once it ran an idle check after ``idle_checks_before``: the
    idle check runs only when no host write or L3 backup is in flight, so the turn's KV is in L3."""
    deadline = time.monotonic() + timeout
    while True:
        info = scheduler_info(decode)
        if info["counters"]["num_idle_checks"] > idle_checks_before:
            return info
        assert time.monotonic() < deadline, f"decode did not settle: {info['disaggregation']} {info['storage']}"
        time.sleep(0.05)


def test_next_turn_prefill_hits_the_answer_decode_offloaded(cluster):
    single, prefill, decode, router = (cluster[k] for k in ("single", "prefill", "decode", "router"))
    rng = random.Random(0)
    histories = [[rng.randrange(3, 999) for _ in range(30 + 3 * c)] for c in range(CONVERSATIONS)]
    previous: list[tuple[int, int] | None] = [None] * CONVERSATIONS  # (prompt length, answer length)
    answer_storage_tokens = 0
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = histories[c]
            before = scheduler_info(prefill)["counters"]["cached_tokens"]
            idle_before = scheduler_info(decode)["counters"]["num_idle_checks"]
            got = generate(router.url, prompt)
            assert got == generate(single.url, prompt), f"conversation {c} turn {turn}"
            after = scheduler_info(prefill)["counters"]["cached_tokens"]
            hits = {tier: after[tier] - before[tier] for tier in after}
            if previous[c] is not None:
                n_prompt, n_answer = previous[c]
                # decode stored the whole pages of the previous prompt + answer but its last token
                # (sampled, never run); prefill itself computed only the previous prompt
                want = (n_prompt + n_answer - 1) // P * P
                assert sum(hits.values()) == want, (c, turn, hits, want)
                assert hits["storage"] >= want - n_prompt // P * P > 0, (c, turn, hits)
                answer_storage_tokens += want - n_prompt // P * P
            previous[c] = (len(prompt), len(got))
            histories[c] = prompt + got + [rng.randrange(3, 999) for _ in range(5)]
            info = wait_offloaded(decode, idle_before)
            assert info["storage"].get("failures", 0) == 0, info["storage"]
    pd = wait_settled(decode)["disaggregation"]
    assert pd["pd_offload_requests"] >= CONVERSATIONS * TURNS and pd["pd_offload_pages"] > 0, pd
    assert answer_storage_tokens > 0
    for srv in (prefill, decode):
        info = wait_settled(srv)
        assert info["disaggregation"]["pd_failed"] == 0 and info["counters"]["num_idle_checks"] > 0
        assert srv.get("/health").status_code == 200


def test_a_failing_decode_l3_leaves_requests_finished_normally(model, tmp_path):
    l3 = str(tmp_path / "l3")
    os.makedirs(l3)
    failing = storage_flags(l3, "dynamic", **scripted_extra(l3, raise_on=["set"]))  # every L3 write raises
    with deployment(model, str(tmp_path), l3, failing) as c:
        rng = random.Random(1)
        history = [rng.randrange(3, 999) for _ in range(30)]
        for turn in range(2):
            idle_before = scheduler_info(c["decode"])["counters"]["num_idle_checks"]
            got = generate(c["router"].url, history)
            assert got == generate(c["single"].url, history), f"turn {turn}"
            info = wait_offloaded(c["decode"], idle_before)
            history = history + got + [rng.randrange(3, 999) for _ in range(5)]
        storage = info["storage"]
        assert storage["backup_pages_failed"] > 0 and storage["failures"] > 0, storage
        assert scheduler_info(c["prefill"])["counters"]["cached_tokens"]["storage"] == 0  # nothing was stored
        for srv in (c["prefill"], c["decode"]):
            info = wait_settled(srv)
            assert info["disaggregation"]["pd_failed"] == 0 and info["counters"]["num_aborted"] == 0
            assert srv.get("/health").status_code == 200


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
