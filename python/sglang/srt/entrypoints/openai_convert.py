"""OpenAI request -> GenerateReqInput: prompt, sampling params and the response options.

The model name is handled as upstream does: any name is served by the one model and echoed in
the response; ``base:adapter`` asks for a LoRA adapter, which this server does not have (400).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.entrypoints.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from sglang.srt.managers.generate_request import (
    BadRequestError,
    GenerateReqInput,
    check_bootstrap_fields,
    check_token_ids,
)
from sglang.srt.managers.request_schema import parse_request
from sglang.srt.sampling.sampling_params import TOP_LOGPROBS_MAX

DEFAULT_CHAT_MAX_TOKENS = 128  # upstream: up to the context length; here every page is reserved at admission


@dataclass
class OpenAIRequest:
    gen: GenerateReqInput
    model: str
    include_usage: bool
    continuous_usage: bool
    logprobs: bool


def _check_model(model: str) -> None:
    if ":" in model:
        adapter = model.split(":", 1)[1].strip()
        if adapter:
            raise BadRequestError(f"model={model!r} asks for the LoRA adapter {adapter!r}, but LoRA adapters are "
                                  "not supported by this server; use the base model name")


def _sampling_params(req, max_tokens: int) -> dict:
    if max_tokens < 0:
        raise BadRequestError(f"max_tokens must be >= 0, got {max_tokens}")
    params = {"max_new_tokens": max_tokens, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
              "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
              "sampling_seed": req.seed}
    for name in ("temperature", "top_p", "top_k", "min_p"):
        params[name] = getattr(req, name)
    return {k: v for k, v in params.items() if v is not None}


def _bootstrap(req) -> dict:
    """The PD bootstrap fields the router added (checked here: a ValueError raised while
    GenerateReqInput is built would reach the client as a pydantic error, not a 400)."""
    check_bootstrap_fields(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    return {"bootstrap_host": req.bootstrap_host, "bootstrap_port": req.bootstrap_port,
            "bootstrap_room": req.bootstrap_room}


def _finish(req, gen: GenerateReqInput, logprobs: bool) -> OpenAIRequest:
    _check_model(req.model)
    return OpenAIRequest(gen, req.model, req.include_usage, req.continuous_usage, logprobs)


def parse_completion(body: dict) -> OpenAIRequest:
    req = parse_request(CompletionRequest, body, "/v1/completions")
    prompt, text, ids = req.prompt, None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = prompt
    elif prompt and all(isinstance(t, str) for t in prompt):
        raise BadRequestError("a list of several prompts is not supported; send one prompt per request")
    else:
        ids = check_token_ids("prompt", prompt)
    if req.logprobs is not None and not 0 <= req.logprobs <= TOP_LOGPROBS_MAX:
        raise BadRequestError(f"logprobs must be in [0, {TOP_LOGPROBS_MAX}] (the limit), got {req.logprobs}")
    params = _sampling_params(req, req.max_tokens)
    gen = GenerateReqInput(text=text, input_ids=ids, sampling_params=params, stream=req.stream,
                           return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0,
                           rid=req.rid, priority=req.priority, **_bootstrap(req))
    return _finish(req, gen, req.logprobs is not None)


def _message_text(i: int, message: ChatMessage) -> dict:
    content = message.content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        for part in content:
            if part.type != "text" or part.text is None:
                raise BadRequestError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}; "
                                      f"got type {part.type!r} (text-only models)")
        content = "".join(part.text for part in content)
    if not isinstance(content, str):
        raise BadRequestError(f"messages[{i}].content must be a string or a list of text parts")
    return {"role": message.role, "content": content}


def parse_chat(body: dict, tokenizer) -> OpenAIRequest:
    req = parse_request(ChatCompletionRequest, body, "/v1/chat/completions")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise BadRequestError(f"response_format {fmt!r} is not supported; allowed: {{'type': 'text'}}")
    messages = [_message_text(i, m) for i, m in enumerate(req.messages)]
    if req.input_ids is not None:
        ids = check_token_ids("input_ids", req.input_ids)
    else:
        try:
            prompt = tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise BadRequestError(str(exc)) from None
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling_params(req, DEFAULT_CHAT_MAX_TOKENS if max_tokens is None else max_tokens)
    top = req.top_logprobs or 0
    gen = GenerateReqInput(input_ids=ids, sampling_params=params, stream=req.stream, return_logprob=req.logprobs,
                           top_logprobs_num=top if req.logprobs else 0, rid=req.rid, priority=req.priority,
                           **_bootstrap(req))
    return _finish(req, gen, req.logprobs)
