"""Prefill half of KV movement: which route a chunk takes to one destination, and its bytes.

Mixed into ``NixlKVManager``; uses its ``args``, ``pool``, ``staging``, ``config``, ``_post``,
``_track``, ``check`` and ``finish``, and counts every posted WRITE in ``route_counts``.

One descriptor costs a fixed few microseconds on UCX/CMA whatever its size, so the route is the
cheapest of: direct descriptors (one per run of pages, or per token when heads are cut), or
staging (local copies, then one run per buffer). ``TransferConfig.descriptor_cost_bytes`` turns
descriptors into copy bytes for that comparison. The decode side decides whether its staging
is used (``DstInfo.staging_offset``); this side decides whether to pack locally first.
"""

from __future__ import annotations

import logging
from enum import Enum

import numpy as np

from sglang.srt.disaggregation.common.descriptors import (
    kv_page_descs,
    kv_token_slice_descs,
    page_run_count,
    run_descs,
)
from sglang.srt.disaggregation.common.messages import Notif, NotifKind
from sglang.srt.disaggregation.common.rank_mapping import HeadSlice
from sglang.srt.disaggregation.common.staging import gather_slices
from sglang.srt.disaggregation.nixl.status import DstInfo, PrefillRoom

logger = logging.getLogger(__name__)


class KVRoute(str, Enum):
    """How a WRITE carried KV (counted per WRITE in ``NixlKVManager.route_counts``)."""

    PAGES = "pages"  # runs of whole pages straight into the decode's pool
    PACKED = "packed"  # gathered into local staging, one run per buffer into the decode's staging
    DECODE_STAGING = "decode_staging"  # runs of source pages into the decode's staging
    GATHER = "gather"  # heads gathered into local staging laid out as whole destination pages
    TOKEN_SLICE = "token_slice"  # one descriptor per (buffer, token): send_kvcache_slice


