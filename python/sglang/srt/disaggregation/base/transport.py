"""The byte-moving seam under the PD manager: one interface, one implementation per transfer
backend (``nixl/transport.py``, ``mooncake/transport.py``).

The manager (``PDKVManager``, ``common/manager.py``) decides WHAT moves where: descriptors,
rooms, staging, head slicing, timeouts, peers. A transport only moves bytes and tags:

* ``register_memory`` once, over every buffer a peer may write or this rank may read;
* ``local_metadata`` is what a decode rank sends in its REGISTER (opaque bytes), and
  ``add_peer`` is how prefill accepts it (ValueError on metadata it cannot use);
* ``post_write(peer, descs, tag)`` starts one WRITE of ``descs`` (paired local/remote byte
  ranges) whose completion the peer learns from ``tag`` (a ``Notif`` encoding), delivered only
  after every byte of the WRITE landed; ``check`` says "DONE", "PROC" or "ERR"; ``release``
  ends a handle (cancelling, or abandoning, a WRITE still running: its tag is never delivered);
* ``send_notif`` delivers a bare tag (a chunk without bytes);
* ``drain_notifs`` returns the tags that arrived since the last call, per sender name.

Every call may raise; the manager maps failures onto failed rooms. Calls happen under the
manager's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from sglang.srt.disaggregation.common.descriptors import Descs

XferState = str  # "DONE", "PROC" or "ERR"


class KVTransport(ABC):
    """One rank's transfer engine. ``name`` is the rank's agent name (peers address it so)."""

    backend: str = ""  # "nixl" / "mooncake", for messages

    @abstractmethod
    def register_memory(self, regions: list[tuple[int, int]]) -> None:
        """Register ``(address, bytes)`` host regions; raise on failure."""

    @abstractmethod
    def local_metadata(self) -> bytes:
        """What a peer needs to write into this rank (sent in REGISTER)."""

    @abstractmethod
    def add_peer(self, name: str, metadata: bytes) -> None:
        """Accept a peer's ``local_metadata``; ValueError when it is unusable."""

    @abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer (never raises)."""

    @abstractmethod
    def post_write(self, peer: str, descs: Descs, tag: bytes) -> object:
        """Start WRITE ``descs`` to ``peer``; the handle to ``check`` / ``release``. Raises
        KVTransferError (after releasing whatever it started) when the WRITE cannot start."""

    @abstractmethod
    def send_notif(self, peer: str, tag: bytes) -> None:
        """Deliver ``tag`` to ``peer`` with no bytes; raises when it cannot be sent."""

    @abstractmethod
    def check(self, handle) -> XferState:
        """"DONE", "PROC" or "ERR"; may raise (the caller reads that as ERR)."""

    @abstractmethod
    def release(self, handle) -> None:
        """End ``handle``; a WRITE still running is cancelled or abandoned. May raise."""

    @abstractmethod
    def drain_notifs(self) -> dict[str, list[bytes]]:
        """Tags delivered to this rank since the last call, per sender; also progresses the
        engine where it needs polling."""

    @abstractmethod
    def close(self) -> None:
        """Deregister memory and drop the engine; never raises."""
