"""Scheduler: continuous batching with chunked prefill over one ModelRunner and its prefix cache.

One ``step``: consume finished host transfers (``check_hicache_events``), then run either a
prefill batch (the continuing chunked request, then waiting requests, see ``PrefillAdder``)
or, when none can be formed, one decode step for every running request. Finished requests go
back to the tree (``cache_finished_req``). Each TP rank runs this same code on the same inputs
(broadcast by rank 0, see ``scheduler_process.py``), so all ranks make the same decisions.

With L3 storage each waiting request starts a prefetch when it is queued (``_prefetch``); a
request whose check missed and that still waits behind others has the check issued again every
``--hicache-storage-prefetch-retry-poll-interval`` steps, at most
``--hicache-storage-prefetch-retry-max-attempts`` times (``_reissue_prefetches``; the rules are
in ``mem_cache/hiradix/prefetch_retries.py``).

When the engine is idle (no request, no transfer in flight) ``on_idle`` runs
``check_integrity`` once: every device and host slot is free, in the tree or held by a
request, and no slot or request row has leaked.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from sglang.srt.distributed import world_cpu_gather_objects
from sglang.srt.managers.cache_factory import (
    build_tree_cache,
    controller_report,
    storage_controller_of,
    storage_enabled,
)
from sglang.srt.managers.io_struct import (
    AbortReq,
    ControlKind,
    ControlOutput,
    ControlReq,
    ReqOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.mamba_state import MambaStateSlots
from sglang.srt.managers.schedule_batch import FinishReason, Req, num_pages
from sglang.srt.managers.schedule_policy import AddResult, PrefillAdder, WaitingQueueOrder, match_request
from sglang.srt.managers.scheduler_stats import SchedulerStats
from sglang.srt.managers.storage_admin import ADMIN_KINDS, handle_storage_admin
from sglang.srt.managers.token_slots import TokenSlotAllocator
from sglang.srt.mem_cache.radix.events import KVEventBatch
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.controller.storage_ops import HiCacheFlushIncomplete
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

STOP_STRING_TAIL_TOKENS = 8  # extra tokens decoded beyond the longest stop string


def runner_config(args, tp_rank: int = 0, dist_init_method: str | None = None) -> ModelRunnerConfig:
    """``tp_rank``: the global rank, ``pp_rank * tp_size + tp_rank`` (under --pp-size; under
    --attn-cp-size ``attn_cp_rank * tp_size + tp_rank``)."""
    pp_size, cp_size = getattr(args, "pp_size", 1), getattr(args, "attn_cp_size", 1)
    outer = tp_rank // args.tp_size  # the stage or the CP rank (PP and CP are not combined)
    return ModelRunnerConfig(
        model_path=args.model_path, load_format=args.load_format, device=args.device, dtype=args.dtype,
        tp_size=args.tp_size, tp_rank=tp_rank % args.tp_size, pp_size=pp_size, pp_rank=outer if pp_size > 1 else 0,
        attn_cp_size=cp_size, attn_cp_rank=outer if cp_size > 1 else 0,
        dist_init_method=dist_init_method, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests, context_length=args.context_length, seed=args.random_seed,
        max_mamba_cache_size=args.max_mamba_cache_size, mamba_full_memory_ratio=args.mamba_full_memory_ratio,
        disable_radix_cache=args.disable_radix_cache,
    )


class Scheduler:
    def __init__(self, server_args, tp_rank: int = 0, dist_init_method: str | None = None,
                 disagg_factory=None, kv_events_factory=None):
        """``disagg_factory(scheduler)`` builds the PD helper of a ``--disaggregation-mode``
        server (the engine passes ``disaggregation.scheduler_glue.build_disaggregation``);
        ``kv_events_factory(config)`` the KV event publisher of a ``--kv-events-config`` server
        (the engine passes ``disaggregation.kv_events.EventPublisherFactory.create``; TP rank 0
        publishes, the others hold the same tree). This package does not import the
        disaggregation one, which sits above it."""
        mode = getattr(server_args, "disaggregation_mode", "null")
        if mode != "null" and disagg_factory is None:
            raise ValueError(f"--disaggregation-mode {mode} needs a disagg_factory "
                             "(sglang.srt.disaggregation.scheduler_glue.build_disaggregation)")
        kv_events_config = getattr(server_args, "kv_events_config", None)
        if kv_events_config and kv_events_factory is None:
            raise ValueError("--kv-events-config needs a kv_events_factory "
                             "(sglang.srt.disaggregation.kv_events.EventPublisherFactory.create)")
        self.args = server_args
        self.runner = ModelRunner(runner_config(server_args, tp_rank, dist_init_method))
        self.page_size = server_args.page_size
        self.context_len = self.runner.model_config.context_len
        self.vocab_size = self.runner.model_config.vocab_size
        self.tokenizer = get_tokenizer(server_args.tokenizer_path or server_args.model_path)
        self.tree_cache = build_tree_cache(server_args, self.runner)
        self.hicache = isinstance(self.tree_cache, HiRadixCache)
        if self.hicache:  # one host reservation and one write-lane job per step (see step())
            self.tree_cache.defer_backups = True
            self.tree_cache.cache_controller.defer_writes = True
        self.storage_enabled = storage_enabled(self.tree_cache)
        self.slots = TokenSlotAllocator(self.tree_cache, self.runner.token_to_kv_pool_allocator, self.page_size)
        self.mamba = MambaStateSlots.build(self.tree_cache, self.runner,  # None without a state pool
                                           track_interval=server_args.mamba_track_interval)
        self.waiting: deque[Req] = deque()
        self.queue_order = WaitingQueueOrder(server_args.schedule_policy, self.tree_cache, server_args.random_seed)
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.stats = SchedulerStats()
        self._outputs: list[ReqOutput] = []
        self._idle_checked = True
        # PD queues and transfers; None in null mode
        self.disagg = disagg_factory(self) if disagg_factory is not None else None
        # where each step's KV events go (rank 0 of a --kv-events-config server); None otherwise
        self.kv_event_publisher = kv_events_factory(kv_events_config) if kv_events_config and tp_rank == 0 else None

    def server_info(self) -> dict:
        return {
            "max_total_num_tokens": self.runner.max_total_num_tokens,
            "context_len": self.context_len,
            "vocab_size": self.vocab_size,
            "page_size": self.page_size,
            "max_running_requests": self.args.max_running_requests,
            "eos_token_ids": list(self.tokenizer.eos_token_ids),
            "host_pool_tokens": self.tree_cache.cache_controller.mem_pool_host.size if self.hicache else 0,
            "storage_enabled": self.storage_enabled,
        }

    # ---- inputs ------------------------------------------------------------------------------
    def handle_messages(self, msgs: list) -> list[ControlOutput]:
        """Apply messages from the tokenizer manager, in order; replies to control requests."""
        replies = []
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.add_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, ControlReq):
                replies.append(self.handle_control(msg))
            else:
                raise TypeError(f"scheduler got an unknown message {type(msg).__name__}")
        return replies

    def _refusal(self, msg: TokenizedGenerateReqInput) -> str | None:
        """Why a request can never run here (the tokenizer manager checks the same first)."""
        n, max_new = len(msg.input_ids), msg.sampling_params.max_new_tokens
        if n == 0:
            return "the prompt is empty"
        if min(msg.input_ids) < 0 or max(msg.input_ids) >= self.vocab_size:
            return f"token ids must be in [0, {self.vocab_size})"
        if n + max_new > self.context_len:
            return f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the context length {self.context_len}"
        if num_pages(n + max_new, self.page_size) * self.page_size > self.runner.max_total_num_tokens:
            return (f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the KV pool "
                    f"({self.runner.max_total_num_tokens} tokens)")
        return None

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(msg, self.tokenizer.eos_token_ids)
        reason = self._refusal(msg)
        if reason is not None:
            req.finish(FinishReason.ABORT, message=reason)
            self._finish(req)
            return
        self._idle_checked = False
        if self.disagg is not None and self.disagg.add_request(req, msg):
            return  # the PD queues hold it until its peer is ready (prefill then calls enqueue)
        self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """Put a request into the waiting queue (and start its L3 prefetch)."""
        self.waiting.append(req)
        self._idle_checked = False
        if self.storage_enabled:
            self._prefetch(req)

    def _prefetch(self, req: Req) -> None:
        """Start the L3 prefetch of the part of the prompt the tree does not hold."""
        m = match_request(self.tree_cache, req)
        matched = m.device_indices.numel() + m.host_hit_length
        new_tokens = req.origin_input_ids[matched:-1]
        last_hash = m.last_host_node.get_last_hash_value()
        self.tree_cache.prefetch_from_storage(req.rid, m.last_host_node, new_tokens, last_hash,
                                              extra_key=req.extra_key)

    def _reissue_prefetches(self) -> None:
        """One scheduling pass of the L3 check retries: issue again the checks that are due, in
        queue order (every rank the same: the tree's inputs are agreed)."""
        due = set(self.tree_cache.pop_due_prefetch_retries(r.rid for r in self.waiting))
        for req in self.waiting:
            if req.rid in due:
                self._prefetch(req)

    def abort_request(self, rid: str) -> None:
        """Drop ``rid`` wherever it is; its computed KV goes to the tree like a finished one."""
        self._abort(rid)
        if self.hicache:  # the backups that KV made due start now, as they would in a step
            self.tree_cache.flush_step()

    def _abort(self, rid: str) -> None:
        if self.disagg is not None and self.disagg.abort(rid):
            return
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                if self.storage_enabled:
                    self.tree_cache.release_aborted_request(rid)
                req.finish(FinishReason.ABORT, message="aborted")
                self._finish(req)
                return
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
        else:
            req = next((r for r in self.running if r.rid == rid), None)
            if req is None:
                return  # already finished
            self.running.remove(req)
        req.finish(FinishReason.ABORT, message="aborted")
        self._finish(req)

    def handle_control(self, msg: ControlReq) -> ControlOutput:
        if msg.kind is ControlKind.GET_STATS:
            payload = self.stats.snapshot(self)
            # every rank's own L3 counters (e.g. MLA: TP rank 0 writes, the others skip; under
            # --pp-size every stage writes its layers) and idle integrity checks, in global rank
            # order; every rank handles this message at the same point, so the gather is collective
            per_rank = world_cpu_gather_objects((payload["storage"], self.stats.counters.num_idle_checks,
                                                 controller_report(self.tree_cache)))
            payload["storage_per_rank"] = [storage for storage, _, _ in per_rank]
            payload["idle_checks_per_rank"] = [checks for _, checks, _ in per_rank]
            payload["cache_controller_per_rank"] = [ctrl for _, _, ctrl in per_rank]
            if self.disagg is not None:
                payload["disaggregation"] = self.disagg.info()
            return ControlOutput(msg.cid, True, payload=payload)
        if msg.kind in ADMIN_KINDS:  # runtime L3 attach / detach
            return handle_storage_admin(self, msg)
        return self.flush_cache(msg.cid)

    def flush_cache(self, cid: int = 0) -> ControlOutput:
        """Drop every cached prefix on device and host (L3 keeps its pages). Refused while
        requests are in the engine."""
        if self.has_work():
            n = len(self.waiting) + len(self.running) + (self.chunked_req is not None)
            return ControlOutput(cid, False, f"cache not flushed: {n} requests in flight")
        self._idle_checked = False
        if not self.tree_cache.disable:
            try:
                self.tree_cache.reset()
            except HiCacheFlushIncomplete as exc:  # the cache is empty; a hung L3 backend still runs
                logger.warning("%s", exc)
                return ControlOutput(cid, False, str(exc), payload={"flush_incomplete": True})
        logger.info("cache flushed")
        if self.kv_event_publisher is not None:
            self.publish_kv_events()  # AllBlocksCleared now, not at the next step
        return ControlOutput(cid, True, "cache flushed")

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """One scheduling iteration; returns the outputs produced since the last call."""
        if self.hicache:
            self.tree_cache.check_hicache_events()
        if self.disagg is not None:
            self.disagg.step()  # PD queues: bootstrap / pre-allocation, transfers in flight
        if self.storage_enabled:
            self._reissue_prefetches()
        adder = self._build_prefill()
        if adder is None and not self.running and self._waiting_on_host_writes():
            # Nothing can run because the memory the waiting requests need is locked by host
            # writes in flight: wait for them (the wait releases the GIL, so the write lane runs
            # at full speed) rather than return and spin on the same answer.
            self.slots.flush_host_writes()
            adder = self._build_prefill()
        if adder is not None:
            self._run_prefill(adder)
        elif self.running:
            self._run_decode()
        if self.hicache:
            self.tree_cache.flush_step()  # one host reservation and one write-lane job for the step's backups
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        outputs, self._outputs = self._outputs, []
        return outputs

    def publish_kv_events(self) -> None:
        """Hand the tree's KV events since the last call to the publisher, as one batch."""
        events = self.tree_cache.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def _ack_finished_writes(self) -> bool:
        """Unlock memory held by host writes in flight, for a request that found none: consume
        the writes that finished since the step began, else wait for the ones in flight (the
        wait releases the GIL, so the write lane runs at once; the copies are what the device
        pool's eviction needs anyway). True when that unlocked any node.

        Write-through locks a node until its host copy is acknowledged, so its memory is not
        evictable meanwhile; without this a tight device pool admitted 1-2 requests per prefill
        where HiCache off admits 3 (issue 9). Every TP rank reaches this at the same point:
        admission decisions are agreed, and check_hicache_events agrees on the acks."""
        if not self.hicache or not self.tree_cache.ongoing_write_through:
            return False
        tree = self.tree_cache
        before = len(tree.ongoing_write_through)
        tree.check_hicache_events()
        if len(tree.ongoing_write_through) == before:
            self.slots.flush_host_writes()
        return len(tree.ongoing_write_through) < before

    def _waiting_on_host_writes(self) -> bool:
        """Requests wait while device->host writes hold nodes locked (same on every TP rank)."""
        return bool(self.waiting) and self.hicache and bool(self.tree_cache.ongoing_write_through)

    def _reserved_tokens(self) -> int:
        held = self.running + ([self.chunked_req] if self.chunked_req is not None else [])
        if self.disagg is not None:
            held += self.disagg.held_reqs()
        return sum(r.own_pages_left for r in held) * self.page_size

    def _build_prefill(self) -> PrefillAdder | None:
        budget = self.args.chunked_prefill_size if self.args.chunked_prefill_size > 0 else 1 << 62
        adder = PrefillAdder(self.tree_cache, self.runner.token_to_kv_pool_allocator, self.runner.req_to_token_pool,
                             self.page_size, budget, self._reserved_tokens(), self.storage_enabled,
                             conservativeness=self.args.schedule_conservativeness,
                             max_reserve_tokens=self.runner.max_total_num_tokens, mamba=self.mamba)
        if self.chunked_req is not None:
            adder.add_chunked(self.chunked_req)
        self.queue_order.apply(self.waiting)
        skipped = []
        while self.waiting:
            req = self.waiting.popleft()
            result = adder.try_add(req)
            if result is AddResult.NO_MEMORY and self._ack_finished_writes():
                result = adder.try_add(req)  # acknowledged host writes unlocked evictable memory
            if result is AddResult.ADDED:
                self.stats.on_admitted(req)
                if self.storage_enabled:
                    self.tree_cache.storage_prefetch_retries.forget(req.rid)
                continue
            if result is AddResult.PREFETCHING:
                skipped.append(req)
                continue
            self.waiting.appendleft(req)
            break
        self.waiting.extendleft(reversed(skipped))
        return adder if adder.entries else None

    def _run_prefill(self, adder: PrefillAdder) -> None:
        entries = adder.entries
        reqs = [r for r, _ in entries]
        prefix_lens = [r.kv_len for r in reqs]
        inputs = [r.tokens(r.kv_len, r.kv_len + n) for r, n in entries]
        out_cache_loc = self.slots.take_batch(entries)
        consumer = self.tree_cache.ready_to_load_host_cache() if self.hicache else -1
        batch = ForwardBatch.init_extend(self.runner, [r.req_pool_idx for r in reqs], prefix_lens, inputs,
                                         out_cache_loc, hicache_consumer_index=consumer,
                                         mamba_slots=self.mamba.forward_slots(reqs) if self.mamba else None)
        logits = self.runner.forward(batch)
        self.stats.counters.num_prefill_batches += 1
        self.chunked_req = adder.chunked
        done = [i for i, r in enumerate(reqs) if r.prefill_remaining == 0]
        for i, req in enumerate(reqs):
            if i not in done:
                self._cache_unfinished(req)
        if done:
            self._sample([reqs[i] for i in done], type(logits)(logits.next_token_logits[done]))

    def _run_decode(self) -> None:
        reqs = list(self.running)
        last_tokens = [r.token_at(r.kv_len) for r in reqs]  # the newest output token, no KV yet
        seq_lens = [r.kv_len + 1 for r in reqs]
        out_cache_loc = self.slots.take_batch([(r, 1) for r in reqs])
        batch = ForwardBatch.init_decode(self.runner, [r.req_pool_idx for r in reqs], last_tokens, seq_lens,
                                         out_cache_loc,
                                         mamba_slots=self.mamba.forward_slots(reqs) if self.mamba else None)
        logits = self.runner.forward(batch)
        self.stats.counters.num_decode_batches += 1
        self._sample(reqs, logits)
        if self.mamba is not None:  # state checkpoints where decode crossed a page boundary
            for req in [r for r in self.running if self.mamba.due_checkpoint(r, self.page_size)]:
                self._cache_unfinished(req)

    def _sample(self, reqs: list[Req], logits) -> None:
        """Pick each request's next token; finished ones leave, new ones join ``running``."""
        params = [r.sampling_params for r in reqs]
        info = SamplingBatchInfo.from_params(params, self.vocab_size, self.runner.device,
                                             seeds=[r.seed or 0 for r in reqs], steps=[len(r.output_ids) for r in reqs])
        tops = [r.top_logprobs_num for r in reqs]
        out = self.runner.sample(logits, info, return_logprob=True, top_logprobs_nums=tops)
        for i, req in enumerate(reqs):
            if req.sampling_params.max_new_tokens == 0:
                req.finish(FinishReason.LENGTH)
            else:
                token = out.next_token_ids[i]
                req.output_ids.append(token)
                req.logprobs.append(out.next_token_logprobs[i])
                req.top_logprobs.append(out.top_logprobs[i])
                req.check_finished(token, self.context_len, self._tail_text)
            if req.finished is not None:
                if req in self.running:
                    self.running.remove(req)
                self._finish(req)
            else:
                if req not in self.running:
                    self.running.append(req)
                    self._cache_unfinished(req)
                if req.stream or len(req.output_ids) == 1:  # the first token always: TTFT
                    self._outputs.append(req.make_output())

    def _tail_text(self, req: Req) -> str:
        longest = max(len(s) for s in req.sampling_params.stop)
        tail = req.output_ids[-(longest + STOP_STRING_TAIL_TOKENS):]
        return self.tokenizer.decode(tail, skip_special_tokens=req.sampling_params.skip_special_tokens)

    def _cache_unfinished(self, req: Req) -> None:
        """Insert the request's whole computed pages into the tree (without counting a hit) so
        others can share them, and point its request row at the tree's slots."""
        self.tree_cache.cache_unfinished_req(req, chunked=True)
        self.runner.req_to_token_pool.write((req.req_pool_idx, slice(0, req.kv_len)), req.kv_indices)
        if self.mamba is not None:
            self.mamba.checkpoint(req)  # the state after those pages, when they are all the request computed

    def _finish(self, req: Req) -> None:
        """Give the request's KV to the tree, free its row, report it."""
        if self.disagg is not None and self.disagg.intercept_finish(req):
            return  # prefill: its KV is being sent; finished again once the transfer ended
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
            if self.mamba is not None:
                self.mamba.on_finished(req)
            self.runner.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        self.stats.on_finished(req)
        self._outputs.append(req.make_output())

    # ---- idle and integrity --------------------------------------------------------------------
    def has_work(self) -> bool:
        pd = self.disagg is not None and self.disagg.has_work()
        return bool(self.waiting or self.running or self.chunked_req is not None or pd)

    def transfers_in_flight(self) -> bool:
        """Host transfers, L3 prefetches or L3 backups not yet acknowledged."""
        if not self.hicache:
            return False
        tree = self.tree_cache
        if tree.ongoing_write_through or tree.ongoing_load_back:
            return True
        storage = storage_controller_of(tree)
        return storage is not None and bool(tree.ongoing_prefetch or storage.backup_queue or storage.query_queue
                                            or storage.holding)

    def is_idle(self) -> bool:
        return not self.has_work() and not self.transfers_in_flight()

    def check_integrity(self) -> None:
        """Every device slot is free, in the tree, or in a page a request holds; with HiCache the
        same for host slots. Raises CacheIntegrityError with the numbers."""
        held = [r for r in self.running] + ([self.chunked_req] if self.chunked_req is not None else [])
        if self.disagg is not None:
            held += self.disagg.held_reqs()
        pages = [r.held_pages(self.page_size) for r in held]
        if self.tree_cache.disable:
            used = sum(int(p.numel()) for p in pages)
            alloc = self.runner.token_to_kv_pool_allocator
            if alloc.available_size() + used != self.runner.max_total_num_tokens:
                raise CacheIntegrityError(
                    f"device pool: free {alloc.available_size()} + held by requests {used} != "
                    f"capacity {self.runner.max_total_num_tokens}")
        else:
            self.tree_cache.check_integrity(pages, **(self.mamba.tree_integrity_kwargs(held) if self.mamba else {}))
        if self.mamba is not None:
            self.mamba.check_integrity(held)

    def on_idle(self) -> None:
        """Once per idle period: the integrity check plus the request-row leak check."""
        if self._idle_checked or not self.is_idle():
            return
        self._idle_checked = True
        self.check_integrity()
        pool = self.runner.req_to_token_pool
        if pool.available_size() != pool.size:
            raise CacheIntegrityError(f"request table: {pool.size - pool.available_size()} rows leaked")
        retries = self.tree_cache.storage_prefetch_retries.tracked() if self.hicache else 0
        if retries:
            raise CacheIntegrityError(f"L3 check retries: {retries} records of requests no longer waiting")
        self.stats.counters.num_idle_checks += 1
        logger.debug("idle integrity check passed")

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        if self.disagg is not None:
            self.disagg.close()
        controller = getattr(self.tree_cache, "cache_controller", None)
        if controller is not None:
            controller.close()
        self.runner.shutdown()
