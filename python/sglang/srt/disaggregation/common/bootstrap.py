"""Bootstrap server hosted by prefill: prefill ranks register, decode ranks look them up.

Routes (JSON bodies, at most ``MAX_BODY_BYTES``; a longer ``Content-Length`` is refused with
413 before anything is read, a missing one with 411):
- ``PUT /route``: a prefill rank registers ``{engine_rank, tp_rank, ip, port, agent_name, peer}``
  where ``peer`` is a ``PeerInfo``. A rank whose peer facts differ from the ranks already
  registered is refused with 400 naming both values; a record for a tp_rank already registered
  is refused with 409 unless it is the same record (a retried PUT): nobody can redirect a rank.
- ``GET /route``: ``{tp_size, peer, ranks}`` once every prefill rank registered, 503 before.
- ``GET /route?tp_rank=R``: rank R's record, 503 until it registered.
- ``GET /route/nonce``: a single-use nonce (60 s) for the next authenticated ``PUT``.
- ``GET /health``: 200.

Authentication (``PeerAuth``; see ``common/trust.py``): with the shared secret a ``PUT`` carries
``X-SGLang-PD-Auth: <nonce> <HMAC("PUT", "/route", nonce, body)>`` with a nonce this server issued
(so a recorded registration cannot be replayed), a ``GET /route`` carries
``<client nonce> <HMAC("GET", path, nonce)>`` and its answer
``HMAC("REPLY", path, nonce, status, body)``, so decode knows the answer came from a peer. A
request that does not verify gets 401. Without a secret, ``PUT`` is accepted from this host only
(loopback, or a connection whose source is the address it reached the server at). ``BootstrapClient``
(``bootstrap_client.py``) speaks this protocol.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import urllib.parse
from collections import OrderedDict
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer, IncompatiblePeerError
from sglang.srt.disaggregation.common.compat import PeerInfo
from sglang.srt.disaggregation.common.trust import PeerAuth, is_loopback

logger = logging.getLogger(__name__)

RANK_FIELDS = {"engine_rank": int, "tp_rank": int, "ip": str, "port": int, "agent_name": str}
MAX_BODY_BYTES = 1 << 20  # a rank record is a few KiB
AUTH_HEADER = "X-SGLang-PD-Auth"
NONCE_TTL_S = 60.0
MAX_NONCES = 1024  # outstanding PUT nonces; the oldest go first
REQUEST_TIMEOUT_S = 10.0  # a client that stops sending loses its connection, not a server thread


class PeerConflict(IncompatiblePeerError):
    """A registration for a tp_rank another agent holds."""


def parse_rank_record(obj) -> tuple[dict, PeerInfo]:
    """Validate a prefill rank record; raise ValueError naming the bad field."""
    if not isinstance(obj, dict):
        raise ValueError(f"rank record must be a JSON object, got {type(obj).__name__}")
    for name, typ in RANK_FIELDS.items():
        if type(obj.get(name)) is not typ:
            raise ValueError(f"rank record field {name!r} must be {typ.__name__}, got {obj.get(name)!r}")
    peer = PeerInfo.from_json(obj.get("peer"))
    if not 0 <= obj["tp_rank"] < peer.tp_size:
        raise ValueError(f"rank record tp_rank {obj['tp_rank']} outside [0, tp_size={peer.tp_size})")
    return obj, peer


class _Refused(Exception):
    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code, self.text = code, text


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, fmt, *args):
        logger.debug("bootstrap %s: " + fmt, self.address_string(), *args)

    def _reply(self, code: int, body, sign_for: str | None = None) -> None:
        """Send ``body``; ``sign_for`` (the client's nonce) adds the answer's MAC."""
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        if sign_for is not None:
            self.send_header(AUTH_HEADER, self.server.owner.auth.sign("REPLY", self.path, sign_for, str(code), data))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> bytes:
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise _Refused(411, "Content-Length required")
        try:
            length = int(raw)
        except ValueError:
            raise _Refused(400, f"bad Content-Length {raw[:32]!r}") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise _Refused(413, f"body of {length} bytes refused; the limit is {MAX_BODY_BYTES}")
        return self.rfile.read(length)

    def _auth_fields(self) -> tuple[str, str]:
        nonce, _, mac = (self.headers.get(AUTH_HEADER) or "").partition(" ")
        return nonce, mac

    def do_PUT(self):
        if urllib.parse.urlsplit(self.path).path != "/route":
            return self._reply(404, f"no route {urllib.parse.urlsplit(self.path).path[:80]}")
        owner = self.server.owner
        try:
            body = self._read_body()
            owner.check_put(self.client_address[0], self.connection.getsockname()[0], *self._auth_fields(), body)
            record, peer = parse_rank_record(json.loads(body or b"null"))
            owner.register(record, peer)
        except _Refused as exc:
            logger.warning("bootstrap refused a PUT from %s: %s", self.client_address[0], exc.text)
            return self._reply(exc.code, exc.text)
        except PeerConflict as exc:
            logger.error("bootstrap refused a prefill registration: %s", exc)
            return self._reply(409, str(exc))
        except (ValueError, IncompatiblePeerError) as exc:
            logger.error("bootstrap refused a prefill registration: %s", exc)
            return self._reply(400, str(exc))
        self._reply(200, "OK")

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        owner = self.server.owner
        if url.path == "/health":
            return self._reply(200, "OK")
        if url.path == "/route/nonce":
            return self._reply(200, {"nonce": owner.issue_nonce()})
        if url.path != "/route":
            return self._reply(404, f"no route {url.path[:80]}")
        sign_for = None
        if owner.auth.enabled:
            nonce, mac = self._auth_fields()
            if not (nonce and owner.auth.verify(mac, "GET", self.path, nonce)):
                return self._reply(401, "lookup not authenticated by the shared secret")
            sign_for = nonce
        query = urllib.parse.parse_qs(url.query)
        if "tp_rank" not in query:
            info = owner.parallel_info()
            return self._reply(200, info, sign_for) if info else self._reply(503, owner.progress(), sign_for)
        try:
            tp_rank = int(query["tp_rank"][0])
        except ValueError:
            return self._reply(400, f"tp_rank must be an int, got {query['tp_rank'][0][:32]!r}", sign_for)
        record = owner.rank_record(tp_rank)
        if record is None:
            return self._reply(503, f"prefill tp_rank {tp_rank} not registered", sign_for)
        return self._reply(200, record, sign_for)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "CommonKVBootstrapServer"


class CommonKVBootstrapServer(BaseKVBootstrapServer):
    """HTTP bootstrap server in a daemon thread. ``port=0`` picks a free port (see ``.port``);
    ``secret`` (the deployment's shared secret) makes it authenticate every registration and
    lookup."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None):
        self._lock = threading.Lock()
        self._peer: PeerInfo | None = None
        self._ranks: dict[int, dict] = {}
        self._nonces: OrderedDict[str, float] = OrderedDict()  # issued PUT nonce -> expiry
        self.auth = PeerAuth(secret)
        self._httpd = _Server((host, port), _Handler)
        self._httpd.owner = self
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="pd-bootstrap",
                                        daemon=True)
        self._thread.start()
        logger.info("PD bootstrap server listening on %s:%d (%s)", host, self.port,
                    "registrations authenticated" if self.auth.enabled else "registrations from this host only")

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def issue_nonce(self) -> str:
        nonce = secrets.token_hex(16)
        with self._lock:
            self._nonces[nonce] = time.monotonic() + NONCE_TTL_S
            while len(self._nonces) > MAX_NONCES:
                self._nonces.popitem(last=False)
        return nonce

    def check_put(self, client_host: str, local_host: str, nonce: str, mac: str, body: bytes) -> None:
        """Raise _Refused unless this registration may be stored (see the module doc). Without a
        secret the client must be on this host: loopback, or connected from the very address it
        reached the server at."""
        if not self.auth.enabled:
            if not (is_loopback(client_host) or client_host == local_host):
                raise _Refused(403, f"registration from {client_host} refused: without the shared secret only "
                                    "ranks on this host may register")
            return
        with self._lock:
            expiry = self._nonces.pop(nonce, None)
        if expiry is None or expiry < time.monotonic() or not self.auth.verify(mac, "PUT", "/route", nonce, body):
            raise _Refused(401, "registration not authenticated by the shared secret")

    def register(self, record: dict, peer: PeerInfo) -> None:
        """Store a rank record; raise IncompatiblePeerError when its peer facts differ from the
        first or another tp_rank holds its engine_rank, PeerConflict when its tp_rank holds
        another record."""
        with self._lock:
            if self._peer is not None and peer != self._peer:
                diffs = [
                    f"{f.name}: this rank {getattr(peer, f.name)!r} vs registered {getattr(self._peer, f.name)!r}"
                    for f in fields(PeerInfo)
                    if getattr(peer, f.name) != getattr(self._peer, f.name)
                ]
                raise IncompatiblePeerError(f"prefill tp_rank {record['tp_rank']} disagrees with earlier ranks: "
                                            + "; ".join(diffs))
            held = self._ranks.get(record["tp_rank"])
            if held is not None and any(held[k] != record[k] for k in RANK_FIELDS):
                raise PeerConflict(f"prefill tp_rank {record['tp_rank']} is already registered by agent "
                                   f"{held['agent_name']} at {held['ip']}:{held['port']}; only the same record "
                                   "may be registered again")
            owner = next((r for r, rec in self._ranks.items()
                          if rec["engine_rank"] == record["engine_rank"] and r != record["tp_rank"]), None)
            if owner is not None:
                raise IncompatiblePeerError(f"prefill tp_rank {record['tp_rank']} claims engine_rank "
                                            f"{record['engine_rank']}, already held by tp_rank {owner}")
            self._peer = peer
            self._ranks[record["tp_rank"]] = dict(record, peer=peer.to_json())

    def progress(self) -> str:
        with self._lock:
            total = self._peer.tp_size if self._peer else "?"
            return f"{len(self._ranks)} of {total} prefill ranks registered"

    def parallel_info(self) -> dict | None:
        with self._lock:
            if self._peer is None or len(self._ranks) < self._peer.tp_size:
                return None
            return {"tp_size": self._peer.tp_size, "peer": self._peer.to_json(), "ranks": sorted(self._ranks)}

    def rank_record(self, tp_rank: int) -> dict | None:
        with self._lock:
            return self._ranks.get(tp_rank)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
