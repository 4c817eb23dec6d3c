"""TokenizerManager: the HTTP process's side of the engine.

It validates and tokenizes requests, sends them to scheduler rank 0, and turns the scheduler's
outputs into per-request states that HTTP handlers await. A reader thread moves messages from
the output queue onto the event loop.

A request's life: ``tokenize`` (checks, no state), ``send`` (registers the rid, refusing one in
use, and queues the request: synchronous, so two requests with one rid cannot both pass, and
called by the handler before any response starts), ``generate`` (yields its states), then
``release`` (idempotent: aborts it in the scheduler if unfinished and forgets the rid). A handler
that stops waiting before its request finished (client disconnected) thereby aborts it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from sglang.srt.managers.detokenizer import IncrementalDetokenizer
from sglang.srt.managers.generate_request import BadRequestError, GenerateReqInput
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchOutput,
    ControlKind,
    ControlOutput,
    ControlReq,
    SchedulerError,
    TokenizedGenerateReqInput,
    empty_tier_counts,
)
from sglang.srt.metrics.collector import RequestMetrics
from sglang.srt.sampling.sampling_params import TOP_LOGPROBS_MAX
from sglang.srt.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5


class EngineDeadError(RuntimeError):
    """The scheduler stopped; no request can be served any more (HTTP 503)."""


@dataclass
class ReqState:
    rid: str
    req: TokenizedGenerateReqInput
    detok: IncrementalDetokenizer
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish: dict | None = None
    cached_tokens: dict = field(default_factory=empty_tier_counts)
    first_token_time: float | None = None
    last_token_time: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    released: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.req.input_ids)


class TokenizerManager:
    def __init__(self, server_args, engine_info: dict, in_queue, out_queue):
        self.args = server_args
        self.info = engine_info
        self.tokenizer = get_tokenizer(server_args.tokenizer_path or server_args.model_path)
        self.context_len = engine_info["context_len"]
        self.vocab_size = engine_info["vocab_size"]
        self.max_total_tokens = engine_info["max_total_num_tokens"]
        self.in_queue, self.out_queue = in_queue, out_queue
        self.rid_to_state: dict[str, ReqState] = {}
        self.controls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count(1)
        self.metrics = RequestMetrics(server_args.model_name)
        self.error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- output reader --------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        threading.Thread(target=self._read_outputs, name="output-reader", daemon=True).start()

    def _read_outputs(self) -> None:
        while True:
            msgs = self.out_queue.get()
            if msgs is None:
                return
            self._loop.call_soon_threadsafe(self._dispatch, msgs)

    def stop(self) -> None:
        self.out_queue.put(None)

    def _dispatch(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, BatchOutput):
                for out in msg.outputs:
                    self._on_output(out)
            elif isinstance(msg, ControlOutput):
                fut = self.controls.pop(msg.cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, SchedulerError):
                self._on_fatal(f"scheduler rank {msg.tp_rank} failed: {msg.message}")

    def _on_output(self, out) -> None:
        state = self.rid_to_state.get(out.rid)
        if state is None:
            return  # its handler already left
        now = time.perf_counter()
        if out.token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.on_first_token(now - state.created)
            interval = None if state.last_token_time is None else now - state.last_token_time
            self.metrics.on_tokens(len(out.token_ids), interval)
            state.last_token_time = now
        state.output_ids += out.token_ids
        state.logprobs += out.logprobs or []
        state.top_logprobs += out.top_logprobs or []
        state.cached_tokens = out.cached_tokens
        if out.finish is not None:
            state.finish = out.finish
            self.metrics.on_finished(now - state.created, state.prompt_tokens, sum(out.cached_tokens.values()))
        state.event.set()

    def _on_fatal(self, message: str) -> None:
        logger.error("%s", message)
        self.error = message
        for state in self.rid_to_state.values():
            state.event.set()
        for fut in self.controls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self.controls.clear()

    def mark_dead(self, message: str) -> None:
        """Called when a scheduler process exits without reporting (killed)."""
        if self.error is None:
            self._loop.call_soon_threadsafe(self._on_fatal, message)

    # ---- requests ---------------------------------------------------------------------------------
    def tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        """Validate lengths and ids against the model; BadRequestError (HTTP 400) when wrong."""
        ids = list(obj.input_ids) if obj.input_ids is not None else self.tokenizer.encode(obj.text)
        params = obj.parsed_sampling_params()
        if not ids:
            raise BadRequestError("the prompt has no tokens")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise BadRequestError(f"input_ids must be in [0, {self.vocab_size}); got min {min(ids)}, max {max(ids)}")
        n, max_new = len(ids), params.max_new_tokens
        if n >= self.context_len:
            raise BadRequestError(f"the prompt has {n} tokens; the context length is {self.context_len}")
        if n + max_new > self.context_len:
            raise BadRequestError(f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the context length "
                                  f"{self.context_len}; lower max_new_tokens")
        if n + max_new > self.max_total_tokens:
            raise BadRequestError(f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the KV pool "
                                  f"({self.max_total_tokens} tokens)")
        rid = obj.rid or uuid.uuid4().hex
        self._check_rid_free(rid)  # early answer; ``send`` is the atomic check
        return TokenizedGenerateReqInput(rid, ids, params, obj.return_logprob, obj.top_logprobs_num, obj.stream,
                                         priority=obj.priority, **self._bootstrap(obj))

    def _bootstrap(self, obj: GenerateReqInput) -> dict:
        """The PD bootstrap fields for the scheduler: none in null mode (ignored there, as upstream's
        normal server does); required in prefill (room) and decode (host, room; port defaults to
        --disaggregation-bootstrap-port) mode."""
        mode = getattr(self.args, "disaggregation_mode", "null")
        if mode == "null":
            return {}
        port = obj.bootstrap_port if obj.bootstrap_port is not None else self.args.disaggregation_bootstrap_port
        missing = [name for name, value in (("bootstrap_room", obj.bootstrap_room),
                                            ("bootstrap_host", obj.bootstrap_host if mode == "decode" else ""))
                   if value is None]
        if missing:
            raise BadRequestError(f"this server runs --disaggregation-mode {mode}: requests need "
                                  f"{' and '.join(missing)} (send them through sglang-router --pd-disaggregation)")
        if obj.top_logprobs_num > TOP_LOGPROBS_MAX:
            raise BadRequestError(f"top_logprobs_num={obj.top_logprobs_num}: PD serving carries at most "
                                  f"{TOP_LOGPROBS_MAX} top logprobs of the first token from prefill to decode")
        return {"bootstrap_host": obj.bootstrap_host, "bootstrap_port": port, "bootstrap_room": obj.bootstrap_room}

    def _check_rid_free(self, rid: str) -> None:
        if rid in self.rid_to_state:
            raise BadRequestError(f"rid {rid!r} is already in use by a request in flight; rids must be unique")

    def send(self, req: TokenizedGenerateReqInput) -> ReqState:
        """Register ``req`` under its rid and queue it for the scheduler; the caller must
        ``release`` the returned state. BadRequestError when the rid is in use, EngineDeadError
        when the scheduler is gone. Synchronous: nothing else runs between the check and the
        registration."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        self._check_rid_free(req.rid)
        params = req.sampling_params
        state = ReqState(req.rid, req, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop))
        self.rid_to_state[req.rid] = state
        self.metrics.num_requests_received += 1
        self.in_queue.put(req)
        return state

    def release(self, state: ReqState) -> None:
        """Abort ``state``'s request in the scheduler if it has not finished and forget its rid;
        a second call does nothing."""
        if state.released:
            return
        state.released = True
        if state.finish is None and self.error is None:
            self.in_queue.put(AbortReq(state.rid))
        if self.rid_to_state.get(state.rid) is state:
            del self.rid_to_state[state.rid]

    async def generate(self, state: ReqState, request=None):
        """Yield ``state`` (from ``send``) each time it changes, until it finishes; releases it
        when it finishes, when the caller stops iterating or when ``request`` (a starlette
        Request) disconnects."""
        req = state.req
        try:
            while True:
                try:
                    await asyncio.wait_for(state.event.wait(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if request is not None and await request.is_disconnected():
                        logger.info("client of %s disconnected; aborting", req.rid)
                        return
                if self.error is not None:
                    raise EngineDeadError(self.error)
                if not state.event.is_set():
                    continue
                state.event.clear()
                yield state
                if state.finish is not None:
                    return
        finally:
            self.release(state)

    async def control(self, kind: ControlKind, timeout: float = 60.0, payload: dict | None = None) -> ControlOutput:
        if self.error is not None:
            raise EngineDeadError(self.error)
        cid = next(self._cids)
        fut = self._loop.create_future()
        self.controls[cid] = fut
        self.in_queue.put(ControlReq(cid, kind, dict(payload or {})))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.controls.pop(cid, None)
