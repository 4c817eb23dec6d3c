"""PD serving end to end, tp 1 -> 1: a prefill server and a decode server (NIXL UCX on loopback)
behind the real sglang-router in PD mode. Greedy outputs through the router are token-identical
to a plain server's, for single prompts and a multi-turn workload, on /generate and
/v1/completions and /v1/chat/completions, streamed and not; both PD servers end with every slot
accounted for (idle integrity check) and no room open. Also: the request schema per mode (null
ignores bootstrap fields, decode refuses requests without them)."""

import json

import numpy as np
import pytest
import requests

from pd_cluster import decode_flags, free_ports, generate_ids, launch_servers, prefill_flags, wait_settled
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_pd_router

register_cpu_ci(est_time=40, suite="per-commit-cpu")

PROMPTS = ["the quick brown fox jumps over", "a long time ago in a galaxy", "the quick brown fox sleeps"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    (bootstrap_port,) = free_ports(1)
    logs = str(tmp_path_factory.mktemp("logs"))
    single, prefill, decode = launch_servers(model, [(), prefill_flags(bootstrap_port), decode_flags()], log_dir=logs)
    router = None
    try:
        router = launch_pd_router([(prefill.url, bootstrap_port)], [decode.url], log_dir=logs)
        yield {"single": single, "prefill": prefill, "decode": decode, "router": router,
               "bootstrap_port": bootstrap_port, "model": model}
    finally:
        for proc in (router, single, prefill, decode):
            if proc is not None:
                proc.stop()


def sse_events(resp: requests.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text[:500]
    return [json.loads(line[6:]) for line in (raw.decode("utf-8") for raw in resp.iter_lines())  # SSE is UTF-8
            if line.startswith("data: ") and line != "data: [DONE]"]


def text_generate(url: str, prompt: str, stream: bool) -> list[int]:
    body = {"text": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    resp = requests.post(url + "/generate", json=body, timeout=120, stream=stream)
    if stream:
        return sse_events(resp)[-1]["output_ids"]
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()["output_ids"]


def completion(url: str, prompt: str, stream: bool, chat: bool = False) -> str:
    body = {"model": "tiny", "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "stream": stream}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = requests.post(url + path, json=body, timeout=120, stream=stream)
    if stream:
        key = "delta" if chat else None
        return "".join((c[key].get("content") or "") if key else c["text"]
                       for e in sse_events(resp) for c in e["choices"])
    assert resp.status_code == 200, resp.text[:500]
    choice = resp.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_generate_through_pd_router_is_token_identical(cluster, stream):
    for prompt in PROMPTS:
        direct = text_generate(cluster["single"].url, prompt, stream=False)
        assert len(direct) == MAX_NEW
        assert text_generate(cluster["router"].url, prompt, stream) == direct, prompt


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_routes_through_pd_router_are_identical(cluster, chat, stream):
    for prompt in PROMPTS[:2]:
        direct = completion(cluster["single"].url, prompt, stream=False, chat=chat)
        assert direct
        assert completion(cluster["router"].url, prompt, stream, chat=chat) == direct, prompt


def test_multi_turn_workload_is_token_identical(cluster):
    """Three conversations, three turns each, interleaved: every turn's prompt is the previous
    prompt + answer + new user tokens, so prefill reuses its cached prefixes."""
    convs = {c: [10 + 37 * c + (i * 13) % 500 for i in range(40 + 20 * c)] for c in range(3)}
    single, router = cluster["single"].url, cluster["router"].url
    for turn in range(3):
        for c, history in convs.items():
            want = generate_ids(single, history, 16)
            got = generate_ids(router, history, 16, stream=turn == 1)
            assert got == want, f"conversation {c} turn {turn}"
            convs[c] = history + want + [(7 * turn + c + i) % 900 + 5 for i in range(9)]
    prefill = wait_settled(cluster["prefill"])
    assert prefill["counters"]["cached_tokens"]["device"] > 0  # later turns hit the prefill tree


def test_seeded_sampling_is_identical(cluster):
    """With a sampling seed, temperature sampling through PD draws the same tokens as a plain
    server: prefill samples the first token at step 0, decode continues from step 1."""
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95,
                                                     "sampling_seed": 1234, "ignore_eos": True}}
    want = cluster["single"].post("/generate", body).json()["output_ids"]
    got = requests.post(cluster["router"].url + "/generate", json=body, timeout=120).json()["output_ids"]
    assert got == want
    greedy = cluster["single"].post("/generate", {**body, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
    assert got != greedy  # the seed really sampled


def test_burst_beyond_decode_memory_queues_and_matches(cluster):
    """16 concurrent requests needing ~2.6x the decode pool (4096 tokens): decode admits them
    from its pre-allocation queue as memory frees up (prompt + all decode pages reserved up
    front), and every output still matches the plain server's."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[20 + (i * 31 + k * 7) % 900 for i in range(600)] for k in range(16)]
    single, router = cluster["single"].url, cluster["router"].url
    want = [generate_ids(single, p, 64) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: generate_ids(router, p, 64), prompts))
    assert got == want
    assert wait_settled(cluster["decode"])["disaggregation"]["pd_memory_waits"] > 0  # the queue really waited


def test_pd_servers_settle_clean(cluster):
    """After the workload: nothing queued, no room open, no failure, integrity checks ran."""
    for role in ("prefill", "decode"):
        srv = cluster[role]
        info = wait_settled(srv)
        pd = info["disaggregation"]
        assert pd["disaggregation_mode"] == role
        assert pd["pd_failed"] == 0 and pd["pd_active_rooms"] == 0, pd
        assert pd["pd_transferred"] > 0
        assert info["counters"]["num_idle_checks"] > 0  # a failed integrity check kills the server
        assert srv.get("/health").status_code == 200


def test_request_schema_per_mode(cluster):
    """Null mode ignores the bootstrap fields (as upstream's normal server does); the decode
    server refuses a request without them, naming them; bad values are refused everywhere."""
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    single, decode = cluster["single"], cluster["decode"]
    plain = single.post("/generate", body).json()["output_ids"]
    routed = single.post("/generate", {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1,
                                       "bootstrap_room": 5}).json()["output_ids"]
    assert routed == plain
    resp = decode.post("/generate", body)
    assert resp.status_code == 400 and "bootstrap_room" in resp.text and "bootstrap_host" in resp.text, resp.text
    resp = single.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "bootstrap_room": -1})
    assert resp.status_code == 400 and "bootstrap_room" in resp.text, resp.text
    resp = single.post("/generate", {**body, "bootstrap_room": "7"})
    assert resp.status_code == 400, resp.text
    resp = decode.post("/generate", {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 3,
                                     "return_logprob": True, "top_logprobs_num": 21})
    assert resp.status_code == 400 and "top_logprobs_num must be in [0, 20]" in resp.text, resp.text


def test_first_token_logprobs_travel_with_the_kv(cluster):
    """The first token's logprob and top logprobs come from prefill (aux buffers): the same as a
    plain server's, at float32."""
    body = {"text": PROMPTS[1], "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    want = cluster["single"].post("/generate", body).json()["meta_info"]
    got = requests.post(cluster["router"].url + "/generate", json=body, timeout=120).json()["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert len(got[key]) == len(want[key]) == 5, key
    f32 = lambda x: float(np.float32(x))  # noqa: E731  (the router re-serializes JSON floats)
    assert [(f32(lp), t) for lp, t, _ in got["output_token_logprobs"]] == [
        (f32(lp), t) for lp, t, _ in want["output_token_logprobs"]]
    assert [[(f32(lp), t) for lp, t, _ in top] for top in got["output_top_logprobs"]] == [
        [(f32(lp), t) for lp, t, _ in top] for top in want["output_top_logprobs"]]


def test_bootstrap_port_in_use_stops_the_prefill_server(cluster):
    """A second prefill server on the same bootstrap port fails at start-up, naming the flag."""
    from sglang.test.server_utils import run_launcher

    proc = run_launcher(cluster["model"], *prefill_flags(cluster["bootstrap_port"]), timeout_s=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"--disaggregation-bootstrap-port {cluster['bootstrap_port']}" in out, out[-2000:]


@pytest.mark.parametrize("flags, words", [
    ({"disaggregation_mode": "both"}, ["--disaggregation-mode", "null, prefill, decode"]),
    ({"disaggregation_transfer_backend": "mori"}, ["--disaggregation-transfer-backend", "nixl, mooncake"]),
    ({"disaggregation_mode": "prefill", "port": 8998}, ["--disaggregation-bootstrap-port 8998", "--port"]),
    ({"disaggregation_mode": "decode", "device": "cuda"}, ["--device cuda", "host (DRAM)"]),
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 0}, ["--disaggregation-bootstrap-port 0"]),
])
def test_impossible_flag_combinations_are_refused(flags, words):
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError) as info:
        ServerArgs(model_path="/nonexistent", **flags)
    assert all(w in str(info.value) for w in words), str(info.value)



def test_mooncake_backend_checks_its_own_engine_at_startup(monkeypatch):
    import sys

    from sglang.srt.server_args import ServerArgs

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # mooncake needs no NIXL
    args = ServerArgs(model_path="/nonexistent", disaggregation_mode="prefill",
                      disaggregation_transfer_backend="mooncake")
    assert args.disaggregation_transfer_backend == "mooncake"
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # the wheel missing: refused at startup
    with pytest.raises(ValueError, match="libibverbs1"):
        ServerArgs(model_path="/nonexistent", disaggregation_mode="decode", disaggregation_transfer_backend="mooncake")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
