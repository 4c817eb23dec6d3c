"""Per-request sampling parameters, validated at construction.

``from_dict`` reads a request's ``sampling_params`` object with upstream sglang's key set:
null means "the default" for every key but ``max_new_tokens`` (as upstream), and the keys of
features this engine lacks (``UPSTREAM_ONLY``) are accepted only at their default value.
What a request may ask is bounded (the limits below): every stop string is looked for at every
decode step, and every integer fits in 64 bits (a seed or token id reaches torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

TOP_LOGPROBS_MAX = 20  # OpenAI's (and upstream's) limit on top logprobs per token
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# upstream key -> (the value we can serve, why any other value cannot be served)
UPSTREAM_ONLY = {
    "stop_regex": (None, "regular-expression stops are not implemented"),
    "frequency_penalty": (0.0, "penalties are not implemented"),
    "presence_penalty": (0.0, "penalties are not implemented"),
    "repetition_penalty": (1.0, "penalties are not implemented"),
    "min_new_tokens": (0, "a minimum output length is not implemented"),
    "n": (1, "the limit is 1 completion per request (send n requests)"),
    "json_schema": (None, "constrained decoding is not implemented"),
    "regex": (None, "constrained decoding is not implemented"),
    "ebnf": (None, "constrained decoding is not implemented"),
    "structural_tag": (None, "constrained decoding is not implemented"),
    "spaces_between_special_tokens": (True, "detokenization always joins special tokens without spaces"),
    "no_stop_trim": (False, "a matched stop string is always trimmed from the output"),
    "custom_params": (None, "custom logit processors are not implemented"),
    "stream_interval": (None, "streams send every step's tokens"),
    "logit_bias": (None, "logit bias is not implemented"),
}
EMPTY = (None, "", [], {})


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` (or ``top_k == 1``) is greedy. ``top_k == -1`` disables top-k.
    ``sampling_seed`` makes sampled decoding reproducible: the noise for a request's n-th token
    depends only on (seed, n), not on the batch it runs in.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        self._check_sizes()
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, "an integer >= 0"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
             "a finite number >= 0 (0 is greedy)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 (disabled) or an integer >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("sampling_seed", self.sampling_seed is None or self.sampling_seed >= 0, "None or an integer >= 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"sampling param {name}={getattr(self, name)!r} is invalid; must be {allowed}")

    def _check_types(self) -> None:
        number, integer = (int, float), (int,)
        expected = {
            "max_new_tokens": integer,
            "temperature": number,
            "top_p": number,
            "top_k": integer,
            "min_p": number,
            "ignore_eos": (bool,),
            "skip_special_tokens": (bool,),
        }
        if self.sampling_seed is not None:
            expected["sampling_seed"] = integer
        for name, types in expected.items():
            value = getattr(self, name)
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                allowed = " or ".join(t.__name__ for t in types)
                raise ValueError(f"sampling param {name}={value!r} has type {type(value).__name__}; expected {allowed}")
        lists = (("stop", str), ("stop_token_ids", int))
        for name, item_type in lists:
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, item_type) for v in value):
                raise ValueError(f"sampling param {name}={value!r} must be a list of {item_type.__name__}")

    def _check_sizes(self) -> None:
        limits = [
            ("stop", len(self.stop), MAX_STOP_STRINGS, "strings", "MAX_STOP_STRINGS"),
            ("stop", max(map(len, self.stop), default=0), MAX_STOP_STRING_CHARS, "characters in one string",
             "MAX_STOP_STRING_CHARS"),
            ("stop_token_ids", len(self.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids", "MAX_STOP_TOKEN_IDS"),
        ]
        for name, size, limit, unit, const in limits:
            if size > limit:
                raise ValueError(f"sampling param {name} has {size} {unit}; the limit is {limit} ({const})")
        ints = [(f.name, getattr(self, f.name)) for f in fields(self)]
        ints += [("stop_token_ids", t) for t in self.stop_token_ids]
        for name, value in ints:
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"sampling param {name} holds an integer of {len(str(abs(value)))} digits; the "
                                 "limit is a signed 64-bit integer")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_dict(cls, params: dict) -> "SamplingParams":
        """Build from a request's JSON object. ValueError naming the key for an unknown key, a bad
        value, or an upstream-only key set to something other than its default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known - set(UPSTREAM_ONLY))
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}; known: {sorted(known | set(UPSTREAM_ONLY))}")
        for name, (default, why) in UPSTREAM_ONLY.items():
            value = params.get(name)
            if value is not None and value != default and not (default is None and value in EMPTY):
                raise ValueError(f"sampling param {name}={value!r} is not supported by this server: {why}")
        if params.get("max_new_tokens", 0) is None:
            raise ValueError("sampling param max_new_tokens=None (no limit) is not supported: admission reserves "
                             "every page a request can need, so give a number")
        return cls(**{k: v for k, v in params.items() if k in known and v is not None})
