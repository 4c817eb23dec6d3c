"""Decode server side of PD serving: pre-allocation queue -> transfer queue -> normal decoding.

A request (carrying the router's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``)
gets a KV receiver of the transfer backend (``NixlKVReceiver`` / ``MooncakeKVReceiver``) for the
prefill server at that address and waits in the pre-allocation queue until the receiver found its
prefill ranks and device memory allows it: then it takes a request-table row and the pages of its
whole prompt, reserves its decode pages the way ``PrefillAdder`` does (prompt + max_new_tokens -
1, so decoding never runs short), and hands the receiver the destination page ids and its aux row.
In the transfer queue it is polled every step; once every TP rank saw the transfer complete, its
first token is read from the aux row and it joins the running batch like a request that was just
prefilled here. A failed or aborted transfer finishes the request aborted, with the reason, at
once; its pages and row stay in **quarantine** for ``heartbeat_timeout_s`` before they are freed:
prefill may already have posted a write into them, which NIXL cannot cancel, and a page reused by
another request before that write lands would feed it foreign KV. Within that time a live prefill
has seen the abort (and any posted write has landed: milliseconds), and a prefill whose heartbeats
stopped is dead. Quarantined pages count as held (integrity check, reservations). A state model's
request also takes a state slot, which prefill fills with the state after the prompt; it is
quarantined and freed with the pages.

Decode-side prefix caching is not done: every prompt's KV comes from prefill (finished
requests still give their KV to this server's tree, which only evicts it). With
``--disaggregation-decode-enable-offload-kvcache`` that tree has a host tier and L3, and what
finished requests give it is written on to L3 for the next turn's prefill
(``decode_kvcache_offload_manager.py``).
"""

from __future__ import annotations

import logging
import time

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.scheduler_side import DisaggBase, take_state_slot
from sglang.srt.disaggregation.common.trust import BootstrapAddr
from sglang.srt.disaggregation.utils import agreed_polls, get_kv_class, page_ids_of
from sglang.srt.distributed import tensor_model_parallel_cpu_all_reduce_min
from sglang.srt.managers.schedule_batch import FinishReason, Req, num_pages
from sglang.srt.mem_cache.radix.tree_node import empty_indices

logger = logging.getLogger(__name__)


