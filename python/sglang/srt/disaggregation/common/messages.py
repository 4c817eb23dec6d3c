"""Wire formats: control messages (ZMQ multipart) and transfer notification tags.

A control message is ``[MAGIC, kind, JSON header, *binary blobs]``; each kind has one schema
below and ``decode_message`` checks it, so a malformed message raises ``MalformedMessage`` at the
edge and never reaches the room bookkeeping. Page ids and state slots travel as int64 blobs.

With a shared secret (``PeerAuth``) every message carries one more frame, the HMAC of the
others; ``decode_message`` drops a message whose MAC is missing or wrong before reading it.

A notification tag names the room, what arrived, and the SENDER'S ENGINE RANK (not its pp rank,
so several prefill TP ranks with PP=1 never collide):
``b"{room}|{kind}|{engine_rank}|{chunk}|{is_last}|{first_page}|{num_pages}"``. A KV chunk names the
pages of the request it carries, ``[first_page, first_page + num_pages)`` (request positions, not
pool ids), so decode can scatter a staged chunk as soon as it lands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

import numpy as np

MAGIC = b"sglang-pd-1"


class MalformedMessage(ValueError):
    """A control message or notification that does not match its schema."""


class MsgKind(str, Enum):
    REGISTER = "register"  # decode -> prefill, once per prefill rank: agent metadata and buffers
    CLAIM = "claim"  # decode -> prefill, once per (room, target) as the request arrives: "this room is mine"
    REQUEST = "request"  # decode -> prefill, once per (room, target): destination pages and duties
    REJECT = "reject"  # prefill -> decode: registration (room -1) or request refused
    ABORT = "abort"  # either way: the room failed or was aborted on the sender's side
    HEARTBEAT = "heartbeat"  # either way, every heartbeat interval
    NOTIF = "notif"  # prefill -> decode: a notification tag, for transports without their own (Mooncake)


_COMMON = {"agent_name": str}
_SCHEMA: dict[MsgKind, tuple[dict[str, type], int]] = {
    MsgKind.REGISTER: (
        {"ip": str, "port": int, "engine_rank": int, "tp_rank": int, "peer": dict, "kv_ptrs": list,
         "kv_lens": list, "aux_ptrs": list, "aux_lens": list, "state_ptrs": list, "state_lens": list,
         "staging_ptr": int, "staging_len": int},
        1,  # transport metadata (NIXL agent metadata, Mooncake session)
    ),
    MsgKind.REQUEST: (
        {"room": int, "engine_rank": int, "tp_rank": int, "required_dst_info_num": int, "send_kv": bool,
         "send_state": bool, "send_aux": bool, "aux_index": int, "staging_offset": int},  # -1: no staging
        2,  # destination page ids, destination state slots (int64)
    ),
    MsgKind.CLAIM: ({"room": int, "engine_rank": int, "tp_rank": int}, 0),
    MsgKind.REJECT: ({"room": int, "reason": str}, 0),
    MsgKind.ABORT: ({"room": int, "reason": str}, 0),
    MsgKind.HEARTBEAT: ({"ip": str, "port": int}, 0),
    MsgKind.NOTIF: ({"tag": str}, 0),
}
_INT_LISTS = ("kv_ptrs", "kv_lens", "aux_ptrs", "aux_lens", "state_ptrs", "state_lens")


@dataclass(frozen=True)
class Message:
    kind: MsgKind
    header: dict
    blobs: tuple[bytes, ...]

    def int64_blob(self, i: int) -> np.ndarray:
        return np.frombuffer(self.blobs[i], dtype=np.int64)


def encode_message(kind: MsgKind, header: dict, blobs=(), auth=None) -> list[bytes]:
    """Frames for ``kind``; arrays in ``blobs`` are sent as int64 bytes. With an enabled
    ``auth`` (``PeerAuth``) the HMAC of the frames follows as the last frame."""
    out = [b if isinstance(b, bytes) else np.ascontiguousarray(b, dtype=np.int64).tobytes() for b in blobs]
    frames = [MAGIC, kind.value.encode(), json.dumps(header).encode(), *out]
    if auth is not None and auth.enabled:
        frames.append(auth.sign(*frames).encode())
    return frames


def _check_type(name: str, value, typ: type) -> None:
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if not ok:
        raise MalformedMessage(f"field {name!r} must be {typ.__name__}, got {value!r}")


class UnauthenticatedMessage(MalformedMessage):
    """A control message whose MAC the shared secret does not verify."""


def decode_message(frames: list[bytes], auth=None) -> Message:
    """Parse and validate frames; raise MalformedMessage naming what is wrong
    (UnauthenticatedMessage, before anything is parsed, when ``auth`` is enabled and the last
    frame is not the HMAC of the others)."""
    if auth is not None and auth.enabled:
        frames = list(frames)
        mac = frames.pop() if len(frames) > 3 else b""
        if not auth.verify(mac.decode("ascii", "replace"), *frames):
            raise UnauthenticatedMessage(f"control message of {len(frames)} frames is not authenticated by the "
                                         "shared secret")
    if len(frames) < 3 or frames[0] != MAGIC:
        raise MalformedMessage(f"not a PD control message ({len(frames)} frames, magic {frames[0][:16]!r})"
                               if frames else "empty message")
    try:
        kind = MsgKind(frames[1].decode())
    except (UnicodeDecodeError, ValueError):
        known = [k.value for k in MsgKind]
        raise MalformedMessage(f"unknown message kind {frames[1][:32]!r}; known: {known}") from None
    try:
        header = json.loads(frames[2])
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedMessage(f"{kind.value}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedMessage(f"{kind.value}: header must be an object, got {type(header).__name__}")
    schema, num_blobs = _SCHEMA[kind]
    for name, typ in {**_COMMON, **schema}.items():
        if name not in header:
            raise MalformedMessage(f"{kind.value}: missing field {name!r}")
        _check_type(name, header[name], typ)
    for name in _INT_LISTS:
        if name in schema and not all(type(v) is int and v >= 0 for v in header[name]):
            raise MalformedMessage(f"{kind.value}: {name!r} must hold non-negative ints")
    blobs = tuple(frames[3:])
    if len(blobs) != num_blobs:
        raise MalformedMessage(f"{kind.value}: expected {num_blobs} binary frames, got {len(blobs)}")
    if kind is MsgKind.REQUEST and any(len(b) % 8 for b in blobs):
        raise MalformedMessage(f"request: index blobs must be int64 arrays, got lengths {[len(b) for b in blobs]}")
    return Message(kind, header, blobs)


class NotifKind(str, Enum):
    KV = "kv"
    STATE = "state"
    AUX = "aux"


@dataclass(frozen=True)
class Notif:
    room: int
    kind: NotifKind
    engine_rank: int
    chunk_id: int = 0
    is_last: bool = False
    first_page: int = 0  # KV: request positions [first_page, first_page + num_pages) this chunk carries
    num_pages: int = 0

    def encode(self) -> bytes:
        return (f"{self.room}|{self.kind.value}|{self.engine_rank}|{self.chunk_id}|{int(self.is_last)}|"
                f"{self.first_page}|{self.num_pages}").encode()

    @classmethod
    def parse(cls, raw: bytes) -> "Notif":
        """Raise MalformedMessage unless ``raw`` is a tag from ``encode`` (the page range may be
        left out: 5 fields). ``is_last`` is parsed as the integer 0 or 1 (never ``bool(str)``,
        which is True for "0")."""
        try:
            fields = raw.decode().split("|")
            if len(fields) not in (5, 7):
                raise ValueError(len(fields))
            room, kind, rank, chunk, last = fields[:5]
            first, num = (int(f) for f in fields[5:]) if len(fields) == 7 else (0, 0)
            notif = cls(int(room), NotifKind(kind), int(rank), int(chunk), bool(int(last)), first, num)
            if last not in ("0", "1") or min(notif.engine_rank, notif.chunk_id, first, num) < 0:
                raise ValueError(last)
        except (UnicodeDecodeError, ValueError):
            raise MalformedMessage(f"bad notification tag {raw[:64]!r}") from None
        return notif
