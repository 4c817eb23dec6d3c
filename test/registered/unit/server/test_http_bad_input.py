"""Bad input, against a real server over HTTP: every case answers 4xx with a message naming
the problem, and the server keeps serving. Start-up errors (missing model directory, unknown
architecture, impossible flags) stop the launcher with a message naming the flag."""

import json
import os
import shutil
import time

import pytest
import requests

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process, run_launcher

register_cpu_ci(est_time=20, suite="nightly-cpu")

CONTEXT = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture(scope="module")
def server(model):
    srv = launch_server_process(model, "--context-length", str(CONTEXT), "--max-total-tokens", "1024")
    try:
        yield srv
    finally:
        srv.stop()


def still_serving(server) -> None:
    out = server.generate(text="still here", sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 2


def post_raw(server, path: str, body: bytes) -> requests.Response:
    return requests.post(server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=30)


ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]
GOOD = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def check_4xx(resp: requests.Response, *words: str, status: int = 400) -> None:
    assert resp.status_code == status, resp.text
    message = resp.json()["error"]["message"]
    for w in words:
        assert w in message, message


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body", [b"{bad json", b"", b"\xff\xfe", b"[1, 2]", b'"text"'])
def test_malformed_json(server, route, body):
    check_4xx(post_raw(server, route, body), "JSON")
    still_serving(server)


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_top_level_field(server, route):
    check_4xx(server.post(route, {**GOOD[route], "no_such_field": 1}), "unknown fields", "no_such_field")
    still_serving(server)


def test_unknown_and_mistyped_sampling_params(server):
    check_4xx(server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokenz": 3}}), "max_new_tokenz")
    check_4xx(server.post("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}), "temperature")
    check_4xx(server.post("/v1/completions", {"prompt": "x", "max_tokens": "3"}), "max_tokens")
    check_4xx(server.post("/generate", {"text": "x", "stream": "yes"}), "stream")
    still_serving(server)


@pytest.mark.parametrize("route", ROUTES)
def test_prompt_longer_than_context(server, route):
    words = " ".join(f"w{i}" for i in range(CONTEXT * 2))
    body = dict(GOOD[route])
    if route == "/generate":
        body["text"] = words
    elif route == "/v1/completions":
        body["prompt"] = words
    else:
        body["messages"] = [{"role": "user", "content": words}]
    check_4xx(server.post(route, body), "context length", str(CONTEXT))
    check_4xx(server.post("/generate", {"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 100}}),
              "max_new_tokens", "context length")
    still_serving(server)


def test_negative_max_tokens(server):
    check_4xx(server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}), "max_new_tokens")
    check_4xx(server.post("/v1/completions", {"prompt": "x", "max_tokens": -5}), "max_tokens")
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}
    check_4xx(server.post("/v1/chat/completions", chat), "max_tokens")
    still_serving(server)


@pytest.mark.parametrize("body, words", [
    ({"text": "x", "input_ids": [1]}, ["exactly one"]),
    ({}, ["exactly one"]),
    ({"text": ""}, ["empty"]),
    ({"input_ids": []}, ["empty"]),
    ({"input_ids": [1, "2"]}, ["integers"]),
    ({"input_ids": [1, 10**6]}, ["input_ids must be in"]),
    ({"text": ["a", "b"]}, ["batch"]),
    ({"text": "x", "top_logprobs_num": -1}, ["top_logprobs_num"]),
])
def test_generate_field_errors(server, body, words):
    check_4xx(server.post("/generate", body), *words)
    still_serving(server)


@pytest.mark.parametrize("route, extra, words", [
    ("/v1/completions", {"n": 2}, ["n=2"]),
    ("/v1/completions", {"echo": True}, ["echo"]),
    ("/v1/completions", {"prompt": ["a", "b"]}, ["several prompts"]),
    ("/v1/chat/completions", {"messages": []}, ["messages"]),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, ["content"]),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, ["tools"]),
    ("/v1/chat/completions", {"frequency_penalty": 0.5}, ["frequency_penalty"]),
])
def test_openai_unsupported_features(server, route, extra, words):
    check_4xx(server.post(route, {**GOOD[route], **extra}), *words)
    still_serving(server)


RAW_TEXT_FIELD = {
    "/generate": b'{"text": %s, "sampling_params": {"max_new_tokens": 2}}',
    "/v1/completions": b'{"prompt": %s, "max_tokens": 2}',
    "/v1/chat/completions": b'{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}',
}


@pytest.mark.parametrize("route", ROUTES)
def test_lone_surrogate_is_a_400_json_error(server, route):
    resp = post_raw(server, route, RAW_TEXT_FIELD[route] % b'"a\\ud800b"')
    check_4xx(resp, "surrogate")
    assert resp.headers["content-type"].startswith("application/json")
    still_serving(server)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("raw", [b"Infinity", b"NaN"])
def test_non_finite_temperature(server, route, raw):
    body = {
        "/generate": b'{"text": "x", "sampling_params": {"temperature": %s}}',
        "/v1/completions": b'{"prompt": "x", "temperature": %s}',
        "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "x"}], "temperature": %s}',
    }[route] % raw
    check_4xx(post_raw(server, route, body), "temperature")
    still_serving(server)


@pytest.mark.parametrize("route, extra, words", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, ["top_logprobs", "[0, 20]"]),
    ("/generate", {"lora_path": "my-adapter"}, ["lora_path", "LoRA"]),
    ("/generate", {"return_hidden_states": True}, ["return_hidden_states", "not supported"]),
    ("/generate", {"bootstrap_pair_key": "k", "bootstrap_room": 1}, ["bootstrap_pair_key", "PD serving"]),
    ("/v1/chat/completions", {"separate_reasoning": True, "continue_final_message": True}, ["continue_final_message"]),
    ("/v1/completions", {"model": "tiny:adapter"}, ["model='tiny:adapter'", "LoRA"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "mood": "happy"}]},
     ["unknown fields", "messages[0].mood"]),
])
def test_upstream_fields_we_do_not_serve(server, route, extra, words):
    check_4xx(server.post(route, {**GOOD[route], **extra}), *words)
    still_serving(server)