class DecodeDisagg(DisaggBase):
    mode = "decode"

    def __init__(self, scheduler):
        super().__init__(scheduler, None)
        self.prealloc: list[tuple[Req, object]] = []  # waiting for the prefill ranks and for memory
        self.transfer: list[tuple[Req, object]] = []  # destination pages handed over, KV on its way
        self.memory_waits: set[str] = set()  # rids that had to wait for device memory (or a request row)
        self.num_memory_waits = 0
        # (free-after deadline, request row, request): pages a late prefill write may still reach
        self.quarantine: list[tuple[float, int, Req]] = []
        self.quarantine_s = self.mgr.config.heartbeat_timeout_s
        self.offload = None  # writes finished requests' KV to L3 (--disaggregation-decode-enable-offload-kvcache)
        if getattr(scheduler.args, "disaggregation_decode_enable_offload_kvcache", False):
            from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager

            self.offload = DecodeKVCacheOffloadManager(scheduler.tree_cache, self.page_size, scheduler.mamba)

    # ---- scheduler interface -------------------------------------------------------------------
    def add_request(self, req: Req, msg) -> bool:
        receiver_cls = get_kv_class(self.backend, "receiver")
        if msg.bootstrap_room is None or msg.bootstrap_host is None or msg.bootstrap_port is None:
            req.finish(FinishReason.ABORT, message="a decode server needs bootstrap_host, bootstrap_port and "
                                                   "bootstrap_room (send requests through the PD router)")
            self.sched._finish(req)
            return True
        try:  # the address is validated and checked against the trust policy before any lookup
            addr = BootstrapAddr(msg.bootstrap_host, msg.bootstrap_port)
            receiver = receiver_cls(self.mgr, addr, msg.bootstrap_room)
        except ValueError as exc:  # malformed, untrusted, or the room already has a receiver here
            req.finish(FinishReason.ABORT, message=str(exc))
            self.sched._finish(req)
            return True
        self.prealloc.append((req, receiver))
        return True

    def step(self) -> None:
        if self.quarantine:
            self._release_quarantined()
        if self.prealloc:
            self._poll_prealloc()
        if self.transfer:
            self._poll_transfer()

    def intercept_finish(self, req: Req) -> bool:
        if self.offload is not None:
            self.offload.offload_kv_cache(req)  # the tree takes its KV next, which queues the writes
        return False

    def abort(self, rid: str) -> bool:
        for queue in (self.prealloc, self.transfer):
            for i, (req, receiver) in enumerate(queue):
                if req.rid == rid:
                    del queue[i]
                    receiver.abort()
                    self._quarantine(req) if queue is self.transfer else self._release(req)
                    req.finish(FinishReason.ABORT, message="aborted")
                    self.sched._finish(req)
                    return True
        return False

    def queued_reqs(self) -> list[Req]:
        return [r for r, _ in self.prealloc]

    def held_reqs(self) -> list[Req]:
        return [r for r, _ in self.transfer] + [r for _, _, r in self.quarantine]

    def info(self) -> dict:
        return {**super().info(), "pd_prealloc_queue": len(self.prealloc), "pd_transfer_queue": len(self.transfer),
                "pd_memory_waits": self.num_memory_waits, "pd_quarantined": len(self.quarantine),
                **(self.offload.info() if self.offload is not None else {})}

    # ---- queues --------------------------------------------------------------------------------
    def _poll_prealloc(self) -> None:
        states = agreed_polls([r.poll() for _, r in self.prealloc])
        keep, memory_short = [], False
        for (req, receiver), state in zip(self.prealloc, states, strict=True):
            if state is KVPoll.Failed:
                self._drop(req, receiver)
            elif state is KVPoll.WaitingForInput and not memory_short and self._allocate(req):
                pages = page_ids_of(req.kv_indices, self.page_size)
                receiver.init(pages, aux_index=req.req_pool_idx, state_indices=req.mamba_pool_idx)
                self.transfer.append((req, receiver))
            else:
                if state is KVPoll.WaitingForInput:
                    memory_short = True  # first come, first served: later requests wait behind it
                    if req.rid not in self.memory_waits:
                        self.memory_waits.add(req.rid)
                        self.num_memory_waits += 1
                keep.append((req, receiver))
        self.prealloc = keep
        self.memory_waits &= {r.rid for r, _ in keep}

    def _poll_transfer(self) -> None:
        states = agreed_polls([r.poll() for _, r in self.transfer])
        keep = []
        for (req, receiver), state in zip(self.transfer, states, strict=True):
            if state is KVPoll.Success:
                self.num_transferred += 1
                self._start_decoding(req)
            elif state is KVPoll.Failed:
                self._drop(req, receiver)
            else:
                keep.append((req, receiver))
        self.transfer = keep

    def _allocate(self, req: Req) -> bool:
        """Take a request row and the prompt's pages, reserving the decode pages too; False (nothing
        taken) when the request table or device memory is short."""
        sched, pool = self.sched, self.runner.req_to_token_pool
        if pool.available_size() == 0:
            return False
        tree, P = sched.tree_cache, self.page_size
        n = len(req.origin_input_ids)
        own_pages = num_pages(n + max(req.sampling_params.max_new_tokens - 1, 0), P)
        room = self.runner.token_to_kv_pool_allocator.available_size() + tree.evictable_size()
        if own_pages * P > room - sched._reserved_tokens():
            return False
        if sched.mamba is not None and not take_state_slot(sched.mamba, req, n):
            return False
        req.prefix_indices, req.kv_indices, req.last_node = empty_indices(), empty_indices(), tree.root_node
        req.max_pages, req.pages_allocated = own_pages, 0
        req.req_pool_idx = pool.alloc(1)[0]
        slots = sched.slots.take(req, n)
        pool.write((req.req_pool_idx, slice(0, n)), slots)
        return True

    def _start_decoding(self, req: Req) -> None:
        """The KV and first token arrived: the request continues as if prefilled here."""
        sched = self.sched
        token, logprob, top = self.aux.read(req.req_pool_idx)
        self.aux.clear(req.req_pool_idx)
        if req.sampling_params.max_new_tokens == 0:
            req.finish(FinishReason.LENGTH)
            sched._finish(req)
            return
        if token is None:
            self._release(req)
            self.fail(req, "prefill sent no first token")
            sched._finish(req)
            return
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        req.top_logprobs.append(top[: req.top_logprobs_num])
        req.check_finished(token, sched.context_len, sched._tail_text)
        if req.finished is not None:
            sched._finish(req)
            return
        sched.running.append(req)
        sched._cache_unfinished(req)
        sched._outputs.append(req.make_output())  # the first token: TTFT

    def _release(self, req: Req) -> None:
        """Free the pages and row of a request whose KV never fully arrived (not into the tree:
        its pages may hold partial KV)."""
        if req.req_pool_idx is None:
            return
        self.sched.tree_cache.cache_finished_req(req, is_insert=False)
        if self.sched.mamba is not None:
            self.sched.mamba.on_finished(req)  # its state slot (held through quarantine too)
        self.runner.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def _quarantine(self, req: Req) -> None:
        """Hold the pages and row of a request whose destination pages prefill knows (see the
        module doc); the request itself can finish now (its row is detached from it until freed)."""
        if req.req_pool_idx is None:
            return
        req.max_pages = req.pages_allocated  # keeps what it holds, reserves nothing more
        self.quarantine.append((time.monotonic() + self.quarantine_s, req.req_pool_idx, req))
        req.req_pool_idx = None  # so finishing it neither caches nor frees anything

    def _release_quarantined(self) -> None:
        """Free the quarantined requests whose time is up on every TP rank (agreed: the ranks'
        clocks differ, their pools must not)."""
        now = time.monotonic()
        due = tensor_model_parallel_cpu_all_reduce_min([int(now >= t) for t, _, _ in self.quarantine])
        keep = []
        for (t, row, req), done in zip(self.quarantine, due, strict=True):
            if done:
                req.req_pool_idx = row
                self._release(req)
            else:
                keep.append((t, row, req))
        self.quarantine = keep

    def _drop(self, req: Req, receiver) -> None:
        exc = receiver.failure_exception()
        receiver.abort()
        self._quarantine(req)
        self.fail(req, str(exc) if exc else "failed on another TP rank of this server")
        self.sched._finish(req)
