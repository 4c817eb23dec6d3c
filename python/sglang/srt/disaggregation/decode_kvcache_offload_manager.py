"""Decode-side KV offload (``--disaggregation-decode-enable-offload-kvcache``, upstream's flag).

In a PD deployment the decode server holds the only copy of a finished turn's answer KV; the
next turn's prefill would recompute it. With this flag the decode server writes every finished
request's KV (prompt and generated tokens, whole pages) to the L3 storage the prefill servers
share, under the keys a prefill server computes for the same tokens, so the next turn's prefill
gets storage hits covering the previous prompt **and** answer.

How (a deliberate difference from upstream, whose manager builds its own host buffer and
controller beside the tree): the flag turns on this server's HiCache (``server_args``), and the
write is the tree's own write-through path. A finished request's pages enter the decode tree
(``cache_finished_req``); write-through queues their device -> host copy on the write lane and,
once it is acknowledged, their host -> L3 backup on the storage thread. So:

- the keys are the tree's page-hash chain over the same namespace a prefill server's tree uses
  (model fingerprint, KV dtype, page size, host layout, TP rank/size, ``namespace_salt``):
  hits need prefill and decode to agree on all of them, TP size included (a decode rank of
  another TP size holds other heads, so its pages live under other names);
- nothing blocks the decode loop (both copies run on worker threads, acknowledged by the
  per-step ``check_hicache_events``);
- no KV is freed before its copy is done (a node stays locked until its host copy is
  acknowledged; its host copy is protected until its L3 backup ended);
- it is bounded: a host pool short of room skips the backup, a failing L3 counts a failed
  backup; the request has already finished normally either way.

Pages the prefill server already stored (the prompt) are found by the backend's existence check
and not written again.

State models (a Mamba / linear-attention state pool, e.g. Qwen3-Next): a prefill server resumes
from L3 only at a page that has a stored state, and a finished request's state is the one after
its last token, mid-page unless that ends on a page boundary. So the decode server checkpoints
the state at every page boundary it decodes across (its state track interval becomes the page
size): the checkpoint enters the tree with its pages and goes to L3 with them. Cost: one state
copy and one tree insert per request per page decoded (upstream refuses decode offload for these
models).

This class checks that the tree provides that path, sets the state track interval, and counts
what finished requests handed to the tree (``info()``).
"""

from __future__ import annotations

import logging

from sglang.srt.managers.cache_factory import storage_enabled
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.controller.hicache_config import WritePolicy

logger = logging.getLogger(__name__)

FLAG = "--disaggregation-decode-enable-offload-kvcache"


class DecodeKVCacheOffloadManager:
    """Decode-side offload of finished requests' KV to L3 through ``tree_cache`` (a HiRadixCache
    with an L3 backend and the write_through policy; ValueError otherwise). ``state_slots``: the
    scheduler's ``MambaStateSlots`` for a state model (its track interval is lowered to
    ``page_size``), else None."""

    def __init__(self, tree_cache, page_size: int, state_slots=None):
        if not storage_enabled(tree_cache):
            raise ValueError(f"{FLAG} needs a prefix cache with a host tier and L3 storage, got "
                             f"{type(tree_cache).__name__} without one (start with --hicache-storage-backend)")
        policy = getattr(tree_cache, "write_policy", None)
        if policy is not WritePolicy.WRITE_THROUGH:
            raise ValueError(f"{FLAG} needs --hicache-write-policy write_through, got {policy}")
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.num_requests = 0  # finished requests whose KV went to the tree
        self.num_pages = 0  # their whole pages (each written to L3 unless already there, or bounded out)
        if state_slots is not None and state_slots.track_interval != page_size:
            logger.info("decode offload: state checkpoint every page (%d tokens, was every %d) so the next "
                        "turn's prefill can resume from L3 at the answer's last whole page",
                        page_size, state_slots.track_interval)
            state_slots.track_interval = page_size
        logger.info("decode offload: finished requests' KV goes to L3 (%s)",
                    tree_cache.cache_controller.storage_backend_name)

    def offload_kv_cache(self, req: Req) -> int:
        """Called as ``req`` finishes, before the tree takes its KV (which queues the write).
        Returns the whole pages handed over: those of the tokens with KV (prompt and generated
        tokens but the last, which was sampled and never run); 0 for a request holding no KV."""
        if req.req_pool_idx is None:
            return 0  # its KV never fully arrived (failed transfer): nothing is cached or written
        pages = req.kv_len // self.page_size
        self.num_requests += 1
        self.num_pages += pages
        return pages

    def info(self) -> dict:
        return {"pd_offload_requests": self.num_requests, "pd_offload_pages": self.num_pages}
