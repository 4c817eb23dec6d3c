"""Routes for attaching and detaching the HiCache L3 backend at runtime (upstream's shapes).

- ``POST /attach_hicache_storage_backend`` with ``{"hicache_storage_backend": "file",
  "hicache_storage_backend_extra_config_json": "{...}", "hicache_storage_prefetch_policy":
  "timeout", "hicache_write_policy": "write_through"}`` (all but the backend optional; the extra
  config may also be a JSON object). Also ``PUT /hicache/storage-backend``.
- ``POST /detach_hicache_storage_backend`` (idempotent). Also ``DELETE /hicache/storage-backend``.
- ``GET /hicache_storage_backend``: what is attached (``hicache_storage_backend`` is null when
  nothing is; secrets of the extra config redacted). Also ``GET /info_from_hicache_storage_backend``
  and ``GET /hicache/storage-backend``.
- ``POST /hicache/storage-backend/clear`` (upstream's): 501, not implemented here.

Every route needs ``--admin-api-key`` (``AuthLevel.ADMIN_FORCE``): 403 when the server has none,
401 for a missing or wrong key. Success answers 200 with upstream's text line. A change while
requests or storage operations are in flight, or an attach while a backend is attached, answers
409; the ``dynamic`` backend other than as started, or a directory outside the storage roots,
403; a bad field, an unknown backend, a bad extra config or a backend constructor that fails
400 naming why; the previous state stays (see ``managers/storage_admin.py``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from sglang.srt.entrypoints.http_common import error_response, read_json
from sglang.srt.managers.io_struct import ControlKind
from sglang.srt.managers.storage_admin import HTTP_STATUS, extra_config_field
from sglang.srt.utils.auth import AuthLevel, auth_level

ATTACH_TIMEOUT_S = 120.0  # a backend constructor may connect to a remote store
ERROR_TYPES = {403: "Forbidden", 409: "Conflict"}


class AttachHiCacheStorageReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hicache_storage_backend: str
    hicache_storage_backend_extra_config_json: str | dict | None = None
    hicache_storage_prefetch_policy: str | None = None
    hicache_write_policy: str | None = None


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{field}: {err['msg']}")
    allowed = ", ".join(AttachHiCacheStorageReqInput.model_fields)
    return f"bad attach request ({'; '.join(parts)}); fields: {allowed}"


def register_hicache_admin_routes(app: FastAPI, engine) -> None:
    tm = engine.tokenizer_manager

    def answer(out, done_text: str):
        if out.ok:
            return PlainTextResponse(done_text + (out.message + "\n" if out.message else ""))
        status = out.payload.get(HTTP_STATUS, 400)
        return error_response(status, out.message, ERROR_TYPES.get(status, "BadRequestError"))

    @auth_level(AuthLevel.ADMIN_FORCE)
    async def attach(request: Request):
        try:
            req = AttachHiCacheStorageReqInput.model_validate(await read_json(request))
        except ValidationError as exc:
            return error_response(400, _validation_message(exc))
        payload = req.model_dump()
        payload["hicache_storage_backend_extra_config_json"] = extra_config_field(
            req.hicache_storage_backend_extra_config_json)
        out = await tm.control(ControlKind.ATTACH_HICACHE_STORAGE, ATTACH_TIMEOUT_S, payload)
        return answer(out, "HiCache storage backend attached.\n")

    @auth_level(AuthLevel.ADMIN_FORCE)
    async def detach():
        out = await tm.control(ControlKind.DETACH_HICACHE_STORAGE, ATTACH_TIMEOUT_S)
        return answer(out, "HiCache storage backend detached.\n")

    @auth_level(AuthLevel.ADMIN_FORCE)
    async def status():
        out = await tm.control(ControlKind.GET_HICACHE_STORAGE)
        return out.payload

    @auth_level(AuthLevel.ADMIN_FORCE)
    async def clear():
        return error_response(501, "clearing the L3 backend at runtime is not implemented by this server; detach it "
                                   "and delete its storage directory", "NotImplemented")

    app.add_api_route("/attach_hicache_storage_backend", attach, methods=["POST"])
    app.add_api_route("/hicache/storage-backend", attach, methods=["PUT"])
    app.add_api_route("/detach_hicache_storage_backend", detach, methods=["POST"])
    app.add_api_route("/hicache/storage-backend", detach, methods=["DELETE"])
    for path in ("/hicache_storage_backend", "/info_from_hicache_storage_backend", "/hicache/storage-backend"):
        app.add_api_route(path, status, methods=["GET"])
    app.add_api_route("/hicache/storage-backend/clear", clear, methods=["POST"])
