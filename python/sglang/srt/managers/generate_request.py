"""GenerateReqInput: the body of ``POST /generate``, validated field by field.

Every problem raises ``BadRequestError`` (HTTP 400) with a message naming the field and what
is allowed; nothing reaches the scheduler unless it is well-formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from sglang.srt.sampling.sampling_params import SamplingParams


class BadRequestError(ValueError):
    """The request cannot be served as sent (HTTP 400)."""


def check_type(name: str, value, types: tuple, allowed: str):
    """``value`` if it is one of ``types`` (bool is not an int here), else BadRequestError."""
    if isinstance(value, bool) and bool not in types:
        raise BadRequestError(f"{name} must be {allowed}, got {value!r}")
    if not isinstance(value, types):
        raise BadRequestError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}"[:300])
    return value


def check_token_ids(name: str, ids) -> list[int]:
    check_type(name, ids, (list,), "a list of token ids")
    if not ids:
        raise BadRequestError(f"{name} must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequestError(f"{name} must hold integers only")
    return ids


def parse_sampling_params(params: dict) -> SamplingParams:
    try:
        return SamplingParams.from_dict(params)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(str(exc)) from None


@dataclass
class GenerateReqInput:
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict = field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | None = None

    @classmethod
    def from_json(cls, body) -> "GenerateReqInput":
        if not isinstance(body, dict):
            raise BadRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise BadRequestError(f"unknown fields {unknown}; allowed: {known}")
        obj = cls(**body)
        obj.validate()
        return obj

    def validate(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise BadRequestError("give exactly one of 'text' and 'input_ids'")
        if self.text is not None:
            if isinstance(self.text, list):
                raise BadRequestError("batch requests (a list of prompts) are not supported; "
                                      "send one prompt per request")
            check_type("text", self.text, (str,), "a string")
            if not self.text:
                raise BadRequestError("text must not be empty")
        else:
            check_token_ids("input_ids", self.input_ids)
        check_type("sampling_params", self.sampling_params, (dict,), "a JSON object")
        check_type("stream", self.stream, (bool,), "true or false")
        check_type("return_logprob", self.return_logprob, (bool,), "true or false")
        check_type("top_logprobs_num", self.top_logprobs_num, (int,), "an integer >= 0")
        if self.top_logprobs_num < 0:
            raise BadRequestError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")
        if self.rid is not None:
            check_type("rid", self.rid, (str,), "a string")

    def parsed_sampling_params(self) -> SamplingParams:
        return parse_sampling_params(self.sampling_params)
