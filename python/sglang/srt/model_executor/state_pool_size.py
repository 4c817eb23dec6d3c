"""How many slots the device state pool of a state model (Mamba / linear attention) gets.

Every running request owns one state slot from admission to finish (``managers/mamba_state.py``);
the prefix cache keeps further states as checkpoints where prefixes end (evicted LRU when the pool
is short). The pool holds both:

- ``--max-mamba-cache-size N`` (upstream's flag): N slots in all. Fewer than
  ``--max-running-requests`` caps how many requests run at once: a request waits at admission
  until a slot is free.
- unset: one slot per running request, plus a checkpoint share whose bytes are
  ``--mamba-full-memory-ratio`` (upstream's flag and default, 0.9) times the device KV pool's,
  at most one state per KV page (a tree node ends on a page and holds at most one state, so more
  could never be used), and none without a prefix cache. When the KV pool is sized from free
  memory, the budget is split so that both hold (``kv_tokens``).

Upstream's ratio covers its whole state pool; here it covers the checkpoint share only, so the
running requests' own slots never compete with cached prefixes for memory.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9  # upstream's fallback of --mamba-full-memory-ratio
RESERVED_SLOTS = 1  # MambaPool's allocator keeps slot 0 (ZERO_STATE reads it)


@dataclass(frozen=True)
class StatePoolSize:
    """Sizing inputs (server flags); ``kv_tokens`` / ``num_slots`` do the arithmetic."""

    max_running_requests: int
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO
    prefix_cache: bool = True  # False (--disable-radix-cache): no checkpoints are kept

    def __post_init__(self):
        checks = [
            ("max_running_requests", self.max_running_requests >= 1, "an integer >= 1"),
            ("max_mamba_cache_size", self.max_mamba_cache_size is None or self.max_mamba_cache_size >= 1,
             "unset or an integer >= 1"),
            ("mamba_full_memory_ratio", self.mamba_full_memory_ratio >= 0, "a number >= 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; must be {allowed}")

    @property
    def keeps_checkpoints(self) -> bool:
        return self.prefix_cache and self.max_mamba_cache_size is None

    def kv_tokens(self, budget_bytes: int, token_bytes: int, page_size: int, slot_bytes: int) -> int:
        """KV pool tokens a device memory budget (bytes) holds once the state pool has its part.
        ``token_bytes``: KV bytes per token over every KV pool; ``slot_bytes``: one state slot."""
        fixed = self.max_mamba_cache_size if self.max_mamba_cache_size is not None else self.max_running_requests
        rest = budget_bytes - (fixed + RESERVED_SLOTS) * slot_bytes
        per_token = float(token_bytes)
        if self.keeps_checkpoints:  # the checkpoint share grows with the KV pool, up to a state a page
            per_token += min(self.mamba_full_memory_ratio * token_bytes, slot_bytes / page_size)
        return max(int(rest / per_token), 0) if per_token > 0 else 0

    def checkpoint_slots(self, kv_tokens: int, token_bytes: int, page_size: int, slot_bytes: int) -> int:
        """Slots beyond the running requests' own for a KV pool of ``kv_tokens`` (0 with
        ``--max-mamba-cache-size`` or without a prefix cache)."""
        if not self.keeps_checkpoints:
            return 0
        share = int(self.mamba_full_memory_ratio * kv_tokens * token_bytes // max(slot_bytes, 1))
        return min(share, kv_tokens // page_size)

    def num_slots(self, kv_tokens: int, token_bytes: int, page_size: int, slot_bytes: int) -> int:
        """Usable slots of the state pool (its ``size``) beside a KV pool of ``kv_tokens``."""
        if self.max_mamba_cache_size is not None:
            return self.max_mamba_cache_size
        return self.max_running_requests + self.checkpoint_slots(kv_tokens, token_bytes, page_size, slot_bytes)
