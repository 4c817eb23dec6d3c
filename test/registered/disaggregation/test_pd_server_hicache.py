"""PD serving with HiCache on the prefill server: its device pool is far smaller than the
multi-turn working set, so earlier turns are evicted to its host pool and loaded back when the
next turn of the same conversation arrives (L2 prefix reuse still applies under PD). Greedy
tokens and (float32) logprobs through the router equal a plain server's (device pool holding
everything) bit for bit; the prefill server served host hits; both PD servers settle clean."""

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from pd_cluster import decode_flags, free_ports, launch_servers, prefill_flags, wait_settled
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_pd_router

register_cpu_ci(est_time=30, suite="per-commit-cpu")

PAGE = ("--page-size", "4")
SMALL_DEVICE_HICACHE = ("--max-total-tokens", "512", "--enable-hierarchical-cache", "--hicache-ratio", "8")
CLIENTS, ROUNDS, MAX_NEW = 6, 3, 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    (bootstrap_port,) = free_ports(1)
    servers = launch_servers(model, [
        (*PAGE,),
        prefill_flags(bootstrap_port, *PAGE, *SMALL_DEVICE_HICACHE),
        decode_flags(*PAGE),
    ], log_dir=(logs := str(tmp_path_factory.mktemp("logs"))))
    single, prefill, decode = servers
    router = None
    try:
        router = launch_pd_router([(prefill.url, bootstrap_port)], [decode.url], log_dir=logs)
        yield {"single": single, "prefill": prefill, "decode": decode, "router": router}
    finally:
        for proc in (router, *servers):
            if proc is not None:
                proc.stop()


def run_conversations(url: str, seed: int = 0) -> list[tuple[list[int], list[float]]]:
    """CLIENTS conversations of ROUNDS turns sharing a system prompt; each turn resends the whole
    history plus a new question. Clients of a round run concurrently. Returns (tokens, logprobs)
    per turn, round-major."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 999) for _ in range(48)]
    history = [list(system) for _ in range(CLIENTS)]
    questions = [[[rng.randrange(3, 999) for _ in range(40)] for _ in range(CLIENTS)] for _ in range(ROUNDS)]

    def turn(c: int, r: int):
        prompt = history[c] + questions[r][c]
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
        resp = requests.post(url + "/generate", json=body, timeout=120)
        assert resp.status_code == 200, resp.text[:500]
        out = resp.json()
        history[c] = prompt + out["output_ids"]
        return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    results = []
    with ThreadPoolExecutor(CLIENTS) as pool:
        for r in range(ROUNDS):
            results += list(pool.map(turn, range(CLIENTS), [r] * CLIENTS))
    return results


def test_multi_turn_with_prefill_host_hits_is_identical(cluster):
    want = run_conversations(cluster["single"].url)
    got = run_conversations(cluster["router"].url)
    for i, ((tokens_a, lps_a), (tokens_b, lps_b)) in enumerate(zip(want, got, strict=True)):
        assert tokens_b == tokens_a, f"turn {i}"
        # float32 logprobs, compared as float32: the router re-serializes JSON floats, which can move
        # the last digit of their double text
        assert np.array_equal(np.float32(lps_b), np.float32(lps_a)), f"turn {i}: logprobs differ"
    prefill = wait_settled(cluster["prefill"])
    cached = prefill["counters"]["cached_tokens"]
    assert cached["host"] > 0, cached  # prefixes came back from the prefill server's host pool
    for role in ("prefill", "decode"):
        info = wait_settled(cluster[role])
        pd = info["disaggregation"]
        assert pd["pd_failed"] == 0 and pd["pd_active_rooms"] == 0 and pd["pd_transferred"] >= CLIENTS * ROUNDS, pd
        assert info["counters"]["num_idle_checks"] > 0
        assert cluster[role].get("/health").status_code == 200


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
