"""The official ``openai`` SDK against one server: /v1/models, /v1/completions and
/v1/chat/completions, streamed and not; greedy text is the same either way and the same as
/generate's, and usage counts the tokens."""

import openai
import pytest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=10, suite="per-commit-cpu")

MODEL = "tiny-qwen3"
MAX_NEW = 10
PROMPT = "the quick brown fox jumps over the lazy dog"
GREEDY = {"temperature": 0, "max_tokens": MAX_NEW, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    srv = launch_server_process(model, "--context-length", "2048", "--max-total-tokens", "4096",
                                "--served-model-name", MODEL)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def native_text(server, prompt: str) -> str:
    out = server.generate(text=prompt, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                                        "ignore_eos": True})
    assert len(out["output_ids"]) == MAX_NEW
    return out["text"]


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions_plain_and_stream(client, server):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert plain.object == "text_completion" and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == MAX_NEW and plain.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == plain.choices[0].text == native_text(server, PROMPT)
    assert chunks[-1].usage.completion_tokens == MAX_NEW


def test_chat_plain_and_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    msg = plain.choices[0].message
    assert msg.role == "assistant" and msg.content and plain.usage.completion_tokens == MAX_NEW
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == msg.content
    assert chunks[-1].usage.completion_tokens == MAX_NEW and chunks[-1].choices == []


def test_sdk_surfaces_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    assert "max_tokens" in str(err.value)
