"""Out-of-tree storage backends for the L3 controller tests, loaded through the ``dynamic`` name.

``ScriptedFileBackend`` is the real file backend (same object names, so it reads what ``file``
wrote) plus faults and delays chosen in the extra config:

- ``delay_exists_s`` / ``delay_get_s`` / ``delay_set_s``: seconds slept before each call;
- ``raise_on``: calls that raise (``exists``, ``get``, ``set``);
- ``malformed_on``: calls that return a malformed result (a wrong-length or non-list answer);
- ``fault_rank``: faults and delays apply only on this TP rank (all ranks when absent);
- ``hang_on``: calls that block (a hung backend) until ``release_hangs()``, or at most
  ``hang_max_s`` seconds (default 60); ``wait_hanging(timeout)`` waits until one blocks, and
  ``hanging_now()`` says how many are blocked at this moment;
- ``hang_after``: {call: n}: like ``hang_on`` for that call, from its (n+1)-th on.

It counts its calls (``calls_exists``, ``calls_get``, ``calls_set``) in ``get_stats()``.
Helpers build the ``dynamic`` extra config and a controller-level setup for the tests.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from sglang.srt.mem_cache.hicache_storage import HiCacheFile

_KEYS = ("delay_exists_s", "delay_get_s", "delay_set_s", "raise_on", "malformed_on", "fault_rank", "hang_on",
         "hang_max_s", "hang_after")


class InjectedStorageFault(RuntimeError):
    """What ScriptedFileBackend raises on purpose."""


class ScriptedFileBackend(HiCacheFile):
    def __init__(self, storage_config, file_path=None):
        extra = storage_config.extra_config
        self.script = {k: extra[k] for k in _KEYS if k in extra}
        rank = self.script.get("fault_rank")
        self.faulty = rank is None or rank == storage_config.tp_rank
        self.calls = {"exists": 0, "get": 0, "set": 0}
        self._calls_lock = threading.Lock()
        self._released = threading.Event()
        self._hanging = threading.Event()
        self._num_hanging = 0
        rest = {k: v for k, v in extra.items() if k not in _KEYS}
        super().__init__(dataclasses.replace(storage_config, extra_config=rest), file_path)

    def _enter(self, what: str) -> str | None:
        with self._calls_lock:
            self.calls[what] += 1
            nth = self.calls[what]
        if not self.faulty:
            return None
        delay = self.script.get(f"delay_{what}_s", 0)
        if delay:
            time.sleep(delay)
        if what in self.script.get("hang_on", ()) or nth > self.script.get("hang_after", {}).get(what, nth):
            with self._calls_lock:
                self._num_hanging += 1
            self._hanging.set()
            self._released.wait(self.script.get("hang_max_s", 60))
            with self._calls_lock:
                self._num_hanging -= 1
        if what in self.script.get("raise_on", ()):
            raise InjectedStorageFault(f"injected {what} fault")
        if what in self.script.get("malformed_on", ()):
            return "malformed"
        return None

    def batch_exists(self, keys, extra_info=None):
        if self._enter("exists"):
            return -1
        return super().batch_exists(keys, extra_info)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        if self._enter("get"):
            return [True]  # wrong length
        return super().batch_get_v1(keys, host_indices, extra_info)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        if self._enter("set"):
            return None
        return super().batch_set_v1(keys, host_indices, extra_info)

    def wait_hanging(self, timeout: float) -> bool:
        """True once a call is blocked by ``hang_on`` (within ``timeout`` seconds)."""
        return self._hanging.wait(timeout)

    def hanging_now(self) -> int:
        """How many calls are blocked by ``hang_on`` / ``hang_after`` right now."""
        with self._calls_lock:
            return self._num_hanging

    def release_hangs(self) -> None:
        """Let every blocked call (and every later one) go on."""
        self._released.set()

    # batch_exists_v2 goes through batch_exists above
    def batch_get_v2(self, transfers, extra_info=None):
        if self._enter("get"):
            return {}
        return super().batch_get_v2(transfers, extra_info)

    def batch_set_v2(self, transfers, extra_info=None):
        if self._enter("set"):
            return {}
        return super().batch_set_v2(transfers, extra_info)

    def get_stats(self):
        with self._calls_lock:
            calls = {f"calls_{k}": v for k, v in self.calls.items()}
        return {**super().get_stats(), **calls}


def scripted_extra(storage_dir: str, **script) -> dict:
    """Extra config of a ``dynamic`` ScriptedFileBackend over ``storage_dir``."""
    return {
        "backend_name": "scripted_file",
        "module_path": __name__,
        "class_name": "ScriptedFileBackend",
        "storage_dir": str(storage_dir),
        **script,
    }
