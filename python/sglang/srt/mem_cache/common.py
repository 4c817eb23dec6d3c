"""Helpers over any prefix cache (upstream's ``mem_cache.common``).

Upstream keeps the request-level cache plumbing here (match, checkpoint, release, SWA windows);
ours lives with the trees (``radix/requests.py``) and the scheduler (``managers/token_slots.py``),
so this module holds what both share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache


def available_and_evictable_str(tree_cache: BasePrefixCache) -> str:
    """One log line: the device slots free now plus what evicting the tree could free."""
    return tree_cache.available_and_evictable_str()
