"""Rank processes for the multi-process PD transfer tests (imported by spawned children).

Every rank owns real device pools (device="cpu"), a real KV manager of ``cfg["backend"]`` (default
nixl: own NIXL agent, UCX; mooncake: own Mooncake transfer engine, TCP)
and reports to the parent through a multiprocessing queue. Pool contents are a pure function of
(component, layer, token position, GLOBAL head, element), so a decode rank can check the bytes
of the heads it owns without knowing how prefill was split. Prefill ranks that must not write
something (MLA ranks other than the first, aux on non-primary ranks) hold deliberately different
values, so a stray write shows up as a mismatch.
"""

from __future__ import annotations

import logging
import time
import traceback

import torch

MOD = 1 << 23  # values stay exact in float32


def owned_heads_reference(total_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """Heads of a rank under contiguous replication, written independently of rank_mapping."""
    if tp_size <= total_heads:
        return [h for h in range(total_heads) if h * tp_size // total_heads == tp_rank]
    return [tp_rank * total_heads // tp_size]


def kv_values(comp: int, layer: int, positions: torch.Tensor, heads: list[int], width: int, salt: int = 0):
    """(tokens, heads, width) float32 values for token positions and global heads."""
    pos = positions.view(-1, 1, 1).to(torch.int64)
    head = torch.tensor(heads, dtype=torch.int64).view(1, -1, 1)
    d = torch.arange(width, dtype=torch.int64).view(1, 1, -1)
    v = ((comp * 131 + layer * 17 + 1 + salt * 7919) * 100003 + pos * 1013 + head * 97 + d) % MOD
    return v.to(torch.float32)


def state_values(comp: int, layer: int, rows: range, rest: tuple[int, ...], salt: int = 0):
    r = torch.arange(rows.start, rows.stop, dtype=torch.int64).view(-1, *([1] * len(rest)))
    tail = torch.arange(int(torch.tensor(rest).prod()), dtype=torch.int64).view(1, *rest)
    return (((comp * 31 + layer * 7 + 3 + salt) * 10007 + r * 101 + tail) % MOD).to(torch.float32)


def build_rank(cfg: dict, role: str, tp_size: int, tp_rank: int):
    """Pools, aux tensor and KVArgs of one rank."""
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool

    P, H, L = cfg["page_size"], cfg["heads"], cfg["layers"]
    if cfg["mla"]:
        kv = MLATokenToKVPool(cfg["pool_tokens"], P, torch.float32, cfg["head_dim"] - 2, 2, L)
    else:
        kv = MHATokenToKVPool(cfg["pool_tokens"], P, torch.float32, max(1, H // tp_size), cfg["head_dim"], L)
    state = None
    if cfg["state_rows"]:
        rows = cfg["state_rows"] // tp_size
        state = MambaPool(4, [(rows, 3)], (rows, 2, 2), L, conv_dtype=torch.float32, ssm_dtype=torch.float32)
    aux = torch.zeros(8, 4, dtype=torch.int32)
    args = KVArgs.from_pools(kv, engine_rank=tp_rank + (100 if role == "decode" else 0), tp_rank=tp_rank,
                             tp_size=tp_size, total_kv_head_num=0 if cfg["mla"] else H, aux_buffers=[aux],
                             state_pool=state)
    return kv, state, aux, args


def _positions(pages: list[int], P: int):
    return torch.arange(len(pages) * P), torch.tensor([p * P + t for p in pages for t in range(P)])


def fill_prefill(cfg: dict, kv, state, aux, tp_size: int, tp_rank: int) -> None:
    P = cfg["page_size"]
    pos, slots = _positions(cfg["src_pages"], P)
    salt = 1 if cfg["mla"] and tp_rank > 0 else 0
    heads = [0] if cfg["mla"] else owned_heads_reference(cfg["heads"], tp_size, tp_rank)
    for c, comp in enumerate(kv.components):
        for layer in range(kv.layer_num):
            kv.buffers[comp.name][layer, slots] = kv_values(c, layer, pos, heads, comp.item_shape[-1], salt)
    if state is not None:
        rows = cfg["state_rows"] // tp_size
        for c, comp in enumerate(state.components):
            for layer in range(state.layer_num):
                global_rows = range(tp_rank * rows, (tp_rank + 1) * rows)
                values = state_values(c, layer, global_rows, comp.item_shape[1:])
                state.buffers[comp.name][layer, cfg["state_src"]] = values
    aux[cfg["aux_src"]] = torch.arange(4, dtype=torch.int32) + 1000 * (tp_rank + 1)


def check_decode(cfg: dict, kv, state, aux, tp_size: int, tp_rank: int, prefill_tp: int) -> list[str]:
    """Mismatches between this decode rank's pools and what it owns; [] when exact."""
    P, errors = cfg["page_size"], []
    pos, slots = _positions(cfg["dst_pages"], P)
    heads = [0] if cfg["mla"] else owned_heads_reference(cfg["heads"], tp_size, tp_rank)
    untouched = torch.ones(kv.total_slots, dtype=torch.bool)
    untouched[slots] = False
    for c, comp in enumerate(kv.components):
        for layer in range(kv.layer_num):
            buf = kv.buffers[comp.name][layer]
            want = kv_values(c, layer, pos, heads, comp.item_shape[-1])
            if not torch.equal(buf[slots], want):
                bad = (buf[slots] != want).nonzero()[0].tolist()
                errors.append(f"{comp.name} layer {layer}: first mismatch at (token, head, elem) {bad}")
            if not bool((buf[untouched] == -7).all()):
                errors.append(f"{comp.name} layer {layer}: a slot outside the destination pages was written")
    if state is not None:
        rows = cfg["state_rows"] // tp_size
        for c, comp in enumerate(state.components):
            for layer in range(state.layer_num):
                want = state_values(c, layer, range(tp_rank * rows, (tp_rank + 1) * rows), comp.item_shape[1:])
                if not torch.equal(state.buffers[comp.name][layer, cfg["state_dst"]], want):
                    errors.append(f"state {comp.name} layer {layer} differs")
    primary = tp_rank * prefill_tp // tp_size  # first target prefill rank sends aux
    want_aux = torch.arange(4, dtype=torch.int32) + 1000 * (primary + 1)
    if not torch.equal(aux[cfg["aux_dst"]], want_aux):
        errors.append(f"aux row {aux[cfg['aux_dst']].tolist()} != {want_aux.tolist()} (primary prefill {primary})")
    return errors


def _allocator_holding(pages: list[int], cfg: dict):
    """A PagedAllocator whose only allocated pages are ``pages`` (scattered on purpose)."""
    from sglang.srt.mem_cache.allocator import PagedAllocator

    P, num_pages = cfg["page_size"], cfg["pool_tokens"] // cfg["page_size"]
    alloc = PagedAllocator(num_pages, P, reserved_pages=1)
    alloc.alloc_pages(num_pages)
    rest = [p for p in range(1, num_pages + 1) if p not in pages]
    alloc.free(torch.tensor([p * P + t for p in rest for t in range(P)], dtype=torch.int64))
    return alloc


def _free(alloc, pages: list[int], P: int) -> None:
    alloc.free(torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64))


def _config(cfg: dict, addr: str | None):
    from sglang.srt.disaggregation.base import TransferConfig

    return TransferConfig(bootstrap_addr=addr, heartbeat_interval_s=0.25, heartbeat_timeout_s=cfg["hb_timeout"],
                          bootstrap_timeout_s=30.0, transfer_timeout_s=cfg["transfer_timeout"])


class Parent:
    """This rank's private pipe to the test: reports out, commands ("go", "stop") in.

    A private pipe per process, not a shared queue or event: a process SIGKILLed while holding
    a shared lock would wedge every other process.
    """

    def __init__(self, conn):
        self.conn, self.commands = conn, set()

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def got(self, command: str) -> bool:
        while self.conn.poll():
            self.commands.add(self.conn.recv())
        return command in self.commands

    def wait(self, command: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.got(command) and time.monotonic() < deadline:
            self.conn.poll(0.1)


def _wait(obj, states, deadline: float):
    while time.monotonic() < deadline:
        s = obj.poll()
        if s in states:
            return s
        time.sleep(0.005)
    return obj.poll()


def prefill_main(cfg: dict, tp_size: int, tp_rank: int, conn) -> None:
    from sglang.srt.disaggregation.base import DisaggregationMode, KVPoll
    from sglang.srt.disaggregation.utils import get_kv_class

    backend = cfg.get("backend", "nixl")
    NixlKVBootstrapServer, NixlKVManager, NixlKVSender = (get_kv_class(backend, k) for k in
                                                          ("bootstrap_server", "manager", "sender"))

    logging.basicConfig(level=logging.WARNING)
    q = Parent(conn)
    try:
        kv, state, aux, args = build_rank(cfg, "prefill", tp_size, tp_rank)
        fill_prefill(cfg, kv, state, aux, tp_size, tp_rank)
        alloc = _allocator_holding(cfg["src_pages"], cfg)
        server = NixlKVBootstrapServer(port=cfg["bootstrap_port"]) if tp_rank == 0 else None
        mgr = NixlKVManager(args, DisaggregationMode.PREFILL, _config(cfg, f"127.0.0.1:{cfg['bootstrap_port']}"))
        sender = NixlKVSender(mgr, f"127.0.0.1:{cfg['bootstrap_port']}", cfg["room"])
        sender.init(len(cfg["src_pages"]), aux_index=cfg["aux_src"])
        deadline = time.monotonic() + 60
        s = _wait(sender, (KVPoll.WaitingForInput, KVPoll.Failed), deadline)
        sent, t_fail = 0, None
        for i, n in enumerate(cfg["chunks"]):
            if i == cfg.get("pause_after_chunks"):
                q.send("paused", tp_rank)
                while not q.got("go") and time.monotonic() < deadline:
                    sender.poll()  # keeps the posted chunk moving
                    time.sleep(0.005)
            last = sent + n == len(cfg["src_pages"])
            sender.send(cfg["src_pages"][sent:sent + n], [cfg["state_src"]] if last and state is not None else None)
            sent += n
        s = _wait(sender, (KVPoll.Success, KVPoll.Failed), deadline)
        if s == KVPoll.Failed:
            _free(alloc, cfg["src_pages"], cfg["page_size"])
            t_fail = time.monotonic()
        q.send("prefill", tp_rank, {"state": int(s), "failure": str(sender.failure_exception() or ""),
                                    "available": alloc.available_size(), "active_rooms": mgr.num_active_rooms(),
                                    "t_fail": t_fail})
        q.wait("stop", 60)
        mgr.close()
        if server:
            server.close()
    except Exception:
        q.send("error", f"prefill {tp_rank}", traceback.format_exc())


def decode_main(cfg: dict, tp_size: int, tp_rank: int, prefill_tp: int, conn) -> None:
    from sglang.srt.disaggregation.base import DisaggregationMode, KVPoll
    from sglang.srt.disaggregation.utils import get_kv_class

    backend = cfg.get("backend", "nixl")
    NixlKVManager, NixlKVReceiver = (get_kv_class(backend, k) for k in ("manager", "receiver"))

    logging.basicConfig(level=logging.WARNING)
    q = Parent(conn)
    try:
        kv, state, aux, args = build_rank(cfg, "decode", tp_size, tp_rank)
        for buf in kv.buffers.values():
            buf.fill_(-7)
        alloc = _allocator_holding(cfg["dst_pages"], cfg)
        mgr = NixlKVManager(args, DisaggregationMode.DECODE, _config(cfg, None))
        recv = NixlKVReceiver(mgr, f"127.0.0.1:{cfg['bootstrap_port']}", cfg["room"])
        deadline = time.monotonic() + 60
        s = _wait(recv, (KVPoll.WaitingForInput, KVPoll.Failed), deadline)
        if s == KVPoll.WaitingForInput:
            recv.init(cfg["dst_pages"], aux_index=cfg["aux_dst"], state_indices=[cfg["state_dst"]] if state else None)
        reported = False
        while time.monotonic() < deadline:
            s = recv.poll()
            room = mgr.decode_rooms.get(cfg["room"])
            if not reported and room is not None and room.status is not None and room.status.num_received:
                q.send("progress", tp_rank)
                reported = True
            if s in (KVPoll.Success, KVPoll.Failed):
                break
            time.sleep(0.005)
        result = {"state": int(s), "failure": str(recv.failure_exception() or ""), "t_end": time.monotonic()}
        if s == KVPoll.Success:
            result["errors"] = check_decode(cfg, kv, state, aux, tp_size, tp_rank, prefill_tp)
        elif s == KVPoll.Failed:
            _free(alloc, cfg["dst_pages"], cfg["page_size"])
        result.update(available=alloc.available_size(), active_rooms=mgr.num_active_rooms())
        q.send("decode", tp_rank, result)
        q.wait("stop", 60)
        mgr.close()
    except Exception:
        q.send("error", f"decode {tp_rank}", traceback.format_exc())
