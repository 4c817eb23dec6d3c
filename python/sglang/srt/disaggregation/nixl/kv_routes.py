"""Prefill half of KV movement: which route a chunk takes to one destination, and its bytes.

Mixed into ``NixlKVManager``; uses its ``args``, ``staging``, ``copier``, ``config``, ``_post``,
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
    into_staging_descs,
    kv_page_descs,
    kv_token_slice_descs,
    page_run_count,
    staged_bases,
    staged_run_descs,
)
from sglang.srt.disaggregation.common.messages import Notif, NotifKind
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
        """Into the decode's staging, piece by piece so that decode scatters one piece while the
        next is on the wire: packed when source tokens are cut or the direct runs are short,
        else runs of source pages."""
        hs = dst.head_slice
        whole_src = hs is None or hs.num_heads == hs.src_heads
        direct = page_run_count(src_pages) * len(self.args.kv_data_ptrs)
        nbytes = dst.layout.nbytes(src_pages.size * self.args.page_size)
        pack = self.staging is not None and (not whole_src or direct * self.config.descriptor_cost_bytes > nbytes)
        self._send_pieces(room, dst, peer, src_pages, None, first_page, is_last, pack)

    def _post_into_decode_staging(self, room: PrefillRoom, dst: DstInfo, peer: dict, src_pages: np.ndarray,
                                  first_page: int, notif: Notif) -> None:
        """Descriptors straight from the pool into the decode's staged layout: page runs when
        source tokens are whole, else one per (buffer, token)."""
        hs = dst.head_slice
        whole_src = hs is None or hs.num_heads == hs.src_heads
        self.route_counts[KVRoute.DECODE_STAGING if whole_src else KVRoute.TOKEN_SLICE] += 1
        descs = into_staging_descs(self.args.kv_data_ptrs, self.args.kv_item_lens, self.args.page_size, src_pages, hs,
                                   peer["staging_ptr"] + dst.staging_offset, dst.page_ids.size * self.args.page_size,
                                   first_page, dst.layout.widths)
        self._track(room, self._post(dst.agent_name, descs, notif))

    def _send_pieces(self, room: PrefillRoom, dst: DstInfo, peer: dict, src_pages: np.ndarray,
                     dst_pages: np.ndarray | None, first_page: int, is_last: bool, pack: bool = True) -> None:
        """Post the chunk in pieces of ``pack_chunk_bytes``, one WRITE and notification each:
        into the decode's staging (``dst_pages`` None), else as whole destination pages. With
        ``pack`` a piece is first gathered into local staging and travels as one run per buffer;
        a piece that finds no staging room, or without ``pack``, goes by direct descriptors."""
        page_size, layout = self.args.page_size, dst.layout
        step = max(1, self.config.pack_chunk_bytes // max(1, layout.nbytes(page_size)))
        for lo in range(0, src_pages.size, step):
            pages = src_pages[lo:lo + step]
            tokens, last = pages.size * page_size, is_last and lo + step >= src_pages.size
            notif = self._kv_notif(room, dst, last, first_page + lo, pages.size)
            nbytes = layout.nbytes(tokens)
            off = self._alloc_staging(room, nbytes) if pack else None
            if off is None:
                if pack:
                    logger.debug("%s: staging full (%d bytes wanted); direct descriptors", self.agent_name, nbytes)
                if dst_pages is None:
                    self._post_into_decode_staging(room, dst, peer, pages, first_page + lo, notif)
                else:
                    self.route_counts[KVRoute.TOKEN_SLICE] += 1
                    self._track(room, self.send_kvcache_slice(dst, peer, pages, dst_pages[lo:lo + step], notif))
                continue
            self.copier(layout).gather(pages, self.staging.tensor[off:off + nbytes], tokens)
            local = self.staging.ptr + off
            if dst_pages is None:
                self.route_counts[KVRoute.PACKED] += 1
                descs = staged_run_descs(layout.widths, local, tokens, 0, peer["staging_ptr"] + dst.staging_offset,
                                         dst.page_ids.size * page_size, (first_page + lo) * page_size, tokens)
            else:
                self.route_counts[KVRoute.GATHER] += 1
                descs = kv_page_descs(staged_bases(local, tokens, layout.widths), peer["kv_ptrs"], layout.widths,
                                      page_size, np.arange(pages.size), dst_pages[lo:lo + step])
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
