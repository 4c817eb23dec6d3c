"""One async request function per backend; each returns a ``RequestFuncOutput`` and never
raises (a failed request is ``success=False`` with the reason in ``error``).

Timing: ``ttft`` is the time from sending to the first generated token, ``itl`` the gaps
between later token arrivals (a chunk carrying k tokens adds one gap and k-1 zeros), ``latency``
the time to the last byte; all in seconds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from sglang.benchmark.utils import create_bench_client_session, get_auth_headers, sse_data


@dataclass
class RequestFuncInput:
    prompt: Any  # text, or token ids (native backend only)
    api_url: str
    prompt_len: int
    output_len: int
    model: str = ""
    lora_name: str | None = None
    image_data: Any = None
    extra_request_body: dict[str, Any] = field(default_factory=dict)
    stream: bool = True
    ignore_eos: bool = True


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    output_len: int = 0
    generated_len: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    start_time: float = 0.0

    @staticmethod
    def init_new(request_func_input: RequestFuncInput) -> "RequestFuncOutput":
        return RequestFuncOutput(prompt_len=request_func_input.prompt_len)


class _Clock:
    """Token arrival times of one request."""

    def __init__(self, out: RequestFuncOutput):
        self.out = out
        self.start = out.start_time = time.perf_counter()
        self.last = self.start
        self.tokens = 0
        self.reported: int | None = None  # the server's own token count, when it sends one

    def tokens_seen(self, total: int) -> None:
        """``total`` tokens have arrived so far (a count that only grows)."""
        if total <= self.tokens:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.out.itl.extend([0.0] * (total - self.tokens - 1))  # tokens that came in the same chunk
        self.last, self.tokens = now, total

    def done(self) -> None:
        self.out.latency = time.perf_counter() - self.start
        self.out.output_len = self.out.generated_len = self.tokens if self.reported is None else self.reported
        self.out.success = True


async def _events(response):
    """Decoded JSON payloads of an SSE response, until ``[DONE]``."""
    async for line in response.content:
        data = sse_data(line)
        if data is None or not data:
            continue
        if data == "[DONE]":
            return
        yield json.loads(data)


def _error_of(body) -> str | None:
    if isinstance(body, dict) and "error" in body:
        err = body["error"]
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    return None


async def post_payload(api_url: str, payload: dict, on_body, out: RequestFuncOutput, pbar=None,
                       headers: dict | None = None) -> RequestFuncOutput:
    """POST ``payload``; ``on_body(body, clock)`` consumes each streamed event (or the one JSON
    body) and fills ``out``. Any failure becomes ``out.success = False`` with the reason."""
    try:
        async with create_bench_client_session() as session:
            clock = _Clock(out)
            async with session.post(api_url, json=payload, headers={**get_auth_headers(), **(headers or {})}) as resp:
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                elif payload.get("stream"):
                    async for body in _events(resp):
                        if _error_of(body):
                            out.error = _error_of(body)
                            break
                        on_body(body, clock)
                else:
                    on_body(await resp.json(), clock)
                    out.itl = []  # one body: no inter-token gaps to measure (ttft is the latency)
            if not out.error:
                clock.done()
    except Exception as exc:  # noqa: BLE001 - reported per request, the run goes on
        out.success, out.error = False, f"{type(exc).__name__}: {exc}"
    if pbar is not None:
        pbar.update(1)
    return out


def native_on_body(body: dict, clock: _Clock) -> None:
    """One /generate body: cumulative ``text`` and ``output_ids``, counts in ``meta_info``."""
    meta = body.get("meta_info") or {}
    out = clock.out
    out.generated_text = body.get("text", out.generated_text)
    out.output_ids = list(body.get("output_ids", out.output_ids))
    out.cached_tokens = meta.get("cached_tokens", out.cached_tokens)
    out.prompt_len = meta.get("prompt_tokens", out.prompt_len)
    clock.tokens_seen(meta.get("completion_tokens", len(out.output_ids)))


async def async_request_sglang_generate(request_func_input: RequestFuncInput, pbar=None) -> RequestFuncOutput:
    """Native ``/generate``: text or ``input_ids``; the stream carries the cumulative text."""
    prompt = request_func_input.prompt
    payload = {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": request_func_input.output_len,
                            "ignore_eos": request_func_input.ignore_eos},
        "stream": request_func_input.stream,
        **request_func_input.extra_request_body,
    }
    return await post_payload(request_func_input.api_url, payload, native_on_body,
                              RequestFuncOutput.init_new(request_func_input), pbar)


def _openai_payload(request_func_input: RequestFuncInput, body: dict) -> dict:
    payload = {"model": request_func_input.model, "temperature": 0.0, "max_tokens": request_func_input.output_len,
               "stream": request_func_input.stream, "ignore_eos": request_func_input.ignore_eos, **body}
    if request_func_input.stream:
        payload["stream_options"] = {"include_usage": True}
    return {**payload, **request_func_input.extra_request_body}


def completion_text(choice: dict) -> str | None:
    return choice.get("text")


def chat_text(choice: dict) -> str | None:
    return (choice.get("delta") or choice.get("message") or {}).get("content")


def openai_on_body(text_of):
    """Consumes OpenAI (chunk) objects: text via ``text_of(choice)``, counts from ``usage``."""

    def on_body(body, clock):
        out = clock.out
        pieces = [text_of(c) or "" for c in body.get("choices") or []]
        out.generated_text += "".join(pieces)
        usage = body.get("usage")
        if usage:
            out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", out.cached_tokens)
            clock.reported = usage.get("completion_tokens", clock.reported)
        if any(pieces):
            clock.tokens_seen(clock.tokens + 1)  # timing counts chunks; the exact count comes in usage

    return on_body


async def async_request_openai_completions(request_func_input: RequestFuncInput, pbar=None) -> RequestFuncOutput:
    payload = _openai_payload(request_func_input, {"prompt": request_func_input.prompt})
    return await post_payload(request_func_input.api_url, payload, openai_on_body(completion_text),
                              RequestFuncOutput.init_new(request_func_input), pbar)


async def async_request_openai_chat_completions(request_func_input: RequestFuncInput,
                                                pbar=None) -> RequestFuncOutput:
    messages = [{"role": "user", "content": request_func_input.prompt}]
    payload = _openai_payload(request_func_input, {"messages": messages})
    return await post_payload(request_func_input.api_url, payload, openai_on_body(chat_text),
                              RequestFuncOutput.init_new(request_func_input), pbar)


# backend name -> request function
ASYNC_REQUEST_FUNCS = {
    "sglang": async_request_sglang_generate,
    "sglang-native": async_request_sglang_generate,
    "sglang-oai": async_request_openai_completions,
    "sglang-oai-chat": async_request_openai_chat_completions,
    "vllm": async_request_openai_completions,
    "vllm-chat": async_request_openai_chat_completions,
}
BACKEND_ROUTES = {
    async_request_sglang_generate: "/generate",
    async_request_openai_completions: "/v1/completions",
    async_request_openai_chat_completions: "/v1/chat/completions",
}
