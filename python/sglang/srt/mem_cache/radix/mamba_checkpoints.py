"""Request checkpoints entering a state tree (MambaRadixCache, HiMambaRadixCache).

A prefill forward leaves states at positions inside it (``managers/mamba_state.py``), pending on
``req.mamba_checkpoints`` as ``(position, device state slot)``. Once the request's whole pages are in
the tree, each becomes the state of the node ending at its position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, request_priority
from sglang.srt.mem_cache.radix.radix_key import RadixKey


def insert_request_checkpoints(tree, req, key: RadixKey, is_insert: bool,
                               free_slot: Callable[[torch.Tensor], None]) -> None:
    """Give ``tree`` the pending checkpoints of ``req`` inside ``key`` (the request's whole pages,
    already in the tree): the insert adopts each state at the node ending at its position, or frees
    it when that node has one. Freed with ``free_slot`` when not inserting or when the tree lacks
    the KV. Mutates ``req.mamba_checkpoints`` (emptied)."""
    pending, req.mamba_checkpoints = getattr(req, "mamba_checkpoints", ()), []
    for pos, slot in pending:
        values = _device_path(tree, key[:pos]) if is_insert and not tree.disable and pos <= len(key) else None
        if values is None:
            free_slot(slot)
            continue
        tree.insert(InsertParams(key=key[:pos], value=values, chunked=True, mamba_value=slot,
                                 priority=request_priority(req)))


def _device_path(tree, key: RadixKey) -> torch.Tensor | None:
    """The tree's device slots for all of ``key`` (nodes split at its end), or None."""
    node, at, values = tree.root_node, 0, []
    while at < len(key):
        node = tree._step(node, key, at)
        if node is None or node.value is None:
            return None
        values.append(node.value)
        at += len(node.key)
    return torch.cat(values) if values else None
