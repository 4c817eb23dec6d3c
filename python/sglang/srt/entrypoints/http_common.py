"""Helpers shared by the HTTP routes: JSON bodies, error responses, server-sent events."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang.srt.managers.generate_request import BadRequestError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20


async def read_json(request: Request) -> dict:
    """The request body as a JSON object; BadRequestError when it is not one."""
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise BadRequestError(f"request body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def error_response(status: int, message: str, err_type: str = "BadRequestError") -> JSONResponse:
    """OpenAI-style error body: {"error": {"message", "type", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": err_type, "code": status}}, status_code=status)


def sse(data) -> bytes:
    """One server-sent event carrying ``data`` (JSON unless it is a str)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")


def meta_info(state) -> dict:
    """Token counts of a request (``ReqState``): prompt, completion, cached (total and by tier)."""
    cached = dict(state.cached_tokens)
    return {
        "id": state.rid,
        "finish_reason": state.finish,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(state.output_ids),
        "cached_tokens": sum(cached.values()),
        "cached_tokens_details": cached,
    }


def refusal_message(state) -> str | None:
    """The scheduler's reason when it refused the request outright (no token produced)."""
    finish = state.finish or {}
    if finish.get("type") == "abort" and finish.get("message") and not state.output_ids:
        return finish["message"]
    return None
