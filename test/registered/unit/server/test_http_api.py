"""The HTTP API of a real server on a tiny model: /generate (text, input_ids, streaming),
the OpenAI routes, /health, /get_server_info, /flush_cache, /metrics, and the abort of
requests whose client disconnected."""

import json
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.tokenizer import get_tokenizer
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process
from upstream_bodies import (BENCH_MULTITURN, ROUTER_CHAT, ROUTER_COMPLETION, ROUTER_GENERATE, SAMPLING_DEFAULTS,
                             full_chat, full_completion, full_generate)

register_cpu_ci(est_time=20, suite="per-commit-cpu")

GREEDY = {"temperature": 0, "ignore_eos": True}
ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


@pytest.fixture(scope="module")
def server(model):
    # upstream flags accepted without effect ride along, so a launch with them is tested too
    srv = launch_server_process(model, "--context-length", "4096", "--max-total-tokens", "8192",
                                "--served-model-name", "tiny-qwen3", "--tokenizer-path", model, "--enable-metrics",
                                "--enable-cache-report", "--trust-remote-code", "--disable-hicache-numa-detect",
                                "--admin-api-key", ADMIN_KEY)
    try:
        yield srv
    finally:
        srv.stop()


def sse_events(resp: requests.Response) -> list:
    events = []
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def samples(server) -> list:
    return [s for fam in text_string_to_metric_families(server.get("/metrics").text) for s in fam.samples]


def metric(server, name: str, **labels) -> float:
    for sample in samples(server):
        if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items()):
            return sample.value
    raise AssertionError(f"metric {name} {labels} not found")


