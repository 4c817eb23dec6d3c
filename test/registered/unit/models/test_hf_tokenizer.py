"""Tokenizer of a make_tiny_model directory: deterministic, text round-trips, special tokens,
chat template, and clear errors."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.tokenizer import get_tokenizer
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=6, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return make_tiny_model(str(root / "llama"), "llama"), make_tiny_model(str(root / "qwen3"), "qwen3")


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_any_text_round_trips(model_dirs, text):
    tok = get_tokenizer(model_dirs[1])
    assert tok.decode(tok.encode(text)) == text


def test_vocab_specials_and_bos(model_dirs):
    llama, qwen = (get_tokenizer(d) for d in model_dirs)
    assert llama.vocab_size == qwen.vocab_size == 1000
    assert llama.encode("the cache")[0] == llama.bos_token_id
    assert qwen.encode("the cache")[0] != qwen.bos_token_id
    assert llama.eos_token_ids == sorted({llama._tok.token_to_id("<|eos|>"), llama._tok.token_to_id("<|im_end|>")})
    ids = qwen.encode("the page of the tree")
    assert len(ids) <= 5  # learned merges: common words are single tokens
    assert qwen.decode(qwen.encode("<|im_start|>hi"), skip_special_tokens=True) == "hi"


def test_chat_template(model_dirs):
    tok = get_tokenizer(model_dirs[0])
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok._tok.token_to_id("<|im_start|>")
    with pytest.raises(ValueError, match=r"messages\[0\] must be"):
        tok.apply_chat_template([{"role": "user"}])


def test_hf_style_template_with_raise_exception(model_dirs, tmp_path):
    import shutil

    shutil.copytree(model_dirs[0], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}{{ bos_token }}{{ messages[0]['content'] }}"
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = get_tokenizer(str(tmp_path / "m"))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|bos|>x"
    with pytest.raises(ValueError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_missing_tokenizer_names_the_directory(tmp_path):
    with pytest.raises(ValueError, match=f"no tokenizer.json in '{tmp_path}'"):
        get_tokenizer(str(tmp_path))
