"""Runtime attach / detach of the HiCache L3 backend: the scheduler side of
``/attach_hicache_storage_backend``, ``/detach_hicache_storage_backend`` and
``/hicache_storage_backend`` (``entrypoints/hicache_admin.py``).

Every TP rank gets the same control message (rank 0 broadcasts it) and runs ``handle`` in the
same place of its loop, so all ranks attach or detach together. Two decisions are agreed over
the tree's TP group (MIN), with one collective each whatever happens locally:

1. idle: no request waiting, running or chunked, no host transfer or storage operation in
   flight and no quarantined backup, on every rank; otherwise the change is refused (HTTP 409);
2. attach: the backend was built on every rank; a rank that built it closes it again when
   another one failed, so a failed attach leaves every rank as it was.

The status (backend name, extra config with its secrets redacted, prefetch and write policy)
is upstream's shape; ``hicache_storage_backend`` is None while nothing is attached.

What a request may attach (``check_attach_allowed``, before anything is imported or created):
the ``dynamic`` backend only with the ``module_path`` / ``class_name`` the server was started
with, and directories (``DIRECTORY_KEYS``) only inside the storage roots: the startup extra
config's directories and ``--hicache-storage-roots``. Refusal messages and log lines never quote
a secret of the extra config (``utils/redact.py``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from sglang.srt.managers.io_struct import ControlKind, ControlOutput, ControlReq
from sglang.srt.mem_cache.controller.hicache_config import PrefetchPolicy, WritePolicy
from sglang.srt.mem_cache.controller.storage_settings import parse_extra_config_arg
from sglang.srt.model_executor.checkpoint_fingerprint import storage_model_name
from sglang.srt.utils.redact import redact_config_json, redact_text

logger = logging.getLogger(__name__)

ADMIN_KINDS = (ControlKind.ATTACH_HICACHE_STORAGE, ControlKind.DETACH_HICACHE_STORAGE,
               ControlKind.GET_HICACHE_STORAGE)
HTTP_STATUS = "http_status"  # payload key of a refusal: the status the route answers
# extra config keys that name L3 directories (file: storage_dir / upstream's file_storage_path;
# nixl: storage_dir, comma-separated, or the list storage_dirs)
DIRECTORY_KEYS = ("storage_dir", "file_storage_path", "storage_dirs")
DYNAMIC_KEYS = ("module_path", "class_name")


class AdminRefusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class AttachRequest:
    """The fields of an attach request (upstream's names), validated the same on every rank."""

    backend: str
    extra_config_json: str | None
    prefetch_policy: PrefetchPolicy | None
    write_policy: WritePolicy | None

    @classmethod
    def from_payload(cls, payload: dict, args) -> "AttachRequest":
        """Validated fields; AdminRefusal(403) for what ``args`` (the server's flags) do not allow."""
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        name = payload.get("hicache_storage_backend")
        known = StorageBackendFactory.known_backends()
        if name not in known:
            raise AdminRefusal(400, f"hicache_storage_backend {name!r} is not allowed; choose one of: "
                                    f"{', '.join(known)}")
        extra = payload.get("hicache_storage_backend_extra_config_json")
        extra_dict = parse_extra_config_arg(extra, "hicache_storage_backend_extra_config_json")  # names the field
        check_attach_allowed(args, name, extra_dict)
        prefetch = payload.get("hicache_storage_prefetch_policy")
        write = payload.get("hicache_write_policy")
        return cls(name, extra, PrefetchPolicy.parse(prefetch) if prefetch is not None else None,
                   WritePolicy.parse(write) if write is not None else None)


def named_dirs(extra: dict) -> list[tuple[str, str]]:
    """``(key, directory)`` for every directory an extra config names (``DIRECTORY_KEYS``)."""
    found = []
    for key in DIRECTORY_KEYS:
        value = extra.get(key)
        entries = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else []
        found += [(key, d.strip()) for d in entries if isinstance(d, str) and d.strip()]
    return found


def storage_roots(args) -> tuple[str, ...]:
    """Where a runtime attach may put L3 pages: ``--hicache-storage-roots`` and the directories of
    the startup extra config, symlinks resolved."""
    roots = list(args.storage_roots)
    if args.hicache_storage_backend is not None:
        roots += [d for _, d in named_dirs(args.storage_extra_config)]
    return tuple(dict.fromkeys(os.path.realpath(r) for r in roots))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_attach_allowed(args, backend: str, extra: dict) -> None:
    """AdminRefusal(403) unless ``args`` allow attaching ``backend`` with ``extra``: ``dynamic``
    only as configured at startup (a request never names a module to import), every named
    directory inside ``storage_roots`` (checked with symlinks resolved; nothing is created)."""
    if backend == "dynamic":
        if args.hicache_storage_backend != "dynamic":
            raise AdminRefusal(403, "backend 'dynamic' can be attached only on a server started with "
                                    "--hicache-storage-backend dynamic (a request never names a module to import)")
        startup = args.storage_extra_config
        for key in DYNAMIC_KEYS:
            if extra.get(key) != startup.get(key):
                raise AdminRefusal(403, f"backend 'dynamic': extra config key {key!r} must be the one the server "
                                        f"was started with ({startup.get(key)!r}); a request never names a module "
                                        "to import")
    roots = storage_roots(args)
    for key, directory in named_dirs(extra):
        if not any(_inside(os.path.realpath(directory), root) for root in roots):
            allowed = ", ".join(roots) if roots else "none configured"
            raise AdminRefusal(403, f"extra config key {key!r}: {directory} is outside the storage roots "
                                    f"({allowed}); add a root with --hicache-storage-roots")


class StorageAdmin:
    """Attach / detach state of one scheduler's tree (one per scheduler, see ``admin_of``)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        args = scheduler.args
        self.backend_name = args.hicache_storage_backend
        self.extra_config_json = args.hicache_storage_backend_extra_config

    @property
    def tree(self):
        return self.scheduler.tree_cache

    @property
    def controller(self):
        return self.tree.cache_controller

    def status(self) -> dict:
        hicache = self.scheduler.hicache
        attached = hicache and self.controller.storage is not None
        return {
            "hicache_storage_backend": self.backend_name if attached else None,
            "hicache_storage_backend_extra_config": redact_config_json(self.extra_config_json) if attached else None,
            "hicache_storage_prefetch_policy": self.tree.prefetch_stop_policy.value if hicache else None,
            "hicache_write_policy": self.controller.write_policy.value if hicache else None,
        }

    # ---- checks -------------------------------------------------------------------------
    def _local_busy(self) -> str | None:
        sched = self.scheduler
        if sched.has_work():
            n = len(sched.waiting) + len(sched.running) + (sched.chunked_req is not None)
            return f"{n} requests in the engine"
        if sched.transfers_in_flight():
            return "host transfers or storage operations in flight"
        storage = self.controller.storage
        if storage is not None and storage.quarantine:
            return "backups abandoned by a flush are still running"
        return None

    def _require_idle(self) -> None:
        """AdminRefusal(409) unless every rank is idle (one collective)."""
        busy = self._local_busy()
        if not self.tree.agreement.all_true(busy is None):
            raise AdminRefusal(409, f"the scheduler is not idle ({busy or 'on another TP rank'}); retry when no "
                                    "request and no storage operation is in flight")

    # ---- operations -------------------------------------------------------------------------
    def attach(self, payload: dict) -> str:
        req = AttachRequest.from_payload(payload, self.scheduler.args)
        if self.controller.storage is not None:
            raise AdminRefusal(409, f"storage backend {self.backend_name!r} is already attached; detach it first")
        if req.write_policy is not None and req.write_policy is not self.controller.write_policy:
            raise AdminRefusal(400, f"hicache_write_policy {req.write_policy.value!r} differs from the running "
                                    f"{self.controller.write_policy.value!r}; it cannot change at runtime "
                                    "(restart with --hicache-write-policy)")
        self._require_idle()
        error = None
        try:
            self.controller.attach_storage_backend(req.backend, model_name=storage_model_name(self.scheduler.args),
                                                   storage_backend_extra_config=req.extra_config_json)
            self._check_tree_takes(self.controller.storage)
        except Exception as exc:  # noqa: BLE001 - a bad config or a failing constructor: refused
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
            error = redact_text(error, req.extra_config_json, self.scheduler.args.storage_extra_config)
            logger.warning("attaching storage backend %r failed: %s", req.backend, error)
            self.controller.detach_storage_backend()  # a half-accepted attach (tree check) is undone
        if not self.tree.agreement.all_true(error is None):
            if error is None:
                self.controller.detach_storage_backend()
            raise AdminRefusal(400, f"storage backend {req.backend!r} not attached: "
                                    f"{error or 'it failed on another TP rank (see that rank log)'}")
        self.tree.storage = self.controller.storage
        if req.prefetch_policy is not None:
            self.tree.prefetch_stop_policy = req.prefetch_policy
        self.scheduler.storage_enabled = True
        self.scheduler._idle_checked = False
        self.backend_name, self.extra_config_json = req.backend, req.extra_config_json
        logger.info("storage backend %r attached at runtime", req.backend)
        return f"storage backend {req.backend!r} attached"

    def _check_tree_takes(self, storage) -> None:
        state_pool = storage.state_pool
        if state_pool is not None and state_pool is not self.tree.STORAGE_STATE_POOL:
            raise ValueError(f"{type(self.tree).__name__} cannot take {state_pool.value!r} states from L3")

    def detach(self) -> str:
        if self.controller.storage is None:
            return "no storage backend attached"
        self._require_idle()
        name = self.backend_name
        self.controller.detach_storage_backend()
        self.tree.storage = None
        self.scheduler.storage_enabled = False
        self.scheduler._idle_checked = False
        self.backend_name = self.extra_config_json = None
        logger.info("storage backend %r detached at runtime", name)
        return f"storage backend {name!r} detached"


def admin_of(scheduler) -> StorageAdmin:
    admin = getattr(scheduler, "storage_admin", None)
    if admin is None:
        admin = scheduler.storage_admin = StorageAdmin(scheduler)
    return admin


def handle_storage_admin(scheduler, msg: ControlReq) -> ControlOutput:
    """Apply one attach / detach / status message; the reply carries the status afterwards and,
    on a refusal, the HTTP status to answer (``payload[HTTP_STATUS]``)."""
    admin = admin_of(scheduler)
    if msg.kind is ControlKind.GET_HICACHE_STORAGE:
        return ControlOutput(msg.cid, True, payload=admin.status())
    try:
        if not scheduler.hicache:
            raise AdminRefusal(400, "runtime storage attach/detach needs --enable-hierarchical-cache")
        message = admin.attach(msg.payload) if msg.kind is ControlKind.ATTACH_HICACHE_STORAGE else admin.detach()
    except (AdminRefusal, ValueError) as exc:  # ValueError: a field of the request
        status = exc.status if isinstance(exc, AdminRefusal) else 400
        message = redact_text(str(exc), msg.payload.get("hicache_storage_backend_extra_config_json"),
                              scheduler.args.storage_extra_config)
        return ControlOutput(msg.cid, False, message, payload={**admin.status(), HTTP_STATUS: status})
    return ControlOutput(msg.cid, True, message, payload=admin.status())


def extra_config_field(value) -> str | None:
    """``hicache_storage_backend_extra_config_json`` as sent: a JSON string (upstream) or an object."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)