class KVRoutesMixin:
    def _kv_notif(self, room: PrefillRoom, dst: DstInfo, is_last: bool, first_page: int, num_pages: int) -> Notif:
        """The next KV chunk tag for ``dst`` (chunk ids count per destination)."""
        notif = Notif(room.room, NotifKind.KV, self.args.engine_rank, dst.next_chunk, is_last, first_page, num_pages)
        dst.next_chunk += 1
        return notif

    def send_kvcache(self, room: PrefillRoom, dst: DstInfo, peer: dict, src_pages: np.ndarray,
                     dst_pages: np.ndarray, first_page: int, is_last: bool) -> None:
        """Post the KV of one chunk: ``src_pages`` (this rank's page ids) to ``dst_pages`` (the
        decode's), request pages [first_page, first_page + n); appends every posted Transfer to
        ``room.handles`` at once."""
        hs = dst.head_slice
        if dst.staging_offset >= 0 and src_pages.size:
            return self._send_staged(room, dst, peer, src_pages, first_page, is_last)
        if hs is None or src_pages.size == 0:
            self.route_counts[KVRoute.PAGES] += 1
            descs = kv_page_descs(self.args.kv_data_ptrs, peer["kv_ptrs"], self.args.kv_item_lens, self.args.page_size,
                                  src_pages, dst_pages)
            notif = self._kv_notif(room, dst, is_last, first_page, src_pages.size)
            return self._track(room, self._post(dst.agent_name, descs, notif))
        if hs.num_heads == hs.dst_heads and self.staging is not None:
            return self._send_pieces(room, dst, peer, src_pages, dst_pages, first_page, is_last)
        self.route_counts[KVRoute.TOKEN_SLICE] += 1
        notif = self._kv_notif(room, dst, is_last, first_page, src_pages.size)
        self._track(room, self.send_kvcache_slice(dst, peer, src_pages, dst_pages, notif))

    def _send_staged(self, room: PrefillRoom, dst: DstInfo, peer: dict, src_pages: np.ndarray, first_page: int,
                     is_last: bool) -> None:
        """Into the decode's staging: packed pieces when source tokens are cut or the direct
        runs are short, else runs of source pages."""
        hs = dst.head_slice
        whole_src = hs is None or hs.num_heads == hs.src_heads
        direct = page_run_count(src_pages) * len(self.args.kv_data_ptrs)
        nbytes = dst.layout.nbytes(src_pages.size * self.args.page_size)
        if self.staging is not None and (not whole_src or direct * self.config.descriptor_cost_bytes > nbytes):
            return self._send_pieces(room, dst, peer, src_pages, None, first_page, is_last)
        notif = self._kv_notif(room, dst, is_last, first_page, src_pages.size)
        self._post_into_decode_staging(room, dst, peer, src_pages, first_page, notif)

    def _remote_bases(self, dst: DstInfo, peer: dict) -> np.ndarray:
        return dst.layout.bases(peer["staging_ptr"] + dst.staging_offset, dst.page_ids.size * self.args.page_size)

    def _post_into_decode_staging(self, room: PrefillRoom, dst: DstInfo, peer: dict, src_pages: np.ndarray,
                                  first_page: int, notif: Notif) -> None:
        """Descriptors straight from the pool into the decode's staged layout: page runs when
        source tokens are whole, else one per (buffer, token)."""
        hs, page_size = dst.head_slice, self.args.page_size
        positions = np.arange(first_page, first_page + src_pages.size)
        bases = self._remote_bases(dst, peer)
        if hs is None or hs.num_heads == hs.src_heads:
            self.route_counts[KVRoute.DECODE_STAGING] += 1
            descs = kv_page_descs(self.args.kv_data_ptrs, bases, dst.layout.widths, page_size, src_pages, positions)
        else:
            self.route_counts[KVRoute.TOKEN_SLICE] += 1
            into = HeadSlice(hs.src_head_offset, 0, hs.num_heads, hs.src_heads, hs.num_heads)
            descs = kv_token_slice_descs(self.args.kv_data_ptrs, self.args.kv_item_lens, bases, dst.layout.widths,
                                         page_size, src_pages, positions, into)
        self._track(room, self._post(dst.agent_name, descs, notif))

    def _send_pieces(self, room: PrefillRoom, dst: DstInfo, peer: dict, src_pages: np.ndarray,
                     dst_pages: np.ndarray | None, first_page: int, is_last: bool) -> None:
        """Gather the chunk piece by piece (``pack_chunk_bytes``) into local staging and write
        each piece: into the decode's staging (``dst_pages`` None), else as whole destination
        pages. A piece that finds no staging room goes by direct descriptors."""
        page_size, layout = self.args.page_size, dst.layout
        step = max(1, self.config.pack_chunk_bytes // max(1, layout.nbytes(page_size)))
        for lo in range(0, src_pages.size, step):
            pages = src_pages[lo:lo + step]
            tokens, last = pages.size * page_size, is_last and lo + step >= src_pages.size
            notif = self._kv_notif(room, dst, last, first_page + lo, pages.size)
            nbytes = layout.nbytes(tokens)
            off = self._alloc_staging(room, nbytes)
            if off is None:
                logger.debug("%s: staging full (%d bytes wanted); direct descriptors", self.agent_name, nbytes)
                if dst_pages is None:
                    self._post_into_decode_staging(room, dst, peer, pages, first_page + lo, notif)
                else:
                    self.route_counts[KVRoute.TOKEN_SLICE] += 1
                    self._track(room, self.send_kvcache_slice(dst, peer, pages, dst_pages[lo:lo + step], notif))
                continue
            local = layout.bases(self.staging.ptr + off, tokens)
            gather_slices(self.pool, layout, page_size, pages, self.staging.ptr + off, tokens)
            if dst_pages is None:
                self.route_counts[KVRoute.PACKED] += 1
                widths = np.asarray(layout.widths, dtype=np.int64)
                descs = run_descs(local, self._remote_bases(dst, peer) + (first_page + lo) * page_size * widths,
                                  tokens * widths)
            else:
                self.route_counts[KVRoute.GATHER] += 1
                descs = kv_page_descs(local, peer["kv_ptrs"], layout.widths, page_size, np.arange(pages.size),
                                      dst_pages[lo:lo + step])
            self._track(room, self._post(dst.agent_name, descs, notif, staging=(off, nbytes)))

    def _alloc_staging(self, room: PrefillRoom, nbytes: int) -> int | None:
        """A local staging range; first releases this room's finished WRITEs when full."""
        off = self.staging.alloc(nbytes)
        if off is None and room.handles:
            pending = []
            for transfer in room.handles:
                if self.check(transfer) == "DONE":
                    self.finish(transfer)
                else:
                    pending.append(transfer)
            room.handles = pending
            off = self.staging.alloc(nbytes)
        return off

    def send_kvcache_slice(self, dst: DstInfo, peer: dict, src_pages: np.ndarray, dst_pages: np.ndarray,
                           notif: Notif):
        """Per token, the heads ``dst.head_slice`` names (heterogeneous TP, MHA/GQA)."""
        descs = kv_token_slice_descs(
            self.args.kv_data_ptrs, self.args.kv_item_lens, peer["kv_ptrs"], peer["peer"]["kv_item_lens"],
            self.args.page_size, src_pages, dst_pages, dst.head_slice,
        )
        return self._post(dst.agent_name, descs, notif)
