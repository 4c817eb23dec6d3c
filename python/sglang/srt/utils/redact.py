"""Secrets kept out of responses and logs.

The rule (docs/server.md, "Security"): in a configuration object (the storage extra config and
anything nested in it, lists included), the value of every key whose name contains one of
``SECRET_WORDS`` (any case) is replaced by ``REDACTED``; booleans and nulls are kept (they hold
no secret). In a string value, the ``user:password@`` part of a URL becomes ``***@``. Text that
may quote a configuration (an error message from a backend) has every secret value of that
configuration (of ``MIN_TEXT_SECRET_CHARS`` or more) replaced by ``REDACTED``.
"""

from __future__ import annotations

import json
import re

REDACTED = "***"
SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth")
MIN_TEXT_SECRET_CHARS = 4  # shorter values are not looked for in text (they would hit unrelated words)
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def is_secret_name(name) -> bool:
    lowered = str(name).lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact_config(value):
    """A copy of ``value`` (JSON-like data) with secrets replaced (the module's rule)."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_name(k) and not _harmless(v) else redact_config(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_config(v) for v in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(REDACTED + "@", value)
    return value


def _harmless(value) -> bool:
    return value is None or isinstance(value, bool)


def redact_config_json(text: str | None) -> str | None:
    """``text`` (a JSON object, or ``@path`` to a config file) with secrets replaced; a value that
    is not JSON is replaced whole (it cannot be checked)."""
    if text is None or text.startswith("@"):
        return text
    try:
        data = json.loads(text)
    except ValueError:
        return REDACTED
    return json.dumps(redact_config(data))


def secret_values(value) -> list[str]:
    """Every string (or number) held under a secret-looking key of ``value``, longest first."""
    found: list[str] = []

    def walk(node, secret: bool) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, secret or is_secret_name(k))
        elif isinstance(node, list):
            for v in node:
                walk(v, secret)
        elif secret and not _harmless(node) and str(node):
            found.append(str(node))
        elif isinstance(node, str):
            found.extend(m.group(0)[:-1] for m in _URL_USERINFO.finditer(node))

    walk(value, False)
    return sorted(set(found), key=len, reverse=True)


def redact_text(text: str, *configs) -> str:
    """``text`` with every secret value of ``configs`` (dicts, or JSON strings) replaced."""
    for config in configs:
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError:
                continue
        for secret in secret_values(config):
            if len(secret) >= MIN_TEXT_SECRET_CHARS:
                text = text.replace(secret, REDACTED)
    return text
