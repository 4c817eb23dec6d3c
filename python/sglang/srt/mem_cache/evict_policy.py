"""Eviction policies: the order in which unlocked leaves leave a tier.

A policy maps a node to a sort key; the tree evicts the smallest key first. Ties break on the
node id (older nodes first), so eviction order is a deterministic function of the tree, which
TP ranks rely on to evict the same nodes without talking. A node's key never decreases while it
stays in the tree (access time, counts and priority only grow): the host tier's lazy heap relies
on it (``hiradix/eviction.py``).

Upstream's choices and parameters (``--radix-eviction-policy``, ``--radix-eviction-policy-config``):

- ``lru``: least recently used first.
- ``lfu``: least often matched first, then LRU.
- ``slru``: segmented LRU: nodes matched fewer than ``protected_threshold`` (default 2) times
  (probationary) go before the others (protected); LRU within a segment.
- ``priority``: lower request priority first (a node holds the highest priority of the
  requests that inserted through it), then LRU.
- ``tlru``: upstream implements it only for its unified radix tree; refused here.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang.srt.choice_enum import ChoiceEnum
from sglang.srt.mem_cache.radix.tree_node import TreeNode


class EvictionPolicy(ChoiceEnum):
    LRU = "lru"
    LFU = "lfu"
    SLRU = "slru"
    PRIORITY = "priority"
    TLRU = "tlru"


# keys each policy takes in its config, with their defaults
POLICY_PARAMS: dict[EvictionPolicy, dict[str, int]] = {
    EvictionPolicy.LRU: {},
    EvictionPolicy.LFU: {},
    EvictionPolicy.SLRU: {"protected_threshold": 2},
    EvictionPolicy.PRIORITY: {},
    EvictionPolicy.TLRU: {"threshold": 0, "next_prompt_estimate": 0},
}

TLRU_REFUSED = ("eviction policy 'tlru' needs per-conversation tail bookkeeping that upstream keeps only in its "
                "unified radix tree (upstream refuses it for other trees too); this fork's trees support lru, lfu, "
                "slru and priority")


def _lru(node: TreeNode) -> tuple:
    return (node.last_access_time, node.id)


def _lfu(node: TreeNode) -> tuple:
    return (node.access_count, node.last_access_time, node.id)


def _slru(protected_threshold: int) -> Callable[[TreeNode], tuple]:
    def key(node: TreeNode) -> tuple:
        return (node.access_count >= protected_threshold, node.last_access_time, node.id)

    return key


def _by_priority(node: TreeNode) -> tuple:
    return (node.priority, node.last_access_time, node.id)


def check_policy_config(policy: EvictionPolicy, config: dict[str, Any] | None) -> dict[str, int]:
    """``config`` with the policy's defaults filled in; ValueError naming an unknown key or a
    bad value, and the policy."""
    allowed = POLICY_PARAMS[policy]
    config = dict(config or {})
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no parameters"
        raise ValueError(f"eviction policy {policy.value!r} does not take {', '.join(map(repr, unknown))}; "
                         f"it takes: {takes}")
    out = {**allowed, **config}
    for name, value in out.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"eviction policy {policy.value!r}: {name} must be an integer >= 0, got {value!r}")
    if policy is EvictionPolicy.SLRU and out["protected_threshold"] < 1:
        raise ValueError(f"eviction policy 'slru': protected_threshold must be >= 1, got {out['protected_threshold']}")
    return out


def eviction_priority(policy: EvictionPolicy, config: dict[str, Any] | None = None) -> Callable[[TreeNode], tuple]:
    """Sort key of ``policy`` (with ``config``, see ``POLICY_PARAMS``): the node with the
    smallest key is evicted first. ValueError for ``tlru`` (see ``TLRU_REFUSED``)."""
    params = check_policy_config(policy, config)
    if policy is EvictionPolicy.TLRU:
        raise ValueError(TLRU_REFUSED)
    if policy is EvictionPolicy.SLRU:
        return _slru(params["protected_threshold"])
    return {EvictionPolicy.LRU: _lru, EvictionPolicy.LFU: _lfu, EvictionPolicy.PRIORITY: _by_priority}[policy]
