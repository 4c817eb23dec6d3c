"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Responses follow the OpenAI shapes; ``usage.prompt_tokens_details`` carries ``cached_tokens``
and, beyond OpenAI, ``cached_tokens_details`` (tokens reused from device, host and storage).
Streams are server-sent events of chunk objects ending with ``data: [DONE]``; with
``stream_options.continuous_usage_stats`` every chunk carries the usage so far. The
response's ``model`` is the request's (as upstream), or the served name when none was given.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sglang.srt.entrypoints.http_common import SSE_DONE, RequestStream, read_json, refusal_message, sse
from sglang.srt.entrypoints.openai_convert import OpenAIRequest, parse_chat, parse_completion
from sglang.srt.managers.generate_request import BadRequestError
from sglang.srt.managers.tokenizer_manager import EngineDeadError

FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "abort"}


def usage(state) -> dict:
    cached = dict(state.cached_tokens)
    return {
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(state.output_ids),
        "total_tokens": state.prompt_tokens + len(state.output_ids),
        "prompt_tokens_details": {"cached_tokens": sum(cached.values()), "cached_tokens_details": cached},
    }


def _finish_reason(state) -> str | None:
    return FINISH_REASONS.get(state.finish["type"]) if state.finish else None


class _Route:
    """One OpenAI endpoint: how to parse its body and shape its responses."""

    def __init__(self, engine, chat: bool):
        self.engine, self.chat = engine, chat
        self.tm = engine.tokenizer_manager
        self.object = "chat.completion" if chat else "text_completion"
        self.prefix = "chatcmpl-" if chat else "cmpl-"

    def parse(self, body: dict) -> OpenAIRequest:
        return parse_chat(body, self.tm.tokenizer) if self.chat else parse_completion(body)

    def _token(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, state, start: int, end: int) -> dict:
        ids, lps = state.output_ids[start:end], state.logprobs[start:end]
        tops = state.top_logprobs[start:end] if state.req.top_logprobs_num else [[] for _ in ids]
        if self.chat:
            return {"content": [
                {"token": self._token(t), "logprob": lp,
                 "top_logprobs": [{"token": self._token(i), "logprob": v} for i, v in top]}
                for t, lp, top in zip(ids, lps, tops)]}
        return {"tokens": [self._token(t) for t in ids], "token_logprobs": lps,
                "top_logprobs": [{self._token(i): v for i, v in top} for top in tops]}

    def _choice(self, state, text: str, start: int, end: int, delta: bool, first: bool) -> dict:
        lp = self._logprobs(state, start, end) if state.req.return_logprob else None
        choice = {"index": 0, "logprobs": lp, "finish_reason": _finish_reason(state)}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice

    def _envelope(self, state, model: str, choice: dict, chunk: bool) -> dict:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.prefix + state.rid, "object": obj, "created": int(time.time()),
                "model": model or self.engine.args.model_name, "choices": [choice]}

    async def handle(self, request: Request):
        oreq = self.parse(await read_json(request))
        sent = self.tm.send(self.tm.tokenize(oreq.gen))  # the rid is taken before any response starts
        if oreq.gen.stream:
            return RequestStream(self._stream(sent, oreq, request), on_close=lambda: self.tm.release(sent))
        state = None
        try:
            async for state in self.tm.generate(sent, request):
                pass
        finally:
            self.tm.release(sent)
        if state is None or state.finish is None:
            return Response(status_code=499)
        message = refusal_message(state)
        if message is not None:
            raise BadRequestError(message)
        text = state.detok.text(state.output_ids, state.finish)
        body = self._envelope(state, oreq.model, self._choice(state, text, 0, len(state.output_ids), False, False),
                              False)
        body["usage"] = usage(state)
        return JSONResponse(body)

    async def _stream(self, req_state, oreq: OpenAIRequest, request: Request):
        sent, first, state = 0, True, None
        try:
            async for state in self.tm.generate(req_state, request):
                message = refusal_message(state)
                if message is not None:
                    yield sse({"error": {"message": message, "code": 400}})
                    break
                text = state.detok.delta(state.output_ids, state.finish)
                end = len(state.output_ids)
                choice = self._choice(state, text, sent, end, True, first)
                sent, first = end, False
                chunk = self._envelope(state, oreq.model, choice, True)
                if oreq.continuous_usage:
                    chunk["usage"] = usage(state)
                yield sse(chunk)
            if state is not None and state.finish is not None and oreq.include_usage:
                chunk = self._envelope(state, oreq.model, {}, True)
                chunk["choices"], chunk["usage"] = [], usage(state)
                yield sse(chunk)
        except EngineDeadError as exc:
            yield sse({"error": {"message": str(exc), "code": 503}})
        yield SSE_DONE


def register_openai_routes(app: FastAPI, engine) -> None:
    completions, chat = _Route(engine, chat=False), _Route(engine, chat=True)
    app.add_api_route("/v1/completions", completions.handle, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat.handle, methods=["POST"])

    @app.get("/v1/models")
    async def models():
        info = engine.info
        return {"object": "list", "data": [{
            "id": engine.args.model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": engine.args.model_path, "max_model_len": info["context_len"]}]}