def test_unknown_route_and_method(server):
    assert server.post("/no_such_route", {}).status_code == 404
    assert server.get("/generate").status_code == 405
    still_serving(server)


def test_bad_requests_are_counted(server):
    server.post("/generate", {"bogus": 1})
    metrics = server.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("sglang:num_bad_requests_total"))
    assert float(line.split()[-1]) >= 1


# ---- start-up errors: the launcher exits with a message naming the flag ------------------------------
def test_missing_model_directory(tmp_path):
    proc = run_launcher(str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "--model-path" in proc.stderr and "not a directory" in proc.stderr


def test_unknown_architecture(model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    proc = run_launcher(str(bad))
    assert proc.returncode == 2
    assert "MysteryForCausalLM" in proc.stderr and "LlamaForCausalLM" in proc.stderr


def test_missing_weights_fail_at_startup(model, tmp_path):
    bad = tmp_path / "noweights"
    shutil.copytree(model, bad)
    os.remove(bad / "model.safetensors")
    proc = run_launcher(str(bad), "--max-total-tokens", "256")
    assert proc.returncode == 1
    assert "server failed to start" in proc.stderr


@pytest.mark.parametrize("flags, words", [
    (["--enable-hierarchical-cache", "--hicache-mem-layout", "page_head", "--hicache-io-backend", "direct"],
     ["--hicache-mem-layout page_head", "--hicache-io-backend direct", "supported"]),
    (["--hicache-storage-backend", "file"], ["--hicache-storage-backend", "--enable-hierarchical-cache"]),
    (["--tp-size", "0"], ["--tp-size", ">= 1"]),
    (["--load-format", "pickle"], ["--load-format", "dummy"]),
])
def test_impossible_flags(model, flags, words):
    proc = run_launcher(model, *flags)
    assert proc.returncode == 2
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_dead_scheduler_answers_503(model):
    import psutil

    with launch_server_process(model, "--max-total-tokens", "512") as srv:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        schedulers = [c for c in children if "spawn_main" in " ".join(c.cmdline()) and
                      "resource_tracker" not in " ".join(c.cmdline())]
        assert schedulers, [c.cmdline() for c in children]
        for proc in schedulers:
            proc.kill()
        deadline = time.monotonic() + 15
        while srv.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200 after the scheduler died"
            time.sleep(0.05)
        check_4xx(srv.get("/health"), "scheduler", status=503)
        check_4xx(srv.post("/generate", GOOD["/generate"]), "scheduler", status=503)
        check_4xx(srv.post("/v1/completions", GOOD["/v1/completions"]), "scheduler", status=503)
