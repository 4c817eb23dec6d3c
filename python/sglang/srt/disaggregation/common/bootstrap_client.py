"""BootstrapClient: the blocking HTTP calls prefill and decode ranks make to a bootstrap server.

URLs are built from a validated ``BootstrapAddr`` (``common/trust.py``); every call has the
client's timeout (connect and each read); an answer longer than ``MAX_BODY_BYTES`` is refused.
With the shared secret, registrations use a nonce the server issued and every lookup answer must
carry the server's MAC for this call (else UntrustedPeerError: the server is no peer).
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.parse
import urllib.request

from sglang.srt.disaggregation.base.conn import IncompatiblePeerError, KVTransferError, UntrustedPeerError
from sglang.srt.disaggregation.common.bootstrap import AUTH_HEADER, MAX_BODY_BYTES, parse_rank_record
from sglang.srt.disaggregation.common.trust import BootstrapAddr, PeerAuth


class BootstrapClient:
    """Calls to the bootstrap server at ``addr`` (a BootstrapAddr or "host:port")."""

    def __init__(self, addr: BootstrapAddr | str, timeout_s: float = 2.0, auth: PeerAuth | None = None):
        self.addr = addr if isinstance(addr, BootstrapAddr) else BootstrapAddr.parse(addr)
        self.timeout_s, self.auth = timeout_s, auth or PeerAuth(None)

    def _call(self, method: str, path: str, query: dict | None = None, body: bytes | None = None,
              auth_header: str | None = None) -> tuple[int, bytes, str | None]:
        """(status, body, the answer's auth header); KVTransferError when unreachable."""
        req = urllib.request.Request(self.addr.url(path, query), data=body, method=method)
        if auth_header is not None:
            req.add_header(AUTH_HEADER, auth_header)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                code, headers, stream = 200, resp.headers, resp
                data = stream.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            code, headers = exc.code, exc.headers
            data = exc.read(MAX_BODY_BYTES + 1)
        except (OSError, ValueError) as exc:
            raise KVTransferError(f"bootstrap server {self.addr} unreachable: {exc}") from exc
        if len(data) > MAX_BODY_BYTES:
            raise KVTransferError(f"bootstrap server {self.addr} answered more than {MAX_BODY_BYTES} bytes")
        return code, data, headers.get(AUTH_HEADER) if headers is not None else None

    def register_rank(self, record: dict) -> None:
        """PUT a rank record; IncompatiblePeerError when refused (UntrustedPeerError when not
        authenticated), KVTransferError when unreachable."""
        body, auth_header = json.dumps(record).encode(), None
        if self.auth.enabled:
            code, data, _ = self._call("GET", "/route/nonce")
            if code != 200:
                raise KVTransferError(f"bootstrap server {self.addr} answered {code} to GET /route/nonce")
            try:
                nonce = str(json.loads(data)["nonce"])
            except (ValueError, KeyError, TypeError):
                raise UntrustedPeerError(f"bootstrap server {self.addr} sent no nonce") from None
            auth_header = f"{nonce} {self.auth.sign('PUT', '/route', nonce, body)}"
        code, data, _ = self._call("PUT", "/route", body=body, auth_header=auth_header)
        text = data.decode(errors="replace")
        if code in (401, 403):
            raise UntrustedPeerError(f"bootstrap server {self.addr} refused registration: {text}")
        if code in (400, 409, 413):
            raise IncompatiblePeerError(f"bootstrap server {self.addr} refused registration: {text}")
        if code != 200:
            raise KVTransferError(f"bootstrap server {self.addr} answered {code}: {text}")

    def _get_json(self, query: dict | None = None):
        path, auth_header, nonce = "/route", None, None
        selector = urllib.parse.urlsplit(self.addr.url(path, query))
        selector = selector.path + (f"?{selector.query}" if selector.query else "")
        if self.auth.enabled:
            nonce = secrets.token_hex(16)
            auth_header = f"{nonce} {self.auth.sign('GET', selector, nonce)}"
        code, data, mac = self._call("GET", path, query, auth_header=auth_header)
        if code in (401, 403):
            raise UntrustedPeerError(f"bootstrap server {self.addr} refused the lookup: {data.decode(errors='replace')}")
        if nonce is not None and not self.auth.verify(mac, "REPLY", selector, nonce, str(code), data):
            raise UntrustedPeerError(f"bootstrap server {self.addr} did not authenticate its answer with the "
                                     "shared secret: not a peer of this deployment")
        if code == 503:
            return None
        if code != 200:
            raise KVTransferError(f"bootstrap server {self.addr} answered {code} to GET {selector}: "
                                  f"{data.decode(errors='replace')[:200]}")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise KVTransferError(f"bootstrap server {self.addr} sent bad JSON: {exc}") from None

    def parallel_info(self) -> dict | None:
        """``{tp_size, peer, ranks}``, or None until every prefill rank registered."""
        return self._get_json()

    def rank_record(self, tp_rank: int) -> dict | None:
        """A prefill rank's validated record, or None until it registered."""
        record = self._get_json({"tp_rank": int(tp_rank)})
        return None if record is None else parse_rank_record(record)[0]
