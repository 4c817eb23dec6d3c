"""Request bookkeeping of the radix trees: what happens to a request's slots when it pauses
(chunked prefill) or ends.

A request is read through these attributes: ``fill_ids`` (tokens whose KV is computed),
``kv_indices`` (int64 device slots of ``fill_ids``, allocated in whole pages, so the last page
may be partly used), ``extra_key``, ``prefix_indices`` (the tree's slots it started from) and
``last_node`` (the node it locked). A scheduler fills ``kv_indices`` from its req-to-token table.

A mixin of RadixCache: it uses the tree's ``insert``, ``_step``, locks and allocator.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, request_priority
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.radix.tree_node import RadixKey, empty_indices
from sglang.srt.mem_cache.utils import as_cpu_index, check_page_aligned


class RequestCacheMixin:
    # ---- requests --------------------------------------------------------------------------
    def _free_request_slots(self, slots: torch.Tensor) -> None:
        """Free whole pages covering ``slots``: whole pages plus, at the end, one page prefix."""
        if slots.numel() == 0:
            return
        P = self.page_size
        full = slots.numel() // P * P
        check_page_aligned(slots[:full], P, "request slots")
        pages = [slots[:full]]
        if full < slots.numel():
            tail = slots[full:]
            start = int(tail[0])
            if start % P or not torch.equal(tail, torch.arange(start, start + tail.numel())):
                raise ValueError(f"request tail slots {tail.tolist()} are not the start of one page")
            pages.append(torch.arange(start, start + P))
        self.token_to_kv_pool_allocator.free(torch.cat(pages))

    def _request_key_and_slots(self, req) -> tuple[RadixKey, torch.Tensor, int]:
        kv = as_cpu_index(req.kv_indices, "req.kv_indices")
        if kv.numel() != len(req.fill_ids):
            raise ValueError(f"req.kv_indices has {kv.numel()} slots for {len(req.fill_ids)} fill_ids")
        n = len(req.fill_ids) // self.page_size * self.page_size
        return RadixKey(req.fill_ids[:n], req.extra_key), kv, n

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        """A request ended: cache its whole pages, free duplicates and its partial last page,
        release its lock. Mutates the tree and the allocator; not the request."""
        key, kv, n = self._request_key_and_slots(req)
        start = len(req.prefix_indices)
        if self.disable or not is_insert:
            self._free_request_slots(kv[start:])
        else:
            prefix_len = self.insert(InsertParams(key=key, value=kv[:n], priority=request_priority(req))).prefix_len
            if prefix_len > start:
                self.token_to_kv_pool_allocator.free(kv[start:prefix_len])
            self._free_request_slots(kv[n:])
        if not self.disable:
            self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req, chunked: bool = False) -> None:
        """A running request (or a prefill chunk): cache its whole pages and move its lock.

        Mutates the request: ``kv_indices[:n]`` and ``prefix_indices`` become the tree's slots
        for its ``n`` page-aligned tokens (duplicates are freed), ``last_node`` the new node.
        The caller must write ``req.kv_indices`` back into the request's req_to_token row:
        the freed duplicate slots are still there and must not be read again.
        """
        if self.disable:
            return
        key, kv, n = self._request_key_and_slots(req)
        start = len(req.prefix_indices)
        params = InsertParams(key=key, value=kv[:n], chunked=chunked, priority=request_priority(req))
        prefix_len = self.insert(params).prefix_len
        if prefix_len > start:
            self.token_to_kv_pool_allocator.free(kv[start:prefix_len])
        path, node, pos = [], self.root_node, 0
        while pos < n:  # the device path just inserted (whatever a match would truncate)
            node = self._step(node, key, pos)
            if node is None or node.value is None:
                raise CacheIntegrityError(f"re-walk after insert stopped at {pos} of {n} tokens")
            path.append(node.value)
            pos += len(node.key)
        new_indices = torch.cat(path) if path else empty_indices()
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.last_node)
        req.kv_indices = torch.cat([new_indices, kv[n:]])
        req.prefix_indices = new_indices
        req.last_node = node
