"""Payload-level request helpers of upstream's ``sglang.test.kits.cache_hit_kit``, as used by
``benchmark/hicache/bench_multiturn.py``: build a ``/generate`` or chat payload, send it
(streaming) and get a ``RequestFuncOutput`` with ``ttft``, ``itl``, ``latency``,
``prompt_len``, ``cached_tokens``, ``generated_len`` and (native route) ``output_ids``."""

from __future__ import annotations

from sglang.benchmark.request_funcs import (
    RequestFuncOutput,
    chat_text,
    native_on_body,
    openai_on_body,
    post_payload,
)


def _headers(headers: dict | None, api_key: str | None) -> dict:
    out = dict(headers or {})
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


async def async_request_sglang_generate(payload: dict, url: str, pbar=None, headers: dict | None = None,
                                        api_key: str | None = None) -> RequestFuncOutput:
    """POST ``payload`` to a ``/generate`` URL; never raises (``success=False`` instead)."""
    return await post_payload(url, payload, native_on_body, RequestFuncOutput(), pbar, _headers(headers, api_key))


async def async_request_openai_chat_completions(payload: dict, url: str, pbar=None, headers: dict | None = None,
                                                api_key: str | None = None) -> RequestFuncOutput:
    """POST ``payload`` to a ``/v1/chat/completions`` URL (``output_ids`` stays empty)."""
    return await post_payload(url, payload, openai_on_body(chat_text), RequestFuncOutput(), pbar,
                              _headers(headers, api_key))


def gen_payload(input_ids, output_len: int, lora_path: str = "") -> dict:
    """A streaming greedy ``/generate`` body over token ids, with upstream's default fields."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "stream_options": {"include_usage": True},
        "lora_path": lora_path,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def gen_payload_openai(messages: list[dict], output_len: int, model: str) -> dict:
    """A streaming greedy chat body that asks for the usage chunk."""
    return {"model": model, "messages": messages, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
