"""Prefill server side of PD serving: bootstrap queue -> normal prefill -> KV send -> release.

A request (carrying the router's ``bootstrap_room``) gets a KV sender of the transfer backend
(``NixlKVSender`` / ``MooncakeKVSender``) and waits in the bootstrap queue until its decode peer
has handed over its destination pages (every TP rank agrees, see ``agreed_polls``). It then joins
the scheduler's waiting queue and is prefilled like any request, prefix reuse included (device
tree, HiCache host and L3 hits), with at most one output token: the first token, which decode
needs. When the scheduler finishes it, the request's first token goes into its aux row, its prompt
pages are sent (with its state slot, for a state model: ``common/pool_plan.py``), and it stays in the inflight queue holding those pages (its own pages and its
locked prefix) until the transfer ended; then the scheduler finishes it for real (its KV goes to
the tree) and the prefill response is sent. A failed transfer finishes it aborted, with the
reason, and no tokens.

Rank 0 hosts the bootstrap server on ``--disaggregation-bootstrap-port``.
"""

from __future__ import annotations

import dataclasses
import logging

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.scheduler_side import DisaggBase
from sglang.srt.disaggregation.utils import advertised_host, agreed_polls, get_kv_class, page_ids_of, pd_secret
from sglang.srt.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger(__name__)


class PrefillDisagg(DisaggBase):
    mode = "prefill"

    def __init__(self, scheduler):
        args = scheduler.args
        port = args.disaggregation_bootstrap_port
        self.bootstrap_server = None
        if scheduler.runner.tp_rank == 0:
            server_cls = get_kv_class(args.disaggregation_transfer_backend, "bootstrap_server")
            try:
                self.bootstrap_server = server_cls(host=args.host, port=port, secret=pd_secret())
            except OSError as exc:
                raise ValueError(f"--disaggregation-bootstrap-port {port}: cannot listen on {args.host}:{port} "
                                 f"({exc.strerror or exc})") from None
        self.bootstrap_addr = f"{advertised_host(args.host)}:{port}"
        try:
            super().__init__(scheduler, self.bootstrap_addr)
        except BaseException:
            if self.bootstrap_server is not None:
                self.bootstrap_server.close()
            raise
        self.bootstrap: list[tuple[Req, object]] = []  # waiting for the decode peer
        self.senders: dict[str, object] = {}  # rid -> sender, for requests in the scheduler's queues
        self.inflight: list[tuple[Req, object]] = []  # KV posted, pages held until the transfer ends
        self.rooms: dict[str, int] = {}  # rid -> bootstrap room, for every request held here

    # ---- scheduler interface -------------------------------------------------------------------
    def add_request(self, req: Req, msg) -> bool:
        sender_cls = get_kv_class(self.backend, "sender")
        room = msg.bootstrap_room
        if room is None:
            return self._refuse(req, "a prefill server needs bootstrap_room (send requests through the PD router)")
        if room in self.rooms.values():
            return self._refuse(req, f"bootstrap_room {room} is already in use by another request")
        # Prefill computes the prompt and the first token only; decode produces the rest.
        params = req.sampling_params
        req.sampling_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 1))
        self.rooms[req.rid] = room
        self.bootstrap.append((req, sender_cls(self.mgr, self.bootstrap_addr, room)))
        return True

    def step(self) -> None:
        if self.bootstrap:
            self._poll_bootstrap()
        if self.inflight:
            self._poll_inflight()

    def intercept_finish(self, req: Req) -> bool:
        sender = self.senders.pop(req.rid, None)
        if sender is None:
            return False
        if req.finished is not None and req.finished.reason is FinishReason.ABORT:
            sender.abort()  # refused or aborted: decode hears it and frees its pages
            self.rooms.pop(req.rid, None)
            return False
        row = req.req_pool_idx
        token = req.output_ids[0] if req.output_ids else None
        logprob = req.logprobs[0] if req.logprobs else 0.0
        top = req.top_logprobs[0] if req.top_logprobs else []
        self.aux.write(row, token, logprob, top)
        pages = page_ids_of(req.kv_indices[: len(req.origin_input_ids)], self.page_size)
        sender.init(int(pages.numel()), aux_index=row)
        # a state model's request slot holds the state after the whole prompt: it goes with the last chunk
        sender.send(pages, req.mamba_pool_idx if self.kv_args.state_data_ptrs else None)
        self.inflight.append((req, sender))
        return True

    def abort(self, rid: str) -> bool:
        for queue in (self.bootstrap, self.inflight):
            for i, (req, sender) in enumerate(queue):
                if req.rid == rid:
                    del queue[i]
                    sender.abort()
                    self.rooms.pop(rid, None)
                    req.finished = None
                    req.finish(FinishReason.ABORT, message="aborted")
                    self.sched._finish(req)
                    return True
        return False

    def queued_reqs(self) -> list[Req]:
        return [r for r, _ in self.bootstrap]

    def held_reqs(self) -> list[Req]:
        return [r for r, _ in self.inflight]

    def info(self) -> dict:
        return {**super().info(), "bootstrap_addr": self.bootstrap_addr, "pd_bootstrap_queue": len(self.bootstrap),
                "pd_inflight_queue": len(self.inflight)}

    def close(self) -> None:
        super().close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()

    # ---- queues --------------------------------------------------------------------------------
    def _refuse(self, req: Req, message: str) -> bool:
        req.finish(FinishReason.ABORT, message=message)
        self.sched._finish(req)
        return True

    def _poll_bootstrap(self) -> None:
        states = agreed_polls([s.poll() for _, s in self.bootstrap])
        keep = []
        for (req, sender), state in zip(self.bootstrap, states, strict=True):
            if state is KVPoll.Failed:
                self._drop(req, sender)
            elif state is KVPoll.Bootstrapping:
                keep.append((req, sender))
            else:  # the decode peer's destination arrived on every rank
                self.senders[req.rid] = sender
                self.sched.enqueue(req)
        self.bootstrap = keep

    def _poll_inflight(self) -> None:
        states = agreed_polls([s.poll() for _, s in self.inflight])
        keep = []
        for (req, sender), state in zip(self.inflight, states, strict=True):
            if state is KVPoll.Success:
                self.num_transferred += 1
                self.rooms.pop(req.rid, None)
                self.sched._finish(req)  # KV into the tree, pages and row released, response sent
            elif state is KVPoll.Failed:
                self._drop(req, sender)
            else:
                keep.append((req, sender))
        self.inflight = keep

    def _drop(self, req: Req, sender) -> None:
        exc = sender.failure_exception()
        sender.abort()  # no-op where it already failed; releases it where another rank failed
        self.rooms.pop(req.rid, None)
        self.fail(req, str(exc) if exc else "failed on another TP rank of this server")
        self.sched._finish(req)
