"""BackendCalls: the storage threads' calls into a HiCacheStorage, with every answer checked.

Which API serves a stack:

- anchor only: v1 (``batch_exists``, ``batch_get_v1``, ``batch_set_v1``);
- sidecars (pools addressed with the anchor's slots, e.g. the DSA indexer): v2, one
  ``PoolTransfer`` per pool with the anchor's slots, hit policy ALL_PAGES;
- a trailing state pool (Mamba: one state per cached prefix, slots of its own): v2. Existence
  asks with TRAILING_PAGES, which gives the longest stored prefix whose last page has a state;
  a state moves in its own ``PoolTransfer`` keyed by the hash of the page it follows.

A backend exception or a malformed answer (wrong type, length or range) is logged, counted as a
``controller_failures`` and returned as a miss (None / False flags): a broken backend never
kills a storage thread or reaches the tree.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

logger = logging.getLogger(__name__)


class BackendCalls:
    """``side_pools``: sidecar pool names; ``state_pool``: the trailing state pool or None;
    ``count(**deltas)``: the controller's counters."""

    def __init__(self, backend, side_pools: list[PoolName], state_pool: PoolName | None,
                 count: Callable[..., None]):
        self.backend = backend
        self.side_pools = list(side_pools)
        self.state_pool = state_pool
        self.count = count

    def _call(self, what: str, fn, expect_len: int | None = None):
        """``fn()``; None (a counted failure) when it raises or returns a malformed result."""
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - a backend fault is a miss, never a crash
            level = logging.ERROR if isinstance(exc, (ValueError, TypeError)) else logging.WARNING
            logger.log(level, "storage %s raised %r; treated as a miss", what, exc, exc_info=True)
            self.count(controller_failures=1)
            return None
        if expect_len is not None and (not isinstance(out, (list, tuple)) or len(out) != expect_len):
            return self._malformed(what, out)
        return out

    def _malformed(self, what: str, out):
        logger.warning("storage %s returned %r; treated as a miss", what, out)
        self.count(controller_failures=1)
        return None

    @staticmethod
    def _count_ok(n, limit: int) -> bool:
        return not isinstance(n, bool) and isinstance(n, int) and 0 <= n <= limit

    # ---- existence ----------------------------------------------------------------------
    def exists(self, keys: list[str], with_state: bool = True) -> tuple[int, int] | None:
        """(leading pages of ``keys`` stored in the anchor and every sidecar, usable pages):
        usable is the longest prefix within the leading pages whose last page's state is stored
        (equal to leading without a state pool or with ``with_state=False``). None on a fault."""
        state = self.state_pool if with_state else None
        if not self.side_pools and state is None:
            n = self._call("batch_exists", lambda: self.backend.batch_exists(keys))
            if n is None:
                return None
            return (n, n) if self._count_ok(n, len(keys)) else self._malformed("batch_exists", n)
        asks = [PoolTransfer(name) for name in self.side_pools]
        if state is not None:
            asks.append(PoolTransfer(state, hit_policy=PoolHitPolicy.TRAILING_PAGES))
        res = self._call("batch_exists_v2", lambda: self.backend.batch_exists_v2(keys, asks))
        if res is None:
            return None
        try:
            counts = [res.kv_hit_pages] + [res.extra_pool_hit_pages[a.name] for a in asks]
        except (AttributeError, KeyError, TypeError):
            return self._malformed("batch_exists_v2", res)
        if not all(self._count_ok(n, len(keys)) for n in counts):
            return self._malformed("batch_exists_v2", res)
        leading = min(counts[: 1 + len(self.side_pools)])
        if state is None:
            return leading, leading
        usable = counts[-1]
        return leading, usable if usable <= leading else 0  # a state past a sidecar miss: unusable

    # ---- moving pages -------------------------------------------------------------------
    def pages(self, what: str, keys: list[str], host: torch.Tensor,
              states: list[tuple[int, torch.Tensor]] = ()) -> tuple[list[bool], list[bool]]:
        """Get or set (``what``) the pages ``keys`` at anchor slots ``host`` in the anchor and
        every sidecar, plus ``states`` ((page index, state slot): the state after that page) in
        the same call. Returns (per page: moved in every pool, per state: moved); all False
        on a fault."""
        if not self.side_pools and not states:
            fn = self.backend.batch_get_v1 if what == "get" else self.backend.batch_set_v1
            flags = self._call(f"batch_{what}_v1", lambda: fn(keys, host), len(keys))
            return ([bool(f) for f in flags] if flags is not None else [False] * len(keys)), []
        names = [PoolName.KV, *self.side_pools]
        transfers = [PoolTransfer(n, host_indices=host, keys=keys) for n in names]
        if states:
            transfers.append(self._state_transfer([keys[i] for i, _ in states], [s for _, s in states]))
        res = self._v2(what, transfers)
        if res is None:
            return [False] * len(keys), [False] * len(states)
        page_ok = [all(bool(res[n][i]) for n in names) for i in range(len(keys))]
        return page_ok, [bool(f) for f in res[self.state_pool]] if states else []

    def states(self, what: str, keys: list[str], slots: list[torch.Tensor]) -> list[bool]:
        """Get or set states alone: ``slots[i]`` (one state slot) is the state after the page
        named ``keys[i]``. One flag per state; all False on a fault."""
        res = self._v2(what, [self._state_transfer(keys, slots)])
        return [bool(f) for f in res[self.state_pool]] if res is not None else [False] * len(keys)

    def _state_transfer(self, keys: list[str], slots: list[torch.Tensor]) -> PoolTransfer:
        if self.state_pool is None:
            raise ValueError("no state pool is attached to this storage controller")
        return PoolTransfer(self.state_pool, host_indices=torch.cat([s.view(-1) for s in slots]), keys=keys)

    def _v2(self, what: str, transfers: list[PoolTransfer]) -> dict | None:
        fn = self.backend.batch_get_v2 if what == "get" else self.backend.batch_set_v2
        res = self._call(f"batch_{what}_v2", lambda: fn(transfers))
        if res is None:
            return None
        if not isinstance(res, dict) or any(
            not isinstance(res.get(t.name), (list, tuple)) or len(res[t.name]) != len(t.keys) for t in transfers
        ):
            return self._malformed(f"batch_{what}_v2", res)
        return res
