"""Slot accounting checks behind ``check_integrity()``.

Every usable slot of every pool must be exactly one of: free (in its allocator), owned by a
tree node, or held by someone outside the tree (a running request, an in-flight storage
operation). Reserved slots (the device padding page) must be none of them.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.allocator import PagedAllocator
from sglang.srt.mem_cache.radix.page_hash import page_hashes


class CacheIntegrityError(RuntimeError):
    """The tree and the allocators disagree; the message gives the numbers."""


def paged_allocator(obj) -> PagedAllocator:
    """The PagedAllocator behind an allocator-like object (an allocator, a pool with one)."""
    if isinstance(obj, PagedAllocator):
        return obj
    inner = getattr(obj, "allocator", None)
    if isinstance(inner, PagedAllocator):
        return inner
    raise TypeError(f"{type(obj).__name__} exposes no PagedAllocator")


def _sample(mask: torch.Tensor, offset: int) -> list[int]:
    return (mask.nonzero().flatten()[:5] + offset).tolist()


def check_slot_partition(what: str, allocator, owners: dict[str, list[torch.Tensor]]) -> None:
    """Raise CacheIntegrityError unless free slots and ``owners``' slots partition the usable
    slots of ``allocator`` (each usable slot counted exactly once, reserved slots never)."""
    alloc = paged_allocator(allocator)
    end, first = alloc.end_slot, alloc.reserved_pages * alloc.page_size
    counts = torch.zeros(end, dtype=torch.int32)
    counts += alloc.free_slot_mask().to(torch.int32)
    for owner, tensors in owners.items():
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            t = t.to(torch.int64).cpu()
            lo, hi = int(t.min()), int(t.max())
            if lo < first or hi >= end:
                raise CacheIntegrityError(f"{what}: {owner} holds slots outside [{first}, {end}): min {lo}, max {hi}")
            counts.index_add_(0, t, torch.ones_like(t, dtype=torch.int32))
    usable = counts[first:]
    lost, dup = usable == 0, usable > 1
    if bool(lost.any()) or bool(dup.any()):
        raise CacheIntegrityError(
            f"{what}: {int(lost.sum())} of {usable.numel()} slots are neither free nor owned "
            f"(e.g. {_sample(lost, first)}), {int(dup.sum())} are counted more than once "
            f"(e.g. {_sample(dup, first)}); free={alloc.available_size()}, "
            + ", ".join(f"{k}={sum(int(t.numel()) for t in v if t is not None)}" for k, v in owners.items())
        )


def check_tree_nodes(tree, check_hashes: bool = True) -> None:
    """Per-node invariants of a radix tree (any RadixCache subclass):

    whole-page non-empty keys filed under their first page; value / host_value one slot per
    token; page hashes equal to a fresh chain from the parent (when ``check_hashes``); a node's
    lock_ref and host_ref_counter at least its children's sum; the tree's size counters equal
    to what its nodes add up to; plus the subclass's ``_check_node``.
    """
    P, evictable, protected = tree.page_size, 0, 0
    for node in tree._all_nodes():
        n = len(node.key)
        if n == 0 or n % P or node.parent.children.get(tree._child_key(node.key)) is not node:
            raise CacheIntegrityError(f"node {node.id}: key of {n} tokens, or misfiled under its parent")
        for name in ("value", "host_value"):
            v = getattr(node, name)
            if v is not None and v.numel() != n:
                raise CacheIntegrityError(f"node {node.id}: {name} has {v.numel()} slots for {n} tokens")
        if check_hashes and node.hash_value != page_hashes(node.key.ids, P, node.prior_hash()):
            raise CacheIntegrityError(f"node {node.id}: page hashes do not match its key and parent chain")
        for counter in ("lock_ref", "host_ref_counter"):
            if getattr(node, counter) < sum(getattr(c, counter) for c in node.children.values()):
                raise CacheIntegrityError(f"node {node.id}: {counter} {getattr(node, counter)} below its children's sum")
        tree._check_node(node)
        if node.value is not None:
            if node.lock_ref:
                protected += n
            else:
                evictable += n
    if (evictable, protected) != (tree.evictable_size_, tree.protected_size_):
        raise CacheIntegrityError(
            f"evictable/protected sizes are {tree.evictable_size_}/{tree.protected_size_}, "
            f"the nodes add up to {evictable}/{protected}"
        )
