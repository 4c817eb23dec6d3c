"""The HTTP server: FastAPI routes over the Engine, served by uvicorn.

Native routes: ``/generate`` (text or input_ids, SSE streaming), ``/health``,
``/get_server_info``, ``/flush_cache``, ``/metrics`` (Prometheus text). OpenAI-compatible
routes live in ``openai_api.py``. Bad input answers 4xx with ``{"error": {"message": ...}}``
and the server keeps serving; a dead scheduler makes every route answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.entrypoints.http_common import SSE_DONE, error_response, meta_info, read_json, refusal_message, sse
from sglang.srt.entrypoints.openai_api import register_openai_routes
from sglang.srt.managers.generate_request import BadRequestError, GenerateReqInput
from sglang.srt.managers.io_struct import ControlKind
from sglang.srt.managers.tokenizer_manager import EngineDeadError
from sglang.srt.metrics.collector import render_metrics

logger = logging.getLogger(__name__)


def generate_response(state, obj: GenerateReqInput) -> dict:
    meta = meta_info(state)
    if obj.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(state.logprobs, state.output_ids)]
        if obj.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in state.top_logprobs]
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
        tm.metrics.num_bad_requests += 1
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), "ServiceUnavailable")

    @app.post("/generate")
    async def generate(request: Request):
        obj = GenerateReqInput.from_json(await read_json(request))
        req = tm.tokenize(obj)
        if obj.stream:
            return StreamingResponse(_stream_generate(req, obj, request), media_type="text/event-stream")
        state = await last_state(tm.generate(req, request))
        if state is None or state.finish is None:
            return Response(status_code=499)  # the client went away
        message = refusal_message(state)
        if message is not None:
            raise BadRequestError(message)
        return JSONResponse(generate_response(state, obj))

    async def _stream_generate(req, obj, request):
        try:
            async for state in tm.generate(req, request):
                message = refusal_message(state)
                yield sse({"error": {"message": message, "code": 400}} if message else generate_response(state, obj))
        except EngineDeadError as exc:
            yield sse({"error": {"message": str(exc), "code": 503}})
        yield SSE_DONE

    @app.get("/health")
    async def health():
        if tm.error is not None or not engine.alive:
            return error_response(503, tm.error or "a scheduler process is not running", "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        stats = await tm.control(ControlKind.GET_STATS)
        return {**engine.args.to_dict(), **engine.info, "model_name": engine.args.model_name,
                "version": _version(), "scheduler": stats.payload}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        out = await tm.control(ControlKind.FLUSH_CACHE)
        if not out.ok and out.payload.get("flush_incomplete"):
            return error_response(503, out.message, "ServiceUnavailable")
        if not out.ok:
            return error_response(400, out.message)
        return PlainTextResponse(out.message + "\n")

    @app.get("/metrics")
    async def metrics():
        stats = await tm.control(ControlKind.GET_STATS)
        return PlainTextResponse(render_metrics(stats.payload, tm.metrics, engine.args.model_name),
                                 media_type="text/plain; version=0.0.4")

    register_openai_routes(app, engine)
    return app


def _version() -> str:
    from sglang import __version__

    return __version__


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
