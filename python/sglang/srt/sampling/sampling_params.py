"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


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
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, "an integer >= 0"),
            ("temperature", self.temperature >= 0, "a number >= 0 (0 is greedy)"),
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_dict(cls, params: dict) -> "SamplingParams":
        """Build from a request's JSON object; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}; known: {sorted(known)}")
        return cls(**params)
