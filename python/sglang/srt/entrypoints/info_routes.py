"""What a server reports about itself: ``/get_server_info``, ``/get_model_info`` and ``/metrics``.

sglang-router (0.3.x) registers a worker by probing ``/server_info`` and ``/model_info`` first and
falling back, with a deprecation warning, to the ``/get_*`` routes; both spellings are served so
the router registers workers without warnings. It takes the model id from
``served_model_name`` and loads its tokenizer from ``model_path`` / ``tokenizer_path``.
The flags in ``/get_server_info`` never hold a secret (``public_args``).
"""

from __future__ import annotations

import json
import os

from fastapi import FastAPI
from fastapi.responses import Response

from sglang.srt.managers.io_struct import ControlKind
from sglang.srt.metrics.collector import CONTENT_TYPE_LATEST, render_metrics
from sglang.srt.utils.redact import REDACTED, redact_config_json

SECRET_FLAGS = ("api_key", "admin_api_key")


def _version() -> str:
    from sglang import __version__

    return __version__


def _hf_config(model_path: str) -> dict:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_info(args) -> dict:
    """Upstream's ``/get_model_info`` shape."""
    config = _hf_config(args.model_path)
    return {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "served_model_name": args.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


def public_args(args) -> dict:
    """The server's flags as reported: the API keys replaced by ``REDACTED`` when set, the
    storage extra config with its secrets redacted (``utils/redact.py``)."""
    flags = args.to_dict()
    for name in SECRET_FLAGS:
        if flags.get(name):
            flags[name] = REDACTED
    flags["hicache_storage_backend_extra_config"] = redact_config_json(flags["hicache_storage_backend_extra_config"])
    return flags


def register_info_routes(app: FastAPI, engine) -> None:
    tm, args = engine.tokenizer_manager, engine.args
    info = model_info(args)

    async def server_info():
        stats = await tm.control(ControlKind.GET_STATS)
        return {**public_args(args), **engine.info, "model_name": args.model_name,
                "served_model_name": args.model_name, "tokenizer_path": info["tokenizer_path"],
                "version": _version(), "scheduler": stats.payload}

    async def get_model_info():
        return info

    async def metrics():
        stats = await tm.control(ControlKind.GET_STATS)
        return Response(render_metrics(stats.payload, tm.metrics), media_type=CONTENT_TYPE_LATEST)

    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
