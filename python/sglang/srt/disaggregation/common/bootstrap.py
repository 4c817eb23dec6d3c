"""Bootstrap server hosted by prefill: prefill ranks register, decode ranks look them up.

Routes (JSON bodies):
- ``PUT /route``: a prefill rank registers ``{engine_rank, tp_rank, ip, port, agent_name, peer}``
  where ``peer`` is a ``PeerInfo``. A rank whose peer facts differ from the ranks already
  registered is refused with 400 naming both values.
- ``GET /route``: ``{tp_size, peer, ranks}`` once every prefill rank registered, 503 before.
- ``GET /route?tp_rank=R``: rank R's record, 503 until it registered.
- ``GET /health``: 200.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer, IncompatiblePeerError, KVTransferError
from sglang.srt.disaggregation.common.compat import PeerInfo

logger = logging.getLogger(__name__)

RANK_FIELDS = {"engine_rank": int, "tp_rank": int, "ip": str, "port": int, "agent_name": str}


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


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, fmt, *args):
        logger.debug("bootstrap %s: " + fmt, self.address_string(), *args)

    def _reply(self, code: int, body) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        if urllib.parse.urlparse(self.path).path != "/route":
            return self._reply(404, f"no route {self.path}")
        try:
            length = int(self.headers.get("Content-Length", "0"))
            record, peer = parse_rank_record(json.loads(self.rfile.read(length) or b"null"))
            self.server.owner.register(record, peer)
        except (ValueError, IncompatiblePeerError) as exc:
            logger.error("bootstrap refused a prefill registration: %s", exc)
            return self._reply(400, str(exc))
        self._reply(200, "OK")

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        if url.path == "/health":
            return self._reply(200, "OK")
        if url.path != "/route":
            return self._reply(404, f"no route {url.path}")
        query = urllib.parse.parse_qs(url.query)
        owner = self.server.owner
        if "tp_rank" not in query:
            info = owner.parallel_info()
            return self._reply(200, info) if info else self._reply(503, owner.progress())
        try:
            tp_rank = int(query["tp_rank"][0])
        except ValueError:
            return self._reply(400, f"tp_rank must be an int, got {query['tp_rank'][0]!r}")
        record = owner.rank_record(tp_rank)
        return self._reply(200, record) if record else self._reply(503, f"prefill tp_rank {tp_rank} not registered")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "CommonKVBootstrapServer"


class CommonKVBootstrapServer(BaseKVBootstrapServer):
    """HTTP bootstrap server in a daemon thread. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._lock = threading.Lock()
        self._peer: PeerInfo | None = None
        self._ranks: dict[int, dict] = {}
        self._httpd = _Server((host, port), _Handler)
        self._httpd.owner = self
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="pd-bootstrap",
                                        daemon=True)
        self._thread.start()
        logger.info("PD bootstrap server listening on %s:%d", host, self.port)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def register(self, record: dict, peer: PeerInfo) -> None:
        """Store a rank record; raise IncompatiblePeerError when its peer facts differ from the first."""
        with self._lock:
            if self._peer is not None and peer != self._peer:
                diffs = [
                    f"{f.name}: this rank {getattr(peer, f.name)!r} vs registered {getattr(self._peer, f.name)!r}"
                    for f in fields(PeerInfo)
                    if getattr(peer, f.name) != getattr(self._peer, f.name)
                ]
                raise IncompatiblePeerError(f"prefill tp_rank {record['tp_rank']} disagrees with earlier ranks: "
                                            + "; ".join(diffs))
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


class BootstrapClient:
    """Blocking HTTP calls to a bootstrap server at ``addr`` ("host:port")."""

    def __init__(self, addr: str, timeout_s: float = 2.0):
        self.addr, self.timeout_s = addr, timeout_s

    def _call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.addr}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return 200, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (OSError, ValueError) as exc:
            raise KVTransferError(f"bootstrap server {self.addr} unreachable: {exc}") from exc

    def register_rank(self, record: dict) -> None:
        """PUT a rank record; IncompatiblePeerError when refused, KVTransferError when unreachable."""
        code, text = self._call("PUT", "/route", record)
        if code == 400:
            raise IncompatiblePeerError(f"bootstrap server {self.addr} refused registration: {text}")
        if code != 200:
            raise KVTransferError(f"bootstrap server {self.addr} answered {code}: {text}")

    def _get_json(self, path: str):
        code, text = self._call("GET", path)
        if code == 503:
            return None
        if code != 200:
            raise KVTransferError(f"bootstrap server {self.addr} answered {code} to GET {path}: {text}")
        return json.loads(text)

    def parallel_info(self) -> dict | None:
        """``{tp_size, peer, ranks}``, or None until every prefill rank registered."""
        return self._get_json("/route")

    def rank_record(self, tp_rank: int) -> dict | None:
        """A prefill rank's validated record, or None until it registered."""
        record = self._get_json(f"/route?tp_rank={tp_rank}")
        return None if record is None else parse_rank_record(record)[0]
