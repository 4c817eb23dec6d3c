"""Prefill half of KV movement: which route a chunk takes to one destination, and its bytes.

Mixed into ``PDKVManager``; uses its ``args``, ``staging``, ``copier``, ``copy_thread``, ``config``,
``_post``, ``_track``, ``check`` and ``finish``, and counts every posted WRITE in ``route_counts``.
Staged routes come back from ``send_kvcache`` as pieces; ``post_pieces`` posts the pieces of all
destinations of a chunk as one pipeline (each gather one piece ahead of the WRITEs).

One descriptor costs a fixed few microseconds on UCX/CMA whatever its size, so the route is the
cheapest of: direct descriptors (one per run of pages, or per token when heads are cut), or
staging (local copies, then one run per buffer). ``TransferConfig.descriptor_cost_bytes`` turns
descriptors into copy bytes for that comparison. The decode side decides whether its staging
is used (``DstInfo.staging_offset``); this side decides whether to pack locally first.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from dataclasses import dataclass
from enum import Enum

import numpy as np

from sglang.srt.disaggregation.base.conn import KVTransferError, as_page_ids
from sglang.srt.disaggregation.common.descriptors import (
    into_staging_descs,
    kv_page_descs,
    kv_token_slice_descs,
    page_run_count,
    staged_bases,
    staged_run_descs,
)
from sglang.srt.disaggregation.common.messages import Notif, NotifKind
from sglang.srt.disaggregation.common.status import DstInfo, PrefillRoom

logger = logging.getLogger(__name__)


class KVRoute(str, Enum):
    """How a WRITE carried KV (counted per WRITE in ``PDKVManager.route_counts``)."""

    PAGES = "pages"  # runs of whole pages straight into the decode's pool
    PACKED = "packed"  # gathered into local staging, one run per buffer into the decode's staging
    DECODE_STAGING = "decode_staging"  # runs of source pages into the decode's staging
    GATHER = "gather"  # heads gathered into local staging laid out as whole destination pages
    TOKEN_SLICE = "token_slice"  # one descriptor per (buffer, token): send_kvcache_slice


@dataclass(frozen=True)
class Piece:
    """One WRITE of a staged chunk: ``pages`` (source page ids) as request pages from
    ``first_page``, into the decode's staging (``dst_pages`` None) or its pool pages; ``pack``:
    gather into local staging first."""

    dst: DstInfo
    peer: dict
    pages: np.ndarray
    dst_pages: np.ndarray | None
    first_page: int
    is_last: bool
    pack: bool


class KVRoutesMixin:
    def _kv_notif(self, room: PrefillRoom, dst: DstInfo, is_last: bool, first_page: int, num_pages: int) -> Notif:
        """The next KV chunk tag for ``dst`` (chunk ids count per destination)."""
        notif = Notif(room.room, NotifKind.KV, self.args.engine_rank, dst.next_chunk, is_last, first_page, num_pages)
        dst.next_chunk += 1
        return notif

    def send_kvcache(self, room: PrefillRoom, dst: DstInfo, peer: dict, src_pages: np.ndarray,
                     dst_pages: np.ndarray, first_page: int, is_last: bool) -> list[Piece]:
        """Post the KV of one chunk: ``src_pages`` (this rank's page ids) to ``dst_pages`` (the
        decode's), request pages [first_page, first_page + n). Direct routes post at once (every
        Transfer appended to ``room.handles``); staged ones come back as pieces for
        ``post_pieces``, which pipelines the pieces of every destination of the chunk."""
        hs = dst.head_slice
        if dst.staging_offset >= 0 and src_pages.size:
            return self._staged_pieces(dst, peer, src_pages, first_page, is_last)
        if hs is None or src_pages.size == 0:
            self.route_counts[KVRoute.PAGES] += 1
            descs = kv_page_descs(self.args.kv_data_ptrs, peer["kv_ptrs"], self.args.kv_item_lens, self.args.page_size,
                                  src_pages, dst_pages)
            notif = self._kv_notif(room, dst, is_last, first_page, src_pages.size)
            self._track(room, self._post(dst.agent_name, descs, notif))
            return []
        if hs.num_heads == hs.dst_heads and self.staging is not None:
            return self._pieces(dst, peer, src_pages, dst_pages, first_page, is_last)
        self.route_counts[KVRoute.TOKEN_SLICE] += 1
        notif = self._kv_notif(room, dst, is_last, first_page, src_pages.size)
        self._track(room, self.send_kvcache_slice(dst.agent_name, src_pages, dst_pages, notif))
        return []

    def _staged_pieces(self, dst: DstInfo, peer: dict, src_pages: np.ndarray, first_page: int,
                       is_last: bool) -> list[Piece]:
        """Into the decode's staging, piece by piece so that decode scatters one piece while the
        next is on the wire: packed when source tokens are cut or the direct runs are short,
        else runs of source pages."""
        hs = dst.head_slice
        whole_src = hs is None or hs.num_heads == hs.src_heads
        direct = page_run_count(src_pages) * len(self.args.kv_data_ptrs)
        nbytes = dst.layout.nbytes(src_pages.size * self.args.page_size)
        pack = self.staging is not None and (not whole_src or direct * self.config.descriptor_cost_bytes > nbytes)
        return self._pieces(dst, peer, src_pages, None, first_page, is_last, pack)

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

    def _pieces(self, dst: DstInfo, peer: dict, src_pages: np.ndarray, dst_pages: np.ndarray | None,
                first_page: int, is_last: bool, pack: bool = True) -> list[Piece]:
        """The chunk cut in pieces of ``pack_chunk_bytes`` (see ``post_pieces``)."""
        step = max(1, self.config.pack_chunk_bytes // max(1, dst.layout.nbytes(self.args.page_size)))
        return [Piece(dst, peer, src_pages[lo:lo + step], None if dst_pages is None else dst_pages[lo:lo + step],
                      first_page + lo, is_last and lo + step >= src_pages.size, pack)
                for lo in range(0, src_pages.size, step)]

    def post_pieces(self, room: PrefillRoom, pieces: list[Piece]) -> None:
        """Post each piece as one WRITE and notification: into the decode's staging
        (``dst_pages`` None), else as whole destination pages. A ``pack`` piece is first gathered
        into local staging and travels as one run per buffer; one that finds no staging room, or
        without ``pack``, goes by direct descriptors.

        Gathers run on the copy thread one piece ahead, across destinations: UCX/CMA copies a
        WRITE's bytes inside ``transfer()`` with the GIL released, so piece k+1 is gathered while
        piece k is on the wire (and decode scatters piece k-1 meanwhile)."""
        page_size = self.args.page_size
        ahead: dict[int, tuple[int, int, Future]] = {}  # piece index -> gather under way (offset, bytes, future)
        try:
            for i, pc in enumerate(pieces):
                dst, peer, layout, tokens = pc.dst, pc.peer, pc.dst.layout, pc.pages.size * page_size
                notif = self._kv_notif(room, dst, pc.is_last, pc.first_page, pc.pages.size)
                gather = (ahead.pop(i, None) or self._start_gather(room, layout, pc.pages)) if pc.pack else None
                if gather is None:
                    if pc.pack:
                        logger.debug("%s: staging full (%d bytes wanted); direct descriptors", self.agent_name,
                                     layout.nbytes(tokens))
                    if pc.dst_pages is None:
                        self._post_into_decode_staging(room, dst, peer, pc.pages, pc.first_page, notif)
                    else:
                        self.route_counts[KVRoute.TOKEN_SLICE] += 1
                        self._track(room, self.send_kvcache_slice(dst.agent_name, pc.pages, pc.dst_pages, notif))
                    continue
                off, nbytes, future = gather
                ahead[i] = gather  # until posted: freed below if anything fails first
                try:
                    future.result()
                except Exception as exc:  # a copy error fails the room (ABORT to decode), not the caller
                    raise KVTransferError(f"gathering {nbytes} staged bytes for {dst.agent_name} failed: "
                                          f"{exc!r}") from exc
                nxt = pieces[i + 1] if i + 1 < len(pieces) else None
                if nxt is not None and nxt.pack:
                    started = self._start_gather(room, nxt.dst.layout, nxt.pages)
                    if started is not None:
                        ahead[i + 1] = started
                del ahead[i]  # _post owns the range from here (frees it on failure)
                local = self.staging.ptr + off
                if pc.dst_pages is None:
                    self.route_counts[KVRoute.PACKED] += 1
                    descs = staged_run_descs(layout.widths, local, tokens, 0, peer["staging_ptr"] + dst.staging_offset,
                                             dst.page_ids.size * page_size, pc.first_page * page_size, tokens)
                else:
                    self.route_counts[KVRoute.GATHER] += 1
                    descs = kv_page_descs(staged_bases(local, tokens, layout.widths), peer["kv_ptrs"], layout.widths,
                                          page_size, np.arange(pc.pages.size), pc.dst_pages)
                self._track(room, self._post(dst.agent_name, descs, notif, staging=(off, nbytes)))
        finally:
            for off, nbytes, future in ahead.values():  # only after an error: gathers never posted
                wait([future])
                self.staging.free(off, nbytes)

    def _start_gather(self, room: PrefillRoom, layout, pages: np.ndarray) -> tuple[int, int, Future] | None:
        """Allocate local staging for ``pages`` and gather them into it on the copy thread:
        (offset, bytes, future), or None when staging has no room."""
        tokens = pages.size * self.args.page_size
        nbytes = layout.nbytes(tokens)
        off = self._alloc_staging(room, nbytes)
        if off is None:
            return None
        area = self.staging.tensor[off:off + nbytes]
        return off, nbytes, self.copy_thread.submit(self.copier(layout).gather, pages, area, tokens)

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

    def send_kvcache_slice(self, peer_name: str, prefill_kv_indices, dst_kv_indices, notif: Notif | None = None):
        """WRITE, per token, the heads decode ``peer_name`` takes from this rank (heterogeneous
        TP, MHA/GQA: ``decode_peers[peer_name]["head_slice"]``, fixed when it registered) from
        this rank's pages ``prefill_kv_indices`` into its pages ``dst_kv_indices`` (page ids,
        paired in order), with notification ``notif`` (None: none). Returns the posted Transfer
        (None when there is nothing to move); KVTransferError when the transport refuses, ValueError on an
        unknown peer, one this rank holds no heads for, or page lists of different lengths."""
        peer = self.decode_peers.get(peer_name)
        if peer is None:
            raise ValueError(f"{peer_name!r} is not a registered decode peer of {self.agent_name}")
        hs = peer["head_slice"]
        if hs is None:
            why = ("MLA latents move as whole pages (send_kvcache)" if self.args.is_mla else
                   f"it takes no KV heads from prefill tp_rank {self.args.tp_rank}")
            raise ValueError(f"no head slice for decode {peer_name} (tp_rank {peer['tp_rank']}): {why}")
        descs = kv_token_slice_descs(
            self.args.kv_data_ptrs, self.args.kv_item_lens, peer["kv_ptrs"], peer["peer"]["kv_item_lens"],
            self.args.page_size, as_page_ids(prefill_kv_indices, "prefill_kv_indices"),
            as_page_ids(dst_kv_indices, "dst_kv_indices"), hs,
        )
        return self._post(peer_name, descs, notif)
