"""Messages between the HTTP process (tokenizer manager) and the scheduler processes.

Requests flow tokenizer manager -> scheduler rank 0 -> every rank (broadcast); outputs flow
scheduler rank 0 -> tokenizer manager. Everything here is a small picklable dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from sglang.srt.sampling.sampling_params import SamplingParams


class CacheTier(str, Enum):
    """Where a reused prefix token came from."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


def empty_tier_counts() -> dict[str, int]:
    return {t.value: 0 for t in CacheTier}


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    seed: int | None = None  # noise seed; rank 0 draws one when sampling_seed is unset
    priority: int | None = None  # eviction priority of the request's prefix (--radix-eviction-policy priority)
    # PD serving (set by sglang-router --pd-disaggregation; None on a normal server)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass
class AbortReq:
    rid: str


class ControlKind(str, Enum):
    FLUSH_CACHE = "flush_cache"
    GET_STATS = "get_stats"
    # runtime L3 attach/detach (managers/storage_admin.py); payload: the request's fields
    ATTACH_HICACHE_STORAGE = "attach_hicache_storage"
    DETACH_HICACHE_STORAGE = "detach_hicache_storage"
    GET_HICACHE_STORAGE = "get_hicache_storage"


@dataclass
class ControlReq:
    cid: int
    kind: ControlKind
    payload: dict = field(default_factory=dict)


@dataclass
class ControlOutput:
    cid: int
    ok: bool
    message: str = ""
    payload: dict = field(default_factory=dict)


@dataclass
class ShutdownReq:
    pass


@dataclass
class ReqOutput:
    """New tokens of one request since its last output (all of them when ``finish`` is set)."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish: dict | None = None  # {"type": "length"|"stop"|"abort", ...}; None while running
    prompt_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=empty_tier_counts)


@dataclass
class BatchOutput:
    outputs: list[ReqOutput]


@dataclass
class SchedulerReady:
    """Sent once per rank after start-up: what the HTTP side must know about the engine."""

    tp_rank: int
    info: dict


@dataclass
class SchedulerError:
    """Start-up failure or a fatal error in the loop; the server stops serving."""

    tp_rank: int
    message: str
