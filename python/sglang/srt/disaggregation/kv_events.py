"""KV cache events for KV-aware routers: the records and the opt-in publisher (upstream's module).

The trees record ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (defined beside them in
``mem_cache/radix/events.py``, since the cache layer may not import this package; import them
from here, as upstream's callers do). ``--kv-events-config`` (a JSON object, ``KVEventsConfig``)
turns recording on and picks the publisher the scheduler hands each step's events to:

* ``"null"``: events are recorded and dropped (the default when a config is given without one);
* ``"zmq"``: a PUB socket at ``endpoint`` sends ``(topic, seq, payload)`` frames, ``seq`` an
  8-byte big-endian counter and ``payload`` the batch as MessagePack in upstream's layout
  (``[ts, [event, ...], attn_dp_rank]``, each event a map with its class name under ``"type"``
  and its fields, unset optional ones left out). With ``replay_endpoint`` a ROUTER socket
  answers a request naming a start ``seq`` with the buffered batches from there, then an
  end marker (seq -1). Needs pyzmq (the ``serve`` extra); without it the config is refused
  at startup, naming what is allowed.

Without ``--kv-events-config`` nothing is recorded: the trees hold no recorder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import struct
import threading
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Any

from sglang.srt.mem_cache.radix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
    StorageMedium,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "EventPublisher", "EventPublisherFactory",
    "KVCacheEvent", "KVEventBatch", "KVEventsConfig", "NullEventPublisher", "StorageMedium", "ZmqEventPublisher",
    "encode_event_batch",
]

PUBLISHERS = ("null", "zmq")
FORMATS = ("default",)


@dataclass
class KVEventsConfig:
    """``--kv-events-config``, validated: ``publisher`` (one of ``PUBLISHERS``), the PUB
    ``endpoint`` (``tcp://*:port`` binds; a concrete host connects unless ``bind``), optional
    ``replay_endpoint`` and the ``buffer_steps`` batches kept for it, the socket ``hwm``, the
    ``max_queue_size`` batches waiting for the sender thread, the ``topic`` of every frame, and
    the event ``format`` (upstream's ``"default"``; its ``"dynamo"`` hashing is not supported)."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: str = "default"

    def __post_init__(self):
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"--kv-events-config publisher {self.publisher!r} is not allowed; choose one of: "
                             f"{', '.join(PUBLISHERS)}")
        if self.format not in FORMATS:
            raise ValueError(f"--kv-events-config format {self.format!r} is not allowed; choose one of: "
                             f"{', '.join(FORMATS)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--kv-events-config {name} {getattr(self, name)!r} is invalid; must be an int >= 1")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config {name} {value!r} is invalid; must start with tcp://, "
                                 "ipc:// or inproc://")
        if self.publisher == "zmq":
            try:
                import zmq  # noqa: F401  (fail at startup, not at the first step)
            except ImportError:
                raise ValueError("--kv-events-config publisher 'zmq' needs pyzmq (pip install 'sglang[serve]'); "
                                 f"without it choose one of: {', '.join(p for p in PUBLISHERS if p != 'zmq')}"
                                 ) from None

    @classmethod
    def from_cli(cls, cli_value: str) -> "KVEventsConfig":
        """Parse ``--kv-events-config`` (a JSON object); ValueError naming what is wrong."""
        try:
            raw = json.loads(cli_value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**raw)


# ---- wire format ------------------------------------------------------------------------------
def _pack(obj: Any, out: bytearray) -> None:
    """Append ``obj`` as MessagePack (None, bool, int64, float, str, bytes, list, dict)."""
    if obj is None:
        out.append(0xC0)
    elif obj is True or obj is False:
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, int):
        if 0 <= obj < 0x80 or -32 <= obj < 0:
            out += struct.pack(">b" if obj < 0 else ">B", obj)
        elif obj >= 0:
            out += struct.pack(">BQ", 0xCF, obj) if obj >= 1 << 32 else struct.pack(">BI", 0xCE, obj)
        else:
            out += struct.pack(">Bq", 0xD3, obj) if obj < -(1 << 31) else struct.pack(">Bi", 0xD2, obj)
    elif isinstance(obj, float):
        out += struct.pack(">Bd", 0xCB, obj)
    elif isinstance(obj, (str, bytes)):
        data = obj.encode("utf-8") if isinstance(obj, str) else obj
        n = len(data)
        if isinstance(obj, str) and n < 32:
            out.append(0xA0 | n)
        else:
            out += struct.pack(">BI", 0xDB if isinstance(obj, str) else 0xC6, n)
        out += data
    elif isinstance(obj, (list, tuple)):
        out += bytes([0x90 | len(obj)]) if len(obj) < 16 else struct.pack(">BI", 0xDD, len(obj))
        for item in obj:
            _pack(item, out)
    elif isinstance(obj, dict):
        out += bytes([0x80 | len(obj)]) if len(obj) < 16 else struct.pack(">BI", 0xDF, len(obj))
        for k, v in obj.items():
            _pack(k, out)
            _pack(v, out)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} as MessagePack")


