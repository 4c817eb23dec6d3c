"""The real sglang router (regular mode, cache_aware) in front of two of our servers: greedy
outputs through it are token-identical to asking a server directly, on /generate,
/v1/completions and /v1/chat/completions, streamed and not."""

import json

import pytest
import requests

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.router_utils import launch_router
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=15, suite="per-commit-cpu")

PROMPTS = ["the quick brown fox jumps over", "a long time ago in a galaxy", "the quick brown fox sleeps"]
MAX_NEW = 12
SERVER_FLAGS = ("--context-length", "2048", "--max-total-tokens", "4096", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    started = []
    try:
        for _ in range(2):
            started.append(launch_server_process(model, *SERVER_FLAGS))
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def router(servers):
    r = launch_router([s.url for s in servers], "cache_aware")
    try:
        yield r
    finally:
        r.stop()


def sse(resp: requests.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text[:500]
    events = []
    for raw in resp.iter_lines():
        line = raw.decode("utf-8")  # SSE is UTF-8 whatever the content type says
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def generate(url: str, prompt: str, stream: bool) -> list[int]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
            "stream": stream}
    resp = requests.post(url + "/generate", json=body, timeout=120, stream=stream)
    if stream:
        return sse(resp)[-1]["output_ids"]  # cumulative
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()["output_ids"]


def completion(url: str, prompt: str, stream: bool) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    resp = requests.post(url + "/v1/completions", json=body, timeout=120, stream=stream)
    if stream:
        events = sse(resp)
        return "".join(c["text"] for e in events for c in e["choices"]), events[-1]["usage"]["completion_tokens"]
    assert resp.status_code == 200, resp.text[:500]
    out = resp.json()
    return out["choices"][0]["text"], out["usage"]["completion_tokens"]


def chat(url: str, prompt: str, stream: bool) -> tuple[str, int]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW,
            "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    resp = requests.post(url + "/v1/chat/completions", json=body, timeout=120, stream=stream)
    if stream:
        events = sse(resp)
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        return text, events[-1]["usage"]["completion_tokens"]
    assert resp.status_code == 200, resp.text[:500]
    out = resp.json()
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_generate_through_router_is_token_identical(servers, router, stream):
    for prompt in PROMPTS:
        direct = [generate(s.url, prompt, stream=False) for s in servers]
        assert direct[0] == direct[1] and len(direct[0]) == MAX_NEW  # both workers agree: routing cannot matter
        assert generate(router.url, prompt, stream) == direct[0], prompt


@pytest.mark.parametrize("route", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_routes_through_router_are_identical(servers, router, route, stream):
    for prompt in PROMPTS:
        direct = route(servers[0].url, prompt, stream=False)
        assert direct == route(servers[1].url, prompt, stream=False)
        assert direct[1] == MAX_NEW and direct[0]
        assert route(router.url, prompt, stream) == direct, prompt


def test_completion_text_matches_native_tokens(servers, router):
    """The OpenAI text is the detokenized /generate tokens (so text equality is token equality)."""
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    native = requests.post(servers[0].url + "/generate", json=body, timeout=120).json()
    assert completion(router.url, PROMPTS[0], stream=True)[0] == native["text"]


def test_both_workers_registered(servers, router):
    """The router knows both workers (it may still send a given prefix to one of them)."""
    resp = router.get("/workers")
    assert resp.status_code == 200, resp.text[:300]
    text = resp.text
    assert all(s.url in text for s in servers), text[:500]
