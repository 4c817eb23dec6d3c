"""Radix tree vocabulary: RadixKey and TreeNode (``MatchResult`` is upstream's, in
``base_prefix_cache``).

A node's key is a run of whole pages of token ids under one namespace (``extra_key``). Its
``value`` holds the device (L1) token slots of those tokens, ``host_value`` the host (L2) slots,
and ``hash_value`` one page hash per page, chained from the parent's last page hash (or the
namespace seed at the root), so a node's hashes never depend on how the tree happened to split.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

from sglang.srt.mem_cache.radix.page_hash import namespace_hash
from sglang.srt.mem_cache.radix.radix_key import RadixKey

__all__ = ["RadixKey", "TreeNode", "empty_indices", "new_stamp"]

_stamps = itertools.count(1)


# new_stamp() -> int: a fresh point of the tree clock, larger than every stamp handed out
# before. The counter's own bound method: a C call, no Python frame (it runs per deleted node).
new_stamp = _stamps.__next__


def _stamped(name: str) -> property:
    """A node attribute whose every write moves the node's ``stamp`` (a match through the node
    may now return something else)."""
    slot = "_" + name

    def set(self, value):
        setattr(self, slot, value)
        self.stamp = next(_stamps)

    # The getter is a C callable: reads (several per node on every tree walk, most of them in
    # HiCache's per-step paths) then run no Python frame; only writes move the stamp (issue 9).
    # A read through the property is still a descriptor call that the interpreter cannot
    # specialize (3.11), so the per-step loops of the trees read the slot itself (``_value``).
    return property(operator.attrgetter(slot), set)


def empty_indices() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree (and the node below it).

    ``lock_ref`` > 0 protects the node's device value (and, through ``inc_lock_ref``, its
    ancestors'); ``host_ref_counter`` > 0 protects its host value. ``hit_count`` counts inserts
    through the node (it drives ``write_through_selective``); ``access_count`` counts matches
    and inserts (it drives ``lfu``).

    ``stamp`` (a point of one process-wide clock, ``new_stamp``) moves whenever the node's
    key, any of its slot values, or its place in the tree changes: a match taken at clock ``t``
    through nodes whose stamps are all below ``t`` saw them as they are now
    (``match_reuse.py``).
    """

    # Slots, not an instance dict: attribute reads on nodes run in every tree walk, and a slot
    # read is the interpreter's fastest attribute path (issue 9). The stamped attributes'
    # storage is the slot of the same name with a leading underscore.
    __slots__ = ("id", "parent", "_key", "children", "_value", "_host_value", "hash_value", "lock_ref",
                 "host_ref_counter", "hit_count", "access_count", "last_access_time", "device_children",
                 "_mamba_value", "_mamba_host_value", "stamp", "priority")

    key = _stamped("key")
    value = _stamped("value")
    host_value = _stamped("host_value")
    mamba_value = _stamped("mamba_value")
    mamba_host_value = _stamped("mamba_host_value")

    # Next id handed out (upstream's counter: a test may reset it). Ids name nodes in acks and
    # break eviction ties; every construction advances it, also one given an explicit ``id``.
    counter = 0

    def __init__(self, id: int | None = None, priority: int = 0, *, parent: "TreeNode | None" = None,
                 key: RadixKey | None = None):
        self.id = TreeNode.counter if id is None else id
        TreeNode.counter += 1
        self.parent = parent
        self.key = key
        self.children: dict[Any, TreeNode] = {}
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.hash_value: list[str] | None = None  # one per page; the tree sets it with the key
        self.lock_ref = 0
        self.host_ref_counter = 0
        self.hit_count = 0
        self.access_count = 0
        self.last_access_time = 0
        # the highest request priority inserted through this node (--radix-eviction-policy priority)
        self.priority = priority
        # HiRadixCache: how many children have a device copy (a device node with none is a
        # device leaf, an eviction candidate), kept up to date wherever a device copy comes or
        # goes, so that test reads no children (most of a popular prefix's may be host-only).
        self.device_children = 0
        # Hybrid trees: one Mamba state (device slot / host slot) for the end of this node's key.
        self.mamba_value: torch.Tensor | None = None
        self.mamba_host_value: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={0 if self.key is None else len(self.key)}, device={self.value is not None}, "
            f"host={self.host_value is not None}, lock_ref={self.lock_ref})"
        )

    def __lt__(self, other: "TreeNode") -> bool:
        return self.id < other.id

    @property
    def evicted(self) -> bool:
        """No device copy."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """Has a host copy."""
        return self.host_value is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def protect_host(self) -> None:
        """Pin the host copy (an L3 backup or prefetch holds it)."""
        self.host_ref_counter += 1

    def release_host(self) -> None:
        """Undo one ``protect_host``; RuntimeError (upstream's) when the host copy is not pinned."""
        if self.host_ref_counter <= 0:
            raise RuntimeError(f"release_host on node {self.id}, whose host copy is not protected")
        self.host_ref_counter -= 1

    def prior_hash(self) -> str:
        """Hash the node's first page chains from: the parent's last page hash, else the seed."""
        parent = self.parent
        if parent is None or parent.is_root:
            return namespace_hash(self.key.extra_key)
        return parent.hash_value[-1]

    def get_last_hash_value(self) -> str | None:
        return self.hash_value[-1] if self.hash_value else None

    def unchanged_since(self, stamp: int) -> bool:
        return self.stamp < stamp
