"""Request schemas without a server: upstream's full field sets at their defaults are accepted
and mean the same as a minimal body; unsupported values and unknown fields are refused naming
the field; bad text and numbers are refused."""

import json

import pytest

from sglang.srt.entrypoints.openai_convert import parse_chat, parse_completion
from sglang.srt.entrypoints.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from sglang.srt.managers.generate_request import BadRequestError, GenerateReqInput, parse_sampling_params
from sglang.srt.sampling.sampling_params import UPSTREAM_ONLY
from sglang.srt.tokenizer import get_tokenizer
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from upstream_bodies import (BENCH_MULTITURN, BENCH_SERVING, ROUTER_CHAT, ROUTER_COMPLETION, ROUTER_GENERATE,
                             SAMPLING_DEFAULTS, full_chat, full_completion, full_generate)

register_cpu_ci(est_time=6, suite="per-commit-cpu")

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3"))


def parse(route: str, body: dict, tokenizer=None):
    if route == "/generate":
        obj = GenerateReqInput.from_json(body)
        obj.parsed_sampling_params()
        return obj
    if route == "/v1/completions":
        return parse_completion(body)
    return parse_chat(body, tokenizer)


def refused(route: str, body: dict, tokenizer=None) -> str:
    with pytest.raises(BadRequestError) as err:
        parse(route, body, tokenizer)
    return str(err.value)


# ---- upstream's full field sets at their defaults ----------------------------------------------
def test_generate_full_defaults_equal_minimal():
    full = GenerateReqInput.from_json(full_generate(text="hi"))
    minimal = GenerateReqInput.from_json({"text": "hi"})
    assert full.parsed_sampling_params() == minimal.parsed_sampling_params()
    assert (full.text, full.stream, full.return_logprob, full.top_logprobs_num, full.logprob_start_len) == \
        (minimal.text, minimal.stream, minimal.return_logprob, minimal.top_logprobs_num, -1)


def test_completion_full_defaults_equal_minimal():
    full = parse_completion(full_completion(prompt="hi"))
    minimal = parse_completion({"prompt": "hi"})
    assert full.gen.model_dump() == minimal.gen.model_dump()
    assert full.gen.parsed_sampling_params().max_new_tokens == 16  # OpenAI's default
    assert full.model == "default" and not full.include_usage


def test_chat_full_defaults_equal_minimal(tokenizer):
    full = parse_chat(full_chat(messages=MESSAGES), tokenizer)
    minimal = parse_chat({"messages": MESSAGES}, tokenizer)
    assert full.gen.model_dump() == minimal.gen.model_dump()
    assert full.gen.input_ids == tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)


@pytest.mark.parametrize("route, body", [
    ("/generate", ROUTER_GENERATE), ("/v1/completions", ROUTER_COMPLETION), ("/v1/chat/completions", ROUTER_CHAT),
    ("/generate", BENCH_MULTITURN), ("/generate", BENCH_SERVING),
])
def test_bodies_seen_on_the_wire_are_accepted(tokenizer, route, body):
    parse(route, body, tokenizer)


def test_nulls_mean_defaults_in_sampling_params():
    nulls = {k: None for k in SAMPLING_DEFAULTS if k != "max_new_tokens"}
    assert parse_sampling_params(nulls) == parse_sampling_params({})
    assert parse_sampling_params(SAMPLING_DEFAULTS) == parse_sampling_params({})


# ---- values that ask for what this server does not do ------------------------------------------
CANDIDATES = [True, False, "x", 7, 0.5, {"k": 1}, ["x"], [1], "last", "required"]


def assert_each_unsupported_field_refused(model, route: str, base: dict, tokenizer=None) -> None:
    assert model.UNSUPPORTED, model
    for name in model.UNSUPPORTED:
        messages = []
        for value in CANDIDATES:
            try:
                parse(route, {**base, name: value}, tokenizer)
            except BadRequestError as exc:
                messages.append(str(exc))
        assert any(m.startswith(f"{name}=") and "is not supported by this server" in m for m in messages), \
            (name, messages)


def test_generate_unsupported_fields_refused_naming_them():
    assert_each_unsupported_field_refused(GenerateReqInput, "/generate", {"text": "hi"})


def test_completion_unsupported_fields_refused_naming_them():
    assert_each_unsupported_field_refused(CompletionRequest, "/v1/completions", {"prompt": "hi"})


def test_chat_unsupported_fields_refused_naming_them(tokenizer):
    assert_each_unsupported_field_refused(ChatCompletionRequest, "/v1/chat/completions", {"messages": MESSAGES},
                                          tokenizer)
    for name in ChatMessage.UNSUPPORTED:
        value = ["x"] if name in ("tool_calls", "tools") else "x"
        message = refused("/v1/chat/completions", {"messages": [MESSAGES[0], {**MESSAGES[0], name: value}]}, tokenizer)
        assert message.startswith(f"messages[1]: {name}={value!r} is not supported by this server"), message