def _event_fields(event: KVCacheEvent) -> dict:
    """An event as upstream's tagged map: ``type`` then its fields, optional ones left out when
    at their default (None)."""
    out = {"type": type(event).__name__}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = value
    return out


def encode_event_batch(batch: EventBatch) -> bytes:
    """``batch`` as the MessagePack payload upstream's consumers decode."""
    out = bytearray()
    _pack([batch.ts, [_event_fields(e) for e in batch.events], batch.attn_dp_rank], out)
    return bytes(out)


# ---- publishers -------------------------------------------------------------------------------
class EventPublisher(ABC):
    """Where the scheduler sends each step's events; one per KV cache (TP rank 0)."""

    @abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Send ``events`` after every batch published before (in order)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop; later ``publish`` calls raise RuntimeError."""


class NullEventPublisher(EventPublisher):
    """Drops every batch."""

    def __init__(self, attn_dp_rank: int = 0, **_config):
        self._open = True

    def publish(self, events: EventBatch) -> None:
        if not self._open:
            raise RuntimeError("publisher is shut down")

    def shutdown(self) -> None:
        self._open = False


class ZmqEventPublisher(EventPublisher):
    """PUB socket (plus an optional replay ROUTER) served by one sender thread, so ``publish``
    only enqueues. A batch that does not fit the queue (``max_queue_size``) is dropped with a
    warning: the scheduler never blocks on a slow consumer."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, attn_dp_rank: int = 0, endpoint: str = "tcp://*:5557", bind: bool | None = None,
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = ""):
        import zmq

        self._zmq = zmq
        self._dp_rank = attn_dp_rank
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        endpoint = offset_endpoint_port(endpoint, attn_dp_rank)
        if bind if bind is not None else _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(offset_endpoint_port(replay_endpoint, attn_dp_rank))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def publish(self, events: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("publisher is shut down")
        if events.attn_dp_rank is None:
            events.attn_dp_rank = self._dp_rank
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            logger.warning("KV events: queue full, dropping a batch of %d events", len(events.events))

    def shutdown(self) -> None:
        """Send what is queued (up to ``SHUTDOWN_TIMEOUT_S``), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                seq = next(self._seq)
                payload = encode_event_batch(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # a send failure must not kill the thread: later batches still go
                logger.exception("KV events: publishing a batch failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """Upstream's default: bind a wildcard, IPC or inproc address; connect to a concrete host."""
    return endpoint.startswith(("ipc://", "inproc://")) or any(h in endpoint for h in ("*", "0.0.0.0", "[::]"))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """``endpoint`` for data-parallel rank ``data_parallel_rank``: tcp ports move up by the
    rank, inproc names get a ``_dp<rank>`` suffix (rank 0: unchanged)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} by a data-parallel rank (tcp:// or inproc:// only)")


class EventPublisherFactory:
    """Builds the publisher a ``--kv-events-config`` names (None or "": a null publisher)."""

    _registry: dict[str, type[EventPublisher]] = {"null": NullEventPublisher, "zmq": ZmqEventPublisher}

    @classmethod
    def create(cls, config: str | None, attn_dp_rank: int = 0) -> EventPublisher:
        if not config:
            return NullEventPublisher()
        parsed = KVEventsConfig.from_cli(config)
        options = dataclasses.asdict(parsed)
        kind, _ = options.pop("publisher"), options.pop("format")
        if kind == "null":
            return NullEventPublisher(attn_dp_rank)
        return cls._registry[kind](attn_dp_rank=attn_dp_rank, **options)