def test_generate_text_and_input_ids_agree(server, model):
    text = "the quick brown fox"
    a = server.generate(text=text, sampling_params={"max_new_tokens": 6, **GREEDY}, return_logprob=True)
    ids = get_tokenizer(model).encode(text)
    b = server.generate(input_ids=ids, sampling_params={"max_new_tokens": 6, **GREEDY})
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"] and len(a["output_ids"]) == 6
    meta = b["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length"}
    assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values()) > 0  # a's prompt was reused
    assert set(meta["cached_tokens_details"]) == {"device", "host", "storage"}
    logprobs = a["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == a["output_ids"] and all(lp <= 0 for lp, _, _ in logprobs)


def test_generate_stream_is_cumulative_and_ends_with_done(server):
    body = {"text": "stream me", "sampling_params": {"max_new_tokens": 20, **GREEDY}, "stream": True}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    lengths = [len(c["output_ids"]) for c in chunks]  # one chunk per step, merged if the reader lags
    assert lengths == sorted(set(lengths)) and lengths[-1] == 20 and len(chunks) >= 2
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    plain = server.generate(text="stream me", sampling_params={"max_new_tokens": 20, **GREEDY})
    assert chunks[-1]["output_ids"] == plain["output_ids"] and chunks[-1]["text"] == plain["text"]


def test_openai_completions(server):
    body = {"model": "tiny-qwen3", "prompt": "hello there", "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    out = server.post("/v1/completions", body).json()
    assert out["object"] == "text_completion" and out["model"] == "tiny-qwen3"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == 4
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    usage = out["usage"]
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert set(usage["prompt_tokens_details"]["cached_tokens_details"]) == {"device", "host", "storage"}
    ref = server.generate(text="hello there", sampling_params={"max_new_tokens": 4, **GREEDY})
    assert choice["text"] == ref["text"]
    with requests.post(server.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == ref["text"]


def test_openai_chat(server):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "ignore_eos": True}
    out = server.post("/v1/chat/completions", body).json()
    assert out["object"] == "chat.completion"
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant" and len(out["choices"][0]["logprobs"]["content"]) == 5
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(server.url + "/v1/chat/completions", json=stream_body, stream=True, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"]["content"] for e in events[:-2])
    assert content == message["content"]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5


def test_models_health_info(server):
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-qwen3" and models["data"][0]["max_model_len"] == 4096
    assert server.get("/health").status_code == 200
    info = server.get("/get_server_info").json()
    assert info["max_total_num_tokens"] == 8192 and info["context_len"] == 4096 and info["page_size"] == 1
    assert info["enable_hierarchical_cache"] is False and "scheduler" in info


def test_flush_cache_drops_device_prefixes(server):
    ids = list(range(10, 60))
    server.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    again = server.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == 49
    resp = server.post("/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code == 200 and "flushed" in resp.text
    assert metric(server, "sglang:cache_pool_used_tokens", tier="device") == 0
    cold = server.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert cold["meta_info"]["cached_tokens"] == 0


def test_metrics_prometheus_text(server):
    before = metric(server, "sglang:time_to_first_token_seconds_count")
    served = metric(server, "sglang:cached_tokens_total", tier="device")
    server.generate(text="count me", sampling_params={"max_new_tokens": 2})
    server.generate(text="count me", sampling_params={"max_new_tokens": 2})
    resp = server.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert families["sglang:time_to_first_token_seconds"].type == "histogram"
    assert metric(server, "sglang:time_to_first_token_seconds_bucket", model_name="tiny-qwen3", le="+Inf") == before + 2
    assert metric(server, "sglang:time_to_first_token_seconds_count") == before + 2
    assert metric(server, "sglang:cached_tokens_total", tier="device") > served
    assert metric(server, "sglang:cache_pool_capacity_tokens", tier="device") == 8192


def _wait_aborted(server, before: float, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "sglang:num_aborted_requests_total") > before and \
                metric(server, "sglang:num_running_reqs") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the disconnected request was not aborted")


def test_disconnected_stream_is_aborted(server):
    before = metric(server, "sglang:num_aborted_requests_total")
    generated = metric(server, "sglang:generation_tokens_total")
    body = {"text": "long story", "sampling_params": {"max_new_tokens": 3000, **GREEDY}, "stream": True}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as resp:
        next(resp.iter_lines())  # the first token arrived; now hang up
    _wait_aborted(server, before)
    assert metric(server, "sglang:generation_tokens_total") - generated < 3000  # cut short
    server.generate(text="after abort", sampling_params={"max_new_tokens": 2})


def test_disconnected_blocking_request_is_aborted(server):
    before = metric(server, "sglang:num_aborted_requests_total")
    body = {"text": "long story", "sampling_params": {"max_new_tokens": 3000, **GREEDY}}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/generate", json=body, timeout=0.5)
    _wait_aborted(server, before)


# ---- upstream's request schemas (see test_request_schemas.py for the unit-level cases) ------------
def _text(route: str, out: dict) -> str:
    if route == "/generate":
        return out["text"]
    choice = out["choices"][0]
    return choice["text"] if route == "/v1/completions" else choice["message"]["content"]


FULL_AND_MINIMAL = {
    "/generate": (full_generate(text="tell me", sampling_params={**SAMPLING_DEFAULTS, "max_new_tokens": 6, **GREEDY}),
                  {"text": "tell me", "sampling_params": {"max_new_tokens": 6, **GREEDY}}),
    "/v1/completions": (full_completion(prompt="tell me", max_tokens=6, temperature=0, ignore_eos=True),
                        {"prompt": "tell me", "max_tokens": 6, "temperature": 0, "ignore_eos": True}),
    "/v1/chat/completions": (full_chat(messages=[{"role": "user", "content": "tell me"}], max_tokens=6, temperature=0,
                                       ignore_eos=True),
                             {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 6, "temperature": 0,
                              "ignore_eos": True}),
}


@pytest.mark.parametrize("route", list(FULL_AND_MINIMAL))
def test_every_upstream_field_at_its_default_gives_the_minimal_output(server, route):
    full, minimal = FULL_AND_MINIMAL[route]
    a, b = server.post(route, full), server.post(route, minimal)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert _text(route, a.json()) == _text(route, b.json()) != ""
    if route == "/generate":
        assert a.json()["output_ids"] == b.json()["output_ids"] and len(a.json()["output_ids"]) == 6


@pytest.mark.parametrize("route, body", [("/generate", ROUTER_GENERATE), ("/v1/completions", ROUTER_COMPLETION),
                                         ("/v1/chat/completions", ROUTER_CHAT), ("/generate", BENCH_MULTITURN)])
def test_bodies_of_router_and_benchmarks_are_served(server, route, body):
    with requests.post(server.url + route, json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200, resp.text
        if body.get("stream"):
            events = sse_events(resp)
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])


def test_openai_model_name_is_echoed_as_upstream(server):
    out = server.post("/v1/chat/completions", {**ROUTER_CHAT, "model": "some-other-name"}).json()
    assert out["model"] == "some-other-name"
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).json()["model"] == "tiny-qwen3"


def test_return_text_in_logprobs(server):
    out = server.generate(text="logprob text", sampling_params={"max_new_tokens": 3, **GREEDY}, return_logprob=True,
                          top_logprobs_num=2, return_text_in_logprobs=True)
    entries = out["meta_info"]["output_token_logprobs"]
    assert "".join(text for _, _, text in entries) == out["text"]
    assert all(isinstance(text, str) for top in out["meta_info"]["output_top_logprobs"] for _, _, text in top)


def test_continuous_usage_stats_puts_usage_in_every_chunk(server):
    body = {"prompt": "usage please", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
        events = sse_events(resp)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == sorted(c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and events[-2]["usage"]["completion_tokens"] == 4


def test_model_and_server_info_as_the_router_reads_them(server, model):
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path).json()
        assert info["model_path"] == model and info["tokenizer_path"] == model and info["is_generation"] is True
        assert info["served_model_name"] == "tiny-qwen3" and info["architectures"] == ["Qwen3ForCausalLM"]
    for path in ("/get_server_info", "/server_info"):
        info = server.get(path).json()
        assert info["served_model_name"] == "tiny-qwen3" and info["model_path"] == model


def test_upstream_gauges_follow_the_engine(server):
    for _ in range(2):  # the second one reuses the first one's prompt
        server.generate(text="gauge me", sampling_params={"max_new_tokens": 8, **GREEDY})
    assert metric(server, "sglang:num_used_tokens") == metric(server, "sglang:cache_pool_used_tokens", tier="device")
    assert metric(server, "sglang:token_usage") == metric(server, "sglang:num_used_tokens") / 8192
    assert metric(server, "sglang:gen_throughput") > 0  # 8 tokens just arrived, inside the 10 s window
    assert 0 < metric(server, "sglang:cache_hit_rate") < 1
    assert metric(server, "sglang:inter_token_latency_seconds_count") >= 7
