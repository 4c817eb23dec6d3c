"""Whom a PD server trusts: the bootstrap hosts it may contact, and the shared secret that
authenticates every registration and control message between its peers.

Decode servers learn the prefill bootstrap address per request (``bootstrap_host`` /
``bootstrap_port``, set by the router), so a client talking to a decode server directly could
name any host. Before a decode rank sends a bootstrap server anything (and, after the lookup,
before it sends a prefill rank its NIXL metadata and pool descriptors), ``TrustPolicy`` checks:

- the host is a well-formed IP literal or DNS name (``BootstrapAddr``; URLs are built from the
  parts, never by pasting request text into a string);
- it is in the allow-list (``SGLANG_DISAGGREGATION_BOOTSTRAP_ALLOWED_HOSTS``: comma-separated
  names, IPs or CIDR networks; default: loopback and this server's own address);
- without a shared secret (``SGLANG_DISAGGREGATION_SECRET``) only loopback peers are trusted:
  a deployment across hosts needs the secret, and an allow-list naming another host without it
  is refused at start-up.

With a secret, ``PeerAuth`` signs (HMAC-SHA256) the bootstrap server's registrations and
answers and every control message, and the receiving side drops what does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import urllib.parse
from dataclasses import dataclass

from sglang.srt.disaggregation.base.conn import LOOPBACK_HOSTS, UntrustedPeerError

ENV_SECRET = "SGLANG_DISAGGREGATION_SECRET"
ENV_ALLOWED_HOSTS = "SGLANG_DISAGGREGATION_BOOTSTRAP_ALLOWED_HOSTS"
MIN_SECRET_BYTES = 16

_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_host(host) -> str:
    """``host`` if it is an IP literal (no zone id) or a DNS name of letters, digits and
    hyphens; ValueError naming it otherwise (no '@', '/', ':', '%', spaces or URL syntax)."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"bootstrap host must be a non-empty string, got {host!r}")
    if "%" not in host and _ip(host) is not None:  # no IPv6 zone id: it names an interface, not a peer
        return host
    labels = host.rstrip(".").split(".") if len(host) <= 253 else []
    if not labels or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"bootstrap host {host[:80]!r} is neither an IP address nor a DNS name")
    return host


def is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host.lower().rstrip(".") == "localhost" if ip is None else ip.is_loopback


@dataclass(frozen=True)
class BootstrapAddr:
    """A validated bootstrap server address; ``url()`` builds request URLs from its parts."""

    host: str
    port: int

    def __post_init__(self):
        check_host(self.host)
        if type(self.port) is not int or not 1 <= self.port <= 65535:
            raise ValueError(f"bootstrap port must be an int in [1, 65535], got {self.port!r}")

    @classmethod
    def parse(cls, addr: str) -> "BootstrapAddr":
        """From ``"host:port"`` or ``"[v6]:port"``; ValueError naming the input."""
        host, sep, port = str(addr).rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not port.isdigit():
            raise ValueError(f"bootstrap address {str(addr)[:80]!r} must be 'host:port'")
        return cls(host, int(port))

    @property
    def netloc(self) -> str:
        ip = _ip(self.host)
        return f"[{self.host}]:{self.port}" if ip is not None and ip.version == 6 else f"{self.host}:{self.port}"

    def url(self, path: str, query: dict | None = None) -> str:
        """``http://netloc/path?query`` with the path and query quoted."""
        return urllib.parse.urlunsplit(("http", self.netloc, urllib.parse.quote(path),
                                        urllib.parse.urlencode(query or {}), ""))

    def __str__(self) -> str:
        return self.netloc


class HostAllowList:
    """Hosts by name (case-insensitive, exact), IP or CIDR network."""

    def __init__(self, entries):
        self.entries = tuple(entries)
        self._nets, self._names = [], set()
        for entry in self.entries:
            try:
                self._nets.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._names.add(check_host(entry).lower().rstrip("."))

    def allows(self, host: str) -> bool:
        ip = _ip(host)
        if ip is None:
            return host.lower().rstrip(".") in self._names
        return any(ip in net for net in self._nets)

    def non_loopback(self) -> list[str]:
        """Entries that admit an address off this host."""
        out = [str(n) for n in self._nets if not (n.network_address.is_loopback and n.broadcast_address.is_loopback)]
        return out + sorted(n for n in self._names if n != "localhost")


class PeerAuth:
    """HMAC-SHA256 under the deployment's shared secret; disabled (``enabled`` False) without one.
    Parts are length-prefixed, so no two part lists sign alike."""

    def __init__(self, secret: bytes | None):
        self._key = secret or b""

    @property
    def enabled(self) -> bool:
        return bool(self._key)

    def sign(self, *parts: bytes | str) -> str:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            data = part.encode() if isinstance(part, str) else bytes(part)
            mac.update(len(data).to_bytes(8, "little"))
            mac.update(data)
        return mac.hexdigest()

    def verify(self, mac: str | None, *parts: bytes | str) -> bool:
        return bool(mac) and hmac.compare_digest(str(mac), self.sign(*parts))

    def __repr__(self) -> str:  # never the key
        return f"PeerAuth(enabled={self.enabled})"


def parse_secret(raw: str | None) -> bytes | None:
    """The secret from its environment value (None when unset or empty); ValueError when shorter
    than MIN_SECRET_BYTES (the message never contains it)."""
    if not raw:
        return None
    secret = raw.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{ENV_SECRET} must be at least {MIN_SECRET_BYTES} bytes long (it is {len(secret)}); "
                         "use e.g. `openssl rand -hex 32`, the same value on every prefill and decode server")
    return secret


class TrustPolicy:
    """The allow-list plus the secret. Raises ValueError at construction when the allow-list
    admits hosts off loopback but no secret authenticates them."""

    def __init__(self, allowed_hosts=LOOPBACK_HOSTS, secret: bytes | None = None):
        self.allow = HostAllowList(allowed_hosts)
        self.auth = PeerAuth(secret)
        remote = self.allow.non_loopback()
        if remote and not self.auth.enabled:
            raise ValueError(f"{ENV_ALLOWED_HOSTS} admits hosts off loopback ({', '.join(remote)}) but {ENV_SECRET} "
                             "is not set: peers on other hosts are trusted only with the shared secret")

    def check_host(self, host: str, what: str = "bootstrap_host") -> None:
        """Raise UntrustedPeerError unless this rank may send ``host`` its registration."""
        if not self.allow.allows(host):
            raise UntrustedPeerError(f"{what} {host!r} is not in this server's allowed bootstrap hosts "
                                     f"(see {ENV_ALLOWED_HOSTS})")
        if not self.auth.enabled and not is_loopback(host):
            raise UntrustedPeerError(f"{what} {host!r} is not loopback and {ENV_SECRET} is not set")
