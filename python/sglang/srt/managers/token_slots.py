"""TokenSlotAllocator: device token slots for a request's next tokens, evicting when short.

A request's own slots are whole pages: the next token goes to the free remainder of its last
page, then to fresh pages from the token allocator. When the allocator is short, unlocked
prefixes are evicted from the tree; when even that is not enough (prefixes still locked by
host writes in flight), the writes are waited for and acknowledged, then eviction is retried.
Every rank holds the same tree and allocator state, so every rank takes the same branch and
makes the same number of tree collectives.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError

logger = logging.getLogger(__name__)


class TokenSlotAllocator:
    def __init__(self, tree_cache, token_to_kv_pool_allocator, page_size: int):
        self.tree_cache = tree_cache
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size

    def _tail_room(self, req: Req) -> int:
        """Free slots left in the request's last own page."""
        if req.kv_len == req.prefix_indices.numel():
            return 0  # no own page yet (a prefix always ends on a page boundary)
        used = (int(req.kv_indices[-1]) + 1) % self.page_size
        return 0 if used == 0 else self.page_size - used

    def _room_and_pages(self, req: Req, num_tokens: int) -> tuple[int, int]:
        """Of the next ``num_tokens``: how many fit the last own page, and the fresh pages the
        rest needs."""
        room = min(self._tail_room(req), num_tokens)
        return room, -(-(num_tokens - room) // self.page_size)

    def take(self, req: Req, num_tokens: int) -> torch.Tensor:
        """Slots for the request's next ``num_tokens`` tokens (int64). Appends them to
        ``req.kv_indices`` and counts new pages in ``req.pages_allocated``."""
        room, pages = self._room_and_pages(req, num_tokens)
        parts = []
        if room:
            last = int(req.kv_indices[-1])
            parts.append(torch.arange(last + 1, last + 1 + room, dtype=torch.int64))
        if pages:
            fresh = self.alloc_pages(pages)
            req.pages_allocated += pages
            parts.append(fresh[: num_tokens - room])
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        req.kv_indices = torch.cat([req.kv_indices, slots])
        return slots

    def take_batch(self, entries: list[tuple[Req, int]]) -> torch.Tensor:
        """``take`` for every (request, tokens) of a batch, in order, concatenated. The pages
        they need are made free first in one go (one eviction pass for the batch, as upstream
        allocates a batch's slots in one call): a pass per request walked the tree and freed
        device slots once per request (issue 9)."""
        need = 0
        for req, n in entries:
            need += self._room_and_pages(req, n)[1]
        if need:
            self.make_room(need)
        return torch.cat([self.take(r, n) for r, n in entries])

    def make_room(self, num_pages: int) -> None:
        """Make ``num_pages`` pages free if eviction can (a later ``alloc_pages`` then finds
        them); nothing when they already are."""
        need = num_pages * self.page_size
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(EvictParams(num_tokens=short))
            short = need - self.allocator.available_size()
        if short > 0 and self.flush_host_writes():
            self.tree_cache.evict(EvictParams(num_tokens=short))

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        """``num_pages`` whole pages of device slots. Raises CacheIntegrityError when the
        scheduler's reservation said they were there and they are not."""
        need = num_pages * self.page_size
        self.make_room(num_pages)
        slots = self.allocator.alloc(need)
        if slots is None:
            raise CacheIntegrityError(
                f"device pool short of {need - self.allocator.available_size()} slots after eviction "
                f"(free {self.allocator.available_size()}, evictable {self.tree_cache.evictable_size()})"
            )
        return slots

    def flush_host_writes(self) -> bool:
        """Wait for in-flight device->host writes and acknowledge them (unlocking their nodes).
        False when the tree has no host tier."""
        controller = getattr(self.tree_cache, "cache_controller", None)
        if controller is None:
            return False
        logger.debug("device pool short: waiting for host writes in flight")
        controller.synchronize_writes()
        self.tree_cache.check_hicache_events()
        return True
