"""Eviction policies: the order in which unlocked leaves leave a tier.

A policy maps a node to a sort key; the tree evicts the smallest key first. Ties break on the
node id (older nodes first), so eviction order is a deterministic function of the tree, which
TP ranks rely on to evict the same nodes without talking.
"""

from __future__ import annotations

from typing import Callable

from sglang.srt.choice_enum import ChoiceEnum
from sglang.srt.mem_cache.radix.tree_node import TreeNode


class EvictionPolicy(ChoiceEnum):
    LRU = "lru"
    LFU = "lfu"



def _lru(node: TreeNode) -> tuple:
    return (node.last_access_time, node.id)


def _lfu(node: TreeNode) -> tuple:
    return (node.access_count, node.last_access_time, node.id)


_PRIORITY: dict[EvictionPolicy, Callable[[TreeNode], tuple]] = {
    EvictionPolicy.LRU: _lru,
    EvictionPolicy.LFU: _lfu,
}


def eviction_priority(policy: EvictionPolicy) -> Callable[[TreeNode], tuple]:
    """Sort key of ``policy``: the node with the smallest key is evicted first."""
    return _PRIORITY[policy]
