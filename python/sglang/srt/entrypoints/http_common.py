"""Helpers shared by the HTTP routes: bounded JSON bodies, error responses, server-sent events."""

from __future__ import annotations

import json
import logging
import sys
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from sglang.srt.managers.generate_request import BadRequestError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # every request body, counted while it is read
MAX_JSON_DEPTH = 32  # nested objects / arrays; upstream's bodies need fewer than 10


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused (BadRequestError naming the limit) as soon as ``Content-Length`` or the
    bytes read so far exceed ``limit``: an oversized body is never held whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and (len(declared) > 20 or int(declared) > limit):
        raise BadRequestError(f"request body of {declared[:24]} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequestError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth_exceeds(data, limit: int) -> bool:
    """Whether ``data`` nests objects / arrays more than ``limit`` deep (iterative: no recursion)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_json_body(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """``body`` as a JSON object; BadRequestError naming the problem (malformed, too deep, an
    integer over Python's digit limit, not an object)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise BadRequestError(f"the JSON body nests deeper than the limit of {max_depth} levels") from None
    except ValueError:  # int("1" * 5000): CPython's limit on integer digits
        raise BadRequestError(f"an integer in the JSON body has more than the limit of "
                              f"{sys.get_int_max_str_digits()} digits") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    # a body with fewer brackets than the limit cannot nest deeper (the common case: no walk)
    if body.count(b"[") + body.count(b"{") > max_depth and json_depth_exceeds(data, max_depth):
        raise BadRequestError(f"the JSON body nests deeper than the limit of {max_depth} levels")
    return data


async def read_json(request: Request) -> dict:
    """The request body as a JSON object, within ``MAX_BODY_BYTES`` and ``MAX_JSON_DEPTH``;
    BadRequestError (HTTP 400) naming the limit or the problem."""
    return parse_json_body(await read_body(request))


def error_response(status: int, message: str, err_type: str = "BadRequestError") -> JSONResponse:
    """OpenAI-style error body: {"error": {"message", "type", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": err_type, "code": status}}, status_code=status)


def sse(data) -> bytes:
    """One server-sent event carrying ``data`` (JSON unless it is a str)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")


class RequestStream(StreamingResponse):
    """Server-sent events of one registered request. ``on_close`` runs however the response
    ends, also when the client left before the first event (then the body iterator never
    starts, so its own cleanup would never run)."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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
