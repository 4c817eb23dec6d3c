"""The base of every request body schema: strict pydantic models with readable 400s.

A body is validated by ``parse_request(Model, body, route)``: unknown fields, wrong types,
NaN or infinite numbers, integers beyond 64 bits and lone UTF-16 surrogates in strings all
raise ``BadRequestError`` naming the field (a JSON path such as ``messages[0].content``) and
what is allowed.

Upstream sglang's schemas carry many fields for features this engine lacks. Each model lists
them in ``UNSUPPORTED`` (field -> why): such a field is accepted at its default value (or an
empty equivalent: null, "", [], {}), so clients that send upstream's full field set work, and
any other value is refused with the field and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

EMPTY_VALUES = (None, "", [], {})
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class BadRequestError(ValueError):
    """The request cannot be served as sent (HTTP 400)."""


@dataclass(frozen=True)
class Unsupported:
    """A field we accept only at its default; ``also`` lists other values we can serve."""

    why: str
    also: tuple = ()


class RequestModel(BaseModel):
    """Strict: no type coercion ("3" is not 3, 1 is not true), no extra fields, finite floats."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="after")
    def _check_after_types(self):
        self.check_int_ranges()
        self.check_unsupported()
        self.check_values()
        return self

    def check_int_ranges(self) -> None:
        """BadRequestError for a top-level integer field beyond signed 64 bits (nested objects
        are checked where they are read, e.g. ``SamplingParams``)."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                raise BadRequestError(f"{name} holds an integer of {len(str(abs(value)))} digits; the limit is a "
                                      "signed 64-bit integer")

    def check_values(self) -> None:
        """Cross-field checks and normalisation of a subclass (runs after the type checks)."""

    def check_unsupported(self) -> None:
        """BadRequestError for the first field of ``UNSUPPORTED`` set to a value we cannot serve."""
        for name, rule in self.UNSUPPORTED.items():
            value = getattr(self, name)
            default = type(self).model_fields[name].default
            if value == default or value in rule.also:
                continue
            if default in (None, False) and value in EMPTY_VALUES:
                continue
            raise BadRequestError(f"{name}={_short(value)} is not supported by this server: {rule.why}")


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def find_lone_surrogate(data, path: str = "") -> str | None:
    """JSON path of the first string in ``data`` holding a lone UTF-16 surrogate, else None."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the body"
        return None
    if isinstance(data, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in data.items())
    elif isinstance(data, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(data))
    else:
        return None
    for sub_path, value in items:
        found = find_lone_surrogate(value, sub_path)
        if found:
            return found
    return None


def _json_path(loc: tuple, body: Any) -> str:
    """The part of a pydantic ``loc`` that walks ``body`` (union member tags are dropped)."""
    path, node = "", body
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path, node = (f"{path}.{part}" if path else part), node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
        else:
            break
    return path


def _format(exc: ValidationError, body: dict, route: str) -> str:
    errors = exc.errors(include_url=False)
    unknown = [_json_path(e["loc"][:-1], body) + ("." if len(e["loc"]) > 1 else "") + str(e["loc"][-1])
               for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return (f"unknown fields {unknown} for {route}; it accepts the fields of upstream sglang's "
                f"schema for this route (see docs/server.md)")
    first = errors[0]
    message = first["msg"]
    if first["type"] == "value_error":  # our own validators name the field; say where the object is
        where = _json_path(first["loc"], body)
        message = message.removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    path = (_json_path(first["loc"], body) or str(first["loc"][0])) if first["loc"] else ""
    got = f" (got {_short(first['input'], 80)})" if "input" in first and first["type"] != "missing" else ""
    return f"{path}: {message}{got}" if path else message


def parse_request(model: type[RequestModel], body: dict, route: str) -> RequestModel:
    """``body`` validated as ``model``; BadRequestError naming the first problem."""
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # C speed; the walk below only finds where
    except UnicodeEncodeError:
        bad = find_lone_surrogate(body)
        raise BadRequestError(f"{bad} holds a lone UTF-16 surrogate, which is not valid Unicode text") from None
    except (TypeError, ValueError):
        pass  # not JSON data (a programmatic caller); the model's types decide
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadRequestError(_format(exc, body, route)) from None
