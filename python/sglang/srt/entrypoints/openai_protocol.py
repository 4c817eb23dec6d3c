"""OpenAI request bodies -> GenerateReqInput, with the same strictness as /generate.

Accepted fields are listed per endpoint; an unknown field, a wrong type or a feature this
engine lacks (n > 1, echo, penalties, tools, logit_bias) is a BadRequestError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.managers.generate_request import BadRequestError, GenerateReqInput, check_token_ids, check_type

NUMBER = (int, float)
COMMON = {
    "model": (str,), "max_tokens": (int, type(None)), "temperature": NUMBER, "top_p": NUMBER, "top_k": (int,),
    "min_p": NUMBER, "n": (int,), "stream": (bool,), "stream_options": (dict, type(None)),
    "stop": (str, list, type(None)), "seed": (int, type(None)), "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER, "user": (str, type(None)), "ignore_eos": (bool,), "skip_special_tokens": (bool,),
    "logit_bias": (dict, type(None)),
}
COMPLETION = {**COMMON, "prompt": (str, list), "logprobs": (int, type(None)), "echo": (bool,),
              "suffix": (str, type(None)), "best_of": (int, type(None))}
CHAT = {**COMMON, "messages": (list,), "logprobs": (bool, type(None)), "top_logprobs": (int, type(None)),
        "max_completion_tokens": (int, type(None)), "tools": (list, type(None)), "tool_choice": (str, dict, type(None)),
        "response_format": (dict, type(None))}
# field -> the only value(s) this engine supports
UNSUPPORTED = {"n": (1,), "echo": (False,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
               "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None,), "tools": (None,)}


@dataclass
class OpenAIRequest:
    gen: GenerateReqInput
    model: str
    include_usage: bool
    logprobs: bool


def _check_fields(body: dict, allowed: dict) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequestError(f"unknown fields {unknown}; allowed: {sorted(allowed)}")
    for name, value in body.items():
        types = allowed[name]
        check_type(name, value, types, " or ".join("null" if t is type(None) else t.__name__ for t in types))
    for name, ok in UNSUPPORTED.items():
        if name in body and body[name] not in ok:
            raise BadRequestError(f"{name}={body[name]!r} is not supported by this server; allowed: {list(ok)}")


DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 128}  # OpenAI's 16 for completions; chat is open-ended there


def _sampling_params(body: dict, max_tokens, default: int) -> dict:
    params = {"max_new_tokens": default if max_tokens is None else max_tokens}
    if params["max_new_tokens"] < 0:
        raise BadRequestError(f"max_tokens must be >= 0, got {params['max_new_tokens']}")
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("seed", "sampling_seed"), ("ignore_eos", "ignore_eos"),
                     ("skip_special_tokens", "skip_special_tokens")):
        if body.get(src) is not None:
            params[dst] = body[src]
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else stop
    return params


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options") or {}
    return bool(opts.get("include_usage", False))


def parse_completion(body: dict) -> OpenAIRequest:
    _check_fields(body, COMPLETION)
    if "prompt" not in body:
        raise BadRequestError("prompt is required")
    prompt, text, ids = body["prompt"], None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = prompt
    elif prompt and all(isinstance(t, str) for t in prompt):
        raise BadRequestError("a list of several prompts is not supported; send one prompt per request")
    else:
        ids = check_token_ids("prompt", prompt)
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs < 0:
        raise BadRequestError(f"logprobs must be >= 0, got {logprobs}")
    params = _sampling_params(body, body.get("max_tokens"), DEFAULT_MAX_TOKENS["completion"])
    gen = GenerateReqInput(text=text, input_ids=ids, sampling_params=params, stream=body.get("stream", False),
                           return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0)
    gen.validate()
    return OpenAIRequest(gen, body.get("model", ""), _include_usage(body), logprobs is not None)


def _message_text(i: int, message) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequestError(f"messages[{i}] must be an object with a string 'role'")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise BadRequestError(f"messages[{i}].content must be a string or a list of text parts")
    return {"role": message["role"], "content": content}


def parse_chat(body: dict, tokenizer) -> OpenAIRequest:
    _check_fields(body, CHAT)
    messages = body.get("messages")
    if not messages:
        raise BadRequestError("messages is required and must not be empty")
    fmt = body.get("response_format")
    if fmt is not None and fmt.get("type") != "text":
        raise BadRequestError(f"response_format {fmt!r} is not supported; allowed: {{'type': 'text'}}")
    try:
        prompt = tokenizer.apply_chat_template([_message_text(i, m) for i, m in enumerate(messages)])
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    top = body.get("top_logprobs") or 0
    if top < 0:
        raise BadRequestError(f"top_logprobs must be >= 0, got {top}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    logprobs = bool(body.get("logprobs"))
    params = _sampling_params(body, max_tokens, DEFAULT_MAX_TOKENS["chat"])
    gen = GenerateReqInput(input_ids=ids, sampling_params=params, stream=body.get("stream", False),
                           return_logprob=logprobs, top_logprobs_num=top if logprobs else 0)
    gen.validate()
    return OpenAIRequest(gen, body.get("model", ""), _include_usage(body), logprobs)
