"""The HTTP server: FastAPI routes over the Engine, served by uvicorn.

Native routes: ``/generate`` (text or input_ids, SSE streaming), ``/health``, ``/flush_cache``
(POST, admin key); ``/get_server_info``, ``/get_model_info`` and ``/metrics`` live in
``info_routes.py``, the OpenAI-compatible routes in ``openai_api.py``, the L3 admin routes in
``hicache_admin.py``. Every route is checked by ``utils/auth.py`` (``--api-key``,
``--admin-api-key``) before it runs. Bad input answers 4xx with ``{"error": {"message": ...}}``
and the server keeps serving; a dead scheduler makes every route answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.entrypoints.http_common import (
    SSE_DONE,
    RequestStream,
    error_response,
    meta_info,
    read_json,
    refusal_message,
    sse,
)
from sglang.srt.entrypoints.hicache_admin import register_hicache_admin_routes
from sglang.srt.entrypoints.info_routes import register_info_routes
from sglang.srt.entrypoints.openai_api import register_openai_routes
from sglang.srt.managers.generate_request import BadRequestError, GenerateReqInput
from sglang.srt.managers.io_struct import ControlKind
from sglang.srt.managers.tokenizer_manager import EngineDeadError
from sglang.srt.utils.auth import AuthLevel, add_api_key_middleware, auth_level

logger = logging.getLogger(__name__)


def generate_response(state, obj: GenerateReqInput, tokenizer) -> dict:
    """Upstream's shape; logprob entries are [logprob, token id, token text or None]."""
    meta = meta_info(state)

    def text(token_id: int) -> str | None:
        return tokenizer.decode([token_id], skip_special_tokens=False) if obj.return_text_in_logprobs else None

    if obj.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(state.logprobs, state.output_ids)]
        if obj.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, text(t)] for t, lp in top] for top in state.top_logprobs]
    return {"text": state.detok.text(state.output_ids, state.finish), "output_ids": list(state.output_ids),
            "meta_info": meta}


async def last_state(states):
    state = None
    async for state in states:
        pass
    return state


def create_app(engine: Engine) -> FastAPI:
    tm = engine.tokenizer_manager

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start(asyncio.get_running_loop())
        yield

    app = FastAPI(lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(BadRequestError)
    async def bad_request(request: Request, exc: BadRequestError):
        tm.metrics.on_bad_request()
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), "ServiceUnavailable")

    @app.post("/generate")
    async def generate(request: Request):
        obj = GenerateReqInput.from_json(await read_json(request))
        sent = tm.send(tm.tokenize(obj))  # the rid is taken before any response starts
        if obj.stream:
            return RequestStream(_stream_generate(sent, obj, request), on_close=lambda: tm.release(sent))
        try:
            state = await last_state(tm.generate(sent, request))
        finally:
            tm.release(sent)
        if state is None or state.finish is None:
            return Response(status_code=499)  # the client went away
        message = refusal_message(state)
        if message is not None:
            raise BadRequestError(message)
        return JSONResponse(generate_response(state, obj, tm.tokenizer))

    async def _stream_generate(sent, obj, request):
        try:
            async for state in tm.generate(sent, request):
                message = refusal_message(state)
                yield sse({"error": {"message": message, "code": 400}} if message
                          else generate_response(state, obj, tm.tokenizer))
        except EngineDeadError as exc:
            yield sse({"error": {"message": str(exc), "code": 503}})
        yield SSE_DONE

    @app.get("/health")
    async def health():
        if tm.error is not None or not engine.alive:
            return error_response(503, tm.error or "a scheduler process is not running", "ServiceUnavailable")
        return Response(status_code=200)

    @app.post("/flush_cache")  # upstream also answers GET; a mutation is POST only here
    @auth_level(AuthLevel.ADMIN_FORCE)
    async def flush_cache():
        out = await tm.control(ControlKind.FLUSH_CACHE)
        if not out.ok and out.payload.get("flush_incomplete"):
            return error_response(503, out.message, "ServiceUnavailable")
        if not out.ok:
            return error_response(400, out.message)
        return PlainTextResponse(out.message + "\n")

    register_info_routes(app, engine)
    register_openai_routes(app, engine)
    register_hicache_admin_routes(app, engine)
    add_api_key_middleware(app, api_key=engine.args.api_key, admin_api_key=engine.args.admin_api_key)
    return app


def launch_server(server_args) -> None:
    """Start the engine and serve HTTP until interrupted; the engine stops on the way out."""
    import uvicorn

    server_args.check_model()
    engine = Engine(server_args)
    try:
        app = create_app(engine)
        logger.info("serving %s on %s", server_args.model_name, server_args.url())
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                    timeout_keep_alive=5, timeout_graceful_shutdown=5, access_log=False)
    finally:
        engine.shutdown()