@pytest.mark.parametrize("name", sorted(UPSTREAM_ONLY))
def test_upstream_only_sampling_params_refused_off_default(name):
    default = UPSTREAM_ONLY[name][0]
    if default is None:
        value = "x"
    elif isinstance(default, bool):
        value = not default
    else:
        value = default + 2
    message = refused("/generate", {"text": "hi", "sampling_params": {name: value}})
    assert f"sampling param {name}=" in message and "not supported" in message


@pytest.mark.parametrize("route, body, words", [
    # null mode ignores bootstrap_host/port/room (the PD fields; see test_pd_server.py) but checks their values
    ("/generate", {"text": "hi", "bootstrap_pair_key": "k"}, ["bootstrap_pair_key", "PD serving"]),
    ("/generate", {"text": "hi", "bootstrap_room": -7}, ["bootstrap_room", "[0, 2**63)"]),
    ("/v1/completions", {"prompt": "hi", "bootstrap_port": 0}, ["bootstrap_port", "[1, 65535]"]),
    ("/generate", {"text": "hi", "lora_path": "adapter"}, ["lora_path", "LoRA"]),
    ("/generate", {"text": "hi", "return_hidden_states": True}, ["return_hidden_states"]),
    ("/generate", {"text": "hi", "log_metrics": False}, ["log_metrics"]),
    ("/generate", {"text": "hi", "routed_dp_rank": 1}, ["routed_dp_rank", "rank (0)"]),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 0}, ["logprob_start_len", "-1"]),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": None}}, ["max_new_tokens", "no limit"]),
    ("/v1/completions", {"prompt": "hi", "model": "base:my-adapter"}, ["model='base:my-adapter'", "LoRA"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, ["tool_choice"]),
])
def test_specific_refusals(tokenizer, route, body, words):
    message = refused(route, body, tokenizer)
    for w in words:
        assert w in message, message


def test_accepted_equivalents_of_defaults():
    assert GenerateReqInput.from_json({"text": "hi", "routed_dp_rank": 0, "lora_path": "", "token_ids_logprob": []})
    assert GenerateReqInput.from_json({"text": "hi", "logprob_start_len": 5})  # no logprobs asked: nothing to do
    assert parse_completion({"prompt": "hi", "model": "any-name", "best_of": 1}).model == "any-name"


# ---- unknown fields -----------------------------------------------------------------------------
@pytest.mark.parametrize("route, body, field", [
    ("/generate", {"text": "hi", "no_such_field": 1}, "no_such_field"),
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ("/v1/chat/completions", {"messages": MESSAGES, "no_such_field": 1}, "no_such_field"),
    ("/v1/chat/completions", {"messages": [{**MESSAGES[0], "mood": "x"}]}, "messages[0].mood"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokenz": 3}}, "max_new_tokenz"),
])
def test_unknown_fields_refused_naming_them(tokenizer, route, body, field):
    message = refused(route, body, tokenizer)
    assert "unknown" in message and field in message, message


# ---- bad text and numbers -------------------------------------------------------------------------
SURROGATE = json.loads('"a\\ud800b"')  # what a JSON parser makes of a lone surrogate escape


@pytest.mark.parametrize("route, body, path", [
    ("/generate", {"text": SURROGATE}, "text"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["ok", SURROGATE]}}, "sampling_params.stop[1]"),
])
def test_lone_surrogate_refused_with_its_path(tokenizer, route, body, path):
    message = refused(route, body, tokenizer)
    assert message.startswith(path) and "surrogate" in message, message


@pytest.mark.parametrize("raw", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize("route, base", [("/generate", None), ("/v1/completions", {"prompt": "hi"}),
                                         ("/v1/chat/completions", {"messages": MESSAGES})])
def test_non_finite_temperature_refused(tokenizer, raw, route, base):
    value = json.loads(raw)
    body = {"text": "hi", "sampling_params": {"temperature": value}} if base is None else {**base, "temperature": value}
    assert "temperature" in refused(route, body, tokenizer)


@pytest.mark.parametrize("top, ok", [(0, True), (20, True), (21, False), (-1, False)])
def test_top_logprobs_limit(tokenizer, top, ok):
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": top}
    if ok:
        assert parse_chat(body, tokenizer).gen.top_logprobs_num == top
    else:
        assert "top_logprobs must be in [0, 20]" in refused("/v1/chat/completions", body, tokenizer)


@pytest.mark.parametrize("body, words", [
    ({"text": "hi", "stream": "yes"}, ["stream", "boolean"]),
    ({"text": "hi", "top_logprobs_num": True}, ["top_logprobs_num", "integer"]),
    ({"text": ["a", "b"]}, ["batch"]),
    ({"input_ids": [[1, 2], [3]]}, ["batch"]),
    ({"text": "hi", "rid": ["a"]}, ["batch"]),
    ({"text": "hi", "input_ids": [1]}, ["exactly one"]),
])
def test_generate_shape_errors(body, words):
    message = refused("/generate", body)
    for w in words:
        assert w in message, message
