"""Capacity of a NIXL file store: a byte budget kept by evicting whole page groups.

Every object of one page hash, of every pool (KV, its sidecars, the anchor's marker), starts
with the page's group (``PoolCodec``, grouped names), so the books here are kept per group:
group -> {object name: stored bytes}, least recently used first (a write or a verified read is
a use). Before a chunk of pages is written (on the backup thread, never on a request's path)
the store is checked against ``high_watermark`` percent of the budget; past it, the least
recently used groups (not those being written) are removed, every object of each together,
until the store with the incoming bytes is at ``low_watermark`` percent. Because the room is
made before the write, the store never exceeds the budget.

Only the first rank (tp, pp and attn-cp rank 0) evicts: every rank of a deployment shares the
directories, and two evictors would race. It learns the other ranks' files by rescanning the
directories every ``RESCAN_S`` on a background thread when the deployment has several ranks.
A reader that loses a group to eviction sees a miss.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict

from sglang.srt.mem_cache.storage.posix_files import unlink_quiet
from sglang.srt.mem_cache.storage.keys import GROUP_SEPARATOR

logger = logging.getLogger(__name__)

RESCAN_S = 30.0
STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died


def group_of(name: str) -> str:
    return name.partition(GROUP_SEPARATOR)[0]


class StoreCapacity:
    def __init__(self, side, options, evicts: bool, shared: bool, stats):
        """``side``: a NixlFileManager; ``evicts``: this rank keeps the budget; ``shared``: other ranks
        write to the same directories (rescan them); ``stats``: StorageStats to count evictions."""
        self.side, self.stats = side, stats
        self.evicts = options.eviction and evicts and not side.read_only
        self.used_bytes = 0
        self._groups: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.evicts:
            self._adopt(self._scan())
        # 0: half of what the store could grow into (free space plus what it already holds, so a
        # restart does not shrink the budget by the pages stored before it)
        budget = options.capacity_bytes or (shutil.disk_usage(side.root).free + self.used_bytes) // 2
        self.budget_bytes = max(int(budget), 1)
        self.high_bytes = int(self.budget_bytes * options.high_watermark / 100)
        self.low_bytes = int(self.budget_bytes * options.low_watermark / 100)
        if self.evicts:
            if shared:
                self._thread = threading.Thread(target=self._rescan_loop, name="hicache-nixl-capacity", daemon=True)
                self._thread.start()
        logger.info("HiCacheNixl capacity: %.2f GiB budget, watermarks %.0f%% / %.0f%%, %s (%.2f GiB in %d groups)",
                    self.budget_bytes / (1 << 30), options.high_watermark, options.low_watermark,
                    "evicting on this rank" if self.evicts else "no eviction on this rank",
                    self.used_bytes / (1 << 30), len(self._groups))

    # ---- books --------------------------------------------------------------------------
    def _scan(self) -> list[tuple[float, str, int]]:
        """(mtime, name, bytes) of every stored object, oldest first; stale temporaries removed."""
        found, now = [], time.time()
        for bucket in self.side.buckets():
            for entry in os.scandir(bucket.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if ".tmp." in entry.name:
                    if now - st.st_mtime > STALE_TMP_S:
                        unlink_quiet(entry.path)
                    continue
                found.append((st.st_mtime, entry.name, st.st_size))
        return sorted(found)

    def _adopt(self, found: list[tuple[float, str, int]]) -> None:
        """Book objects found on disk that the books do not know (as the newest, in mtime order)."""
        with self._lock:
            for _, name, size in found:
                group = self._groups.setdefault(group_of(name), {})
                if name not in group:
                    group[name] = size
                    self.used_bytes += size

    def written(self, names_bytes: list[tuple[str, int]]) -> None:
        """Book objects just committed (replacing the sizes of earlier writes); most recent."""
        if not self.evicts:
            return
        with self._lock:
            groups = self._groups
            for name, size in names_bytes:
                key = group_of(name)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = {}
                else:
                    groups.move_to_end(key)
                self.used_bytes += size - group.get(name, 0)
                group[name] = size

    def touched(self, names: list[str]) -> None:
        if not self.evicts:
            return
        with self._lock:
            for name in names:
                if group_of(name) in self._groups:
                    self._groups.move_to_end(group_of(name))

    def forget(self, name: str) -> None:
        with self._lock:
            group = self._groups.get(group_of(name))
            if group is not None and name in group:
                self.used_bytes -= group.pop(name)
                if not group:
                    del self._groups[group_of(name)]

    # ---- eviction -----------------------------------------------------------------------
    def make_room(self, writing: set[str], incoming_bytes: int) -> None:
        """Before writing ``incoming_bytes`` into the groups ``writing``: past the high
        watermark, evict least recently used groups until the store plus the incoming bytes is
        at the low watermark (groups being written are kept)."""
        if not self.evicts:
            return
        victims = []
        with self._lock:
            if self.used_bytes + incoming_bytes <= self.high_bytes:
                return
            target, kept = max(0, self.low_bytes - incoming_bytes), []
            while self._groups and self.used_bytes > target:
                group, objects = self._groups.popitem(last=False)
                if group in writing:
                    kept.append((group, objects))
                    continue
                self.used_bytes -= sum(objects.values())
                victims.append(objects)
            for group, objects in kept:
                self._groups[group] = objects
        for objects in victims:
            for name in objects:
                unlink_quiet(self.side.get_file_path(name))
        self.stats.add(groups_evicted=len(victims), bytes_evicted=sum(sum(o.values()) for o in victims))
        logger.debug("HiCacheNixl capacity: evicted %d page groups", len(victims))

    def _rescan_loop(self) -> None:
        while not self._stop.wait(RESCAN_S):
            try:
                self._adopt(self._scan())
                self.make_room(set(), 0)
            except Exception:  # noqa: BLE001 - the next round tries again; writes keep their room check
                logger.warning("HiCacheNixl capacity: rescanning the storage directories failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
