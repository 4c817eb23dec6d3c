"""Validation of a backend's extra config: one table of keys per backend.

A value comes from the extra config, else from the key's environment variable, else from its
default. Unknown keys, wrong types and values outside a closed set raise ValueError naming the
key and what is allowed, at construction (that is, at server startup).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# Keys every backend accepts: consumed by the config (namespace_salt, extra_backend_tag: parts of
# the storage namespace) or the factory (dynamic).
COMMON_KEYS = ("namespace_salt", "extra_backend_tag", "backend_name", "module_path", "class_name")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class ExtraKey:
    name: str
    type: type
    default: Any
    env: str | None = None
    choices: tuple | None = None
    minimum: float | None = None
    help: str = ""


def _coerce(key: ExtraKey, value: Any, where: str) -> Any:
    what = f"{where}: extra config key {key.name!r}"
    if key.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"{what} must be a boolean (true/false), got {value!r}")
    if key.type in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{what} must be a number, got {value!r}")
        try:
            value = key.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be {key.type.__name__}, got {value!r}") from None
        if key.minimum is not None and value < key.minimum:
            raise ValueError(f"{what} must be >= {key.minimum}, got {value!r}")
        return value
    if key.type is list:  # of strings; a string is split at commas (the environment's form)
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"{what} must be a list of strings, got {value!r}")
        return [v.strip() for v in items]
    if key.type is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{what} must be an object (dict), got {value!r}")
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {value!r}")
    return value


def parse_keys(extra_config: dict, keys: tuple[ExtraKey, ...], where: str) -> dict[str, Any]:
    """Validated values of ``keys`` (name -> value) from ``extra_config``, env and defaults."""
    known = {k.name for k in keys} | set(COMMON_KEYS)
    for name in extra_config:
        if name not in known:
            raise ValueError(f"{where}: unknown extra config key {name!r}; allowed: {', '.join(sorted(known))}")
    values = {}
    for key in keys:
        if key.name in extra_config:
            raw = extra_config[key.name]
        elif key.env and os.environ.get(key.env) not in (None, ""):
            raw = os.environ[key.env]
        else:
            values[key.name] = key.default
            continue
        value = _coerce(key, raw, where)
        if key.choices is not None and value not in key.choices:
            raise ValueError(
                f"{where}: extra config key {key.name!r} is {value!r}; allowed: {', '.join(map(str, key.choices))}"
            )
        values[key.name] = value
    return values
