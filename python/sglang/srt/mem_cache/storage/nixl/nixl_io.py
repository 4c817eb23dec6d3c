"""A NIXL agent with one storage plugin: registration, batched transfers and existence queries.

This is the adapter boundary: every NIXL error (an exception, an "ERR" state, a timeout) leaves
as :class:`StorageBackendError`. NIXL is imported here, when a backend is built, not before.
Every call that can wait on a remote endpoint (registration, query, transfer) finishes, or fails
with :class:`StorageUnavailable`, within ``transfer_timeout_s`` (``bounded_calls.py``).
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np

from sglang.srt.mem_cache.hicache_storage import StorageBackendError
from sglang.srt.mem_cache.storage.nixl.bounded_calls import BoundedCalls, StorageUnavailable
from sglang.srt.mem_cache.storage.nixl.nixl_config import NixlOptions, StorageKind
from sglang.srt.utils.redact import redact_config, redact_text

logger = logging.getLogger(__name__)

# Waiting for a transfer: poll back to back first (the POSIX plugin moves buffered data inside
# the poll calls, which release the GIL, so a yield between them only hands the CPU away: on a
# busy host each yield cost ~0.8 ms), then polls that yield the CPU, then short sleeps. A chunk of
# buffered pages takes 1-8 ms here; spinning only its first 0.2 ms left 64 KiB reads yielding half
# their time (2 ms: 0.32x -> 0.41x of plain preadv, bench_storage.py).
_SPIN_S = 2e-3
_YIELD_POLLS = 256
_POLL_SLEEP_S = 5e-5


class NixlIO:
    def __init__(self, options: NixlOptions, preferred_params: tuple[dict, ...] = ()):
        """``preferred_params``: plugin parameters to try, in order, before the configured ones
        (a default the host may not support, such as io_uring)."""
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise ValueError(f"storage backend 'nixl' needs the nixl package (pip install nixl-cu12): {exc}") from exc
        spec = options.spec
        conf = nixl_agent_config(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self.agent = nixl_agent(f"sglang-hicache-{uuid.uuid4().hex[:12]}", conf)
        if spec.nixl_name not in self.agent.get_plugin_list():
            raise ValueError(f"NIXL plugin {spec.nixl_name} is not available; available: {self.agent.get_plugin_list()}")
        self._check_params(spec.nixl_name, options.plugin_params)
        self._create_backend(spec.nixl_name, [*preferred_params, dict(options.plugin_params)])
        self.backend = spec.nixl_name
        self.mem_type = spec.kind.value
        self.timeout_s = options.transfer_timeout_s
        self.calls = BoundedCalls(self.timeout_s, remote=spec.kind is StorageKind.OBJ)
        self._dram_regs = []
        logger.info("NIXL agent %s with plugin %s", self.agent.name, spec.nixl_name)

    def _create_backend(self, plugin: str, candidates: list[dict]) -> None:
        for i, params in enumerate(candidates):
            try:
                self.agent.create_backend(plugin, params)
                logger.info("NIXL plugin %s created with %s", plugin, redact_config(params))
                return
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own binding error types
                if i == len(candidates) - 1:
                    raise ValueError(f"NIXL plugin {plugin} refused extra config 'plugin_params' "
                                     f"{redact_config(params)}: {redact_text(str(exc), params)}") from exc
                logger.info("NIXL plugin %s refused %s (%s); trying the next setting", plugin, redact_config(params),
                            redact_text(str(exc), params))

    def _check_params(self, plugin: str, params: dict) -> None:
        allowed = self.agent.get_plugin_params(plugin)
        unknown = sorted(set(params) - set(allowed))
        if allowed and unknown:
            raise ValueError(f"nixl backend: unknown extra config key 'plugin_params.{unknown[0]}' for {plugin}; "
                             f"allowed: {', '.join(sorted(allowed))}")

    def register_dram(self, tensors: list) -> None:
        """Register host memory (uint8 CPU tensors) for the agent's lifetime."""
        tensors = [t for t in tensors if t.numel()]
        if tensors:
            self._dram_regs.append(self._call("register host memory", self.agent.register_memory, tensors))

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def transfer(self, op: str, dram: list[tuple[int, int]], storage: list[tuple[int, int, int]],
                 storage_regs: list[tuple[int, int, int, str]]) -> None:
        """One ``op`` ("READ" or "WRITE") moving ``dram[i]`` = (ptr, len) <-> ``storage[i]`` =
        (offset, len, dev_id) (lists of tuples, or uint64 arrays with dram rows (ptr, len, 0)); ``storage_regs`` = (0, 0, dev_id, meta) are registered for the
        duration. Returns when done; StorageBackendError on failure, StorageUnavailable when it
        did not finish within ``transfer_timeout_s`` (all or nothing). A transfer that timed out
        keeps its handle and registration until NIXL reports it ended (see BoundedCalls)."""
        if len(dram) == 0:
            return
        deadline = self._deadline()
        local = dram if isinstance(dram, np.ndarray) else np.array([(p, n, 0) for p, n in dram], dtype=np.uint64)
        remote = storage if isinstance(storage, np.ndarray) else np.array(storage, dtype=np.uint64)
        reg = self._call("register storage", self._register_storage, storage_regs, deadline=deadline)
        handle, settled = None, True
        try:
            local_descs = self.agent.get_xfer_descs(local, "DRAM")
            remote_descs = self.agent.get_xfer_descs(remote, self.mem_type)
            handle = self._call(f"{op} setup", self.agent.initialize_xfer, op, local_descs, remote_descs,
                                self.agent.name, deadline=deadline)
            self._wait(op, handle, self._call(f"{op} post", self.agent.transfer, handle, deadline=deadline), deadline)
        except StorageUnavailable:
            if handle is not None and not self._settled(handle, reg):
                settled = False
                self.calls.overdue(op, lambda: self._settled(handle, reg))
            raise
        finally:
            if settled:
                if handle is not None:
                    _quiet(handle.release)
                _quiet(self.agent.deregister_memory, reg)

    def _register_storage(self, regs) -> object:
        """Register the storage side of one transfer: descriptors first, then the registration
        (the two calls upstream makes, so an agent wrapped by a test sees the same calls)."""
        return self.agent.register_memory(self.agent.get_reg_descs(regs, self.mem_type))

    def _settled(self, handle, reg) -> bool:
        """Whether a timed-out transfer has ended; releases it (and its registration) once so."""
        if self.agent is None or self.agent.check_xfer_state(handle) == "PROC":
            return self.agent is None
        _quiet(handle.release)
        _quiet(self.agent.deregister_memory, reg)
        return True

    def _wait(self, op: str, handle, state: str, deadline: float | None = None) -> None:
        start = time.monotonic()
        spin_until, deadline = start + _SPIN_S, start + self.timeout_s if deadline is None else deadline
        polls = 0
        while state == "PROC":
            now = time.monotonic()
            if now > deadline:
                raise StorageUnavailable(f"NIXL {self.backend} {op} timed out after {self.timeout_s}s")
            if now > spin_until:
                polls += 1
                time.sleep(0 if polls < _YIELD_POLLS else _POLL_SLEEP_S)
            state = self._local_call(f"{op} poll", self.agent.check_xfer_state, handle)
        if state != "DONE":
            raise StorageBackendError(f"NIXL {self.backend} {op} ended in state {state}")

    def query(self, regs: list[tuple[int, int, int, str]]) -> list[dict | None]:
        """Per (0, 0, dev_id, meta): the plugin's info dict when present, else None."""
        if not regs:
            return []
        return list(self._call("query", self.agent.query_memory, regs, self.backend, self.mem_type))

    def _call(self, what: str, fn, *args, deadline: float | None = None):
        """``fn(*args)`` bounded by ``deadline`` (default: transfer_timeout_s from now)."""
        deadline = self._deadline() if deadline is None else deadline
        return self._local_call(what, self.calls.run, what, deadline, fn, *args)

    def _local_call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except StorageBackendError:
            raise
        except Exception as exc:  # noqa: BLE001 - binding errors carry NIXL status codes
            raise StorageBackendError(f"NIXL {self.backend} {what} failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self.calls.unavailable:  # a call still inside NIXL may touch these; leave them to the process
            logger.warning("NIXL agent %s closed with a transfer still outstanding", self.agent.name)
            self._dram_regs.clear()
            self.agent = None
            return
        for reg in self._dram_regs:
            _quiet(self.agent.deregister_memory, reg)
        self._dram_regs.clear()
        self.agent = None


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - cleanup after a failure must not mask it
        logger.debug("NIXL cleanup call %s failed", getattr(fn, "__name__", fn), exc_info=True)
