"""The controller's own keys in ``--hicache-storage-backend-extra-config``.

The server passes one extra config for the whole L3 hookup. The keys below configure the
HiCache controller and are taken out before the rest goes to the backend (whose own table
rejects keys it does not know), so both halves are validated at construction and an error
names the key.

| key | unit | default | meaning |
|---|---|---|---|
| ``prefetch_threshold`` | tokens | 256 | shorter prefetches (asked, or found in L3) are skipped |
| ``prefetch_timeout_base`` | s | 1.0 | ``timeout`` policy: fixed part of the budget |
| ``prefetch_timeout_per_ki_token`` | s / 1024 tokens | 0.25 | ``timeout`` policy: per hit token |
| ``prefetch_timeout_max`` | s | 30.0 | every policy: a prefetch never waits longer |
| ``flush_timeout_s`` | s | 5.0 | ``reset`` (flush) waits at most this long for storage operations |
| ``hicache_storage_pass_prefix_keys`` | bool | false | upstream's switch to hand backends the keys of the preceding pages; accepted, no effect: every key here already chains its prefix |

``flush_timeout_s`` bounds ``/flush_cache``: operations still running after it (a hung backend)
are abandoned, their host slots quarantined until the backend returns, and ``reset`` raises
``HiCacheFlushIncomplete`` (see ``hiradix_storage.py``).

``PrefetchRetrySettings`` are server flags, not extra config keys: how often and how many times
a queued request's L3 existence check is re-issued after a miss (``hiradix/prefetch_retries.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StorageSettings:
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_timeout_max: float = 30.0
    flush_timeout_s: float = 5.0
    hicache_storage_pass_prefix_keys: bool = False

    def timeout_budget(self, hit_tokens: int) -> float:
        """Seconds the ``timeout`` policy waits for a prefetch of ``hit_tokens`` found tokens."""
        budget = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * hit_tokens / 1024
        return min(budget, self.prefetch_timeout_max)


@dataclass(frozen=True)
class PrefetchRetrySettings:
    """``--hicache-storage-prefetch-retry-poll-interval`` (``poll_interval``: scheduling passes
    between a miss and its re-issued check; 0: misses are not retried) and
    ``--hicache-storage-prefetch-retry-max-attempts`` (``max_attempts``: re-issued checks per
    request; 0: none). Upstream's defaults, 8 and 8."""

    poll_interval: int = 8
    max_attempts: int = 8

    def __post_init__(self):
        for name in ("poll_interval", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"prefetch retry {name} must be an integer >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        """A miss can be retried at all."""
        return self.poll_interval > 0 and self.max_attempts > 0


# key -> (type, minimum, strictly greater than the minimum)
_KEYS = {
    "prefetch_threshold": (int, 0, False),
    "prefetch_timeout_base": (float, 0.0, False),
    "prefetch_timeout_per_ki_token": (float, 0.0, False),
    "prefetch_timeout_max": (float, 0.0, True),
    "flush_timeout_s": (float, 0.0, True),
    "hicache_storage_pass_prefix_keys": (bool, None, False),
}
CONTROLLER_KEYS = tuple(_KEYS)


def _value(name: str, raw):
    kind, minimum, strict = _KEYS[name]
    what = f"storage extra config key {name!r}"
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        raise ValueError(f"{what} must be a boolean (true/false), got {raw!r}")
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{what} must be a number, got {raw!r}")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {raw!r}") from None
    if kind is int:
        if value != int(value):
            raise ValueError(f"{what} must be an integer, got {raw!r}")
        value = int(value)
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{what} must be {'>' if strict else '>='} {minimum}, got {raw!r}")
    return value


def split_extra_config(extra: dict) -> tuple[StorageSettings, dict]:
    """(controller settings, the backend's part of ``extra``); ValueError naming a bad key."""
    mine = {k: _value(k, v) for k, v in extra.items() if k in _KEYS}
    rest = {k: v for k, v in extra.items() if k not in _KEYS}
    return StorageSettings(**mine), rest


def parse_extra_config_arg(value, field: str) -> dict:
    """An extra config given as None, a dict or a JSON object string, as a dict.
    ValueError naming ``field`` when it is anything else."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object (dict), got {type(value).__name__}")
    if not all(isinstance(k, str) for k in value):
        raise ValueError(f"{field} keys must be strings")
    return dict(value)
