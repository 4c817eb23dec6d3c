"""Req: one request's state inside the scheduler.

KV bookkeeping (units: device token slots, int64 CPU tensors): the first ``kv_len`` tokens of
``origin_input_ids + output_ids`` have KV in the pool, at ``kv_indices``. Its leading
``prefix_indices`` belong to the radix tree (locked through ``last_node``); the rest are the
request's own pages, allocated one whole page at a time (the last one possibly part-filled).
The tree reads ``fill_ids``, ``kv_indices``, ``extra_key``, ``prefix_indices``, ``last_node``.

Token views are arrays or list slices, never per-token Python loops: the prompt is converted to
an int64 array once (``input_array``), ``prompt_key`` (the prompt but its last token, the part a
prefix match may cover) is built once, and ``cached_match`` carries the last match across steps
(``match_reuse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from sglang.srt.managers.io_struct import CacheTier, ReqOutput, TokenizedGenerateReqInput, empty_tier_counts
from sglang.srt.mem_cache.radix.radix_key import RadixKey, as_token_array
from sglang.srt.mem_cache.radix.tree_node import empty_indices


class FinishReason(str, Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"  # client went away, or the request was refused


@dataclass
class FinishInfo:
    reason: FinishReason
    matched: int | str | None = None
    message: str | None = None

    def to_json(self) -> dict:
        out = {"type": self.reason.value}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


def num_pages(tokens: int, page_size: int) -> int:
    return -(-max(tokens, 0) // page_size)


class Req:
    def __init__(self, msg: TokenizedGenerateReqInput, eos_token_ids: list[int]):
        self.rid = msg.rid
        self.origin_input_ids = list(msg.input_ids)
        self._input_array = None  # built on first use: a refused request never needs it
        self._prompt_key: RadixKey | None = None
        self.cached_match = None  # match_reuse.ReusableMatch of prompt_key, reused while current
        self.output_ids: list[int] = []
        self.sampling_params = msg.sampling_params
        self.seed = msg.sampling_params.sampling_seed if msg.sampling_params.sampling_seed is not None else msg.seed
        self.return_logprob = msg.return_logprob
        self.top_logprobs_num = msg.top_logprobs_num
        self.stream = msg.stream
        self.priority = msg.priority or 0  # kept by the tree for the priority eviction policy
        self.extra_key: str | None = None
        stop_ids = set(msg.sampling_params.stop_token_ids)
        if not msg.sampling_params.ignore_eos:
            stop_ids |= set(eos_token_ids)
        self.stop_token_ids = stop_ids
        # KV state
        self.req_pool_idx: int | None = None
        self.kv_indices = empty_indices()
        self.prefix_indices = empty_indices()
        self.last_node = None
        self.max_pages = 0  # own pages this request may still need, fixed at admission
        self.pages_allocated = 0
        # own-slot model state (Mamba / linear attention; managers/mamba_state.py): the request's
        # state slot (1-element tensor) and the slot its next forward starts from (-1: zeros)
        self.mamba_pool_idx: torch.Tensor | None = None
        self.mamba_src_idx: int = -1
        self.cached_tokens = empty_tier_counts()
        # outputs
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.sent = 0  # output tokens already reported
        self.finished: FinishInfo | None = None

    # ---- token views ---------------------------------------------------------------------
    @property
    def kv_len(self) -> int:
        return int(self.kv_indices.numel())

    def token_at(self, pos: int) -> int:
        n = len(self.origin_input_ids)
        return self.origin_input_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output (list slices, no per-token loop)."""
        n = len(self.origin_input_ids)
        if end <= n:
            return self.origin_input_ids[start:end]
        return self.origin_input_ids[start:] + self.output_ids[max(start - n, 0) : end - n]

    @property
    def input_array(self):
        """The prompt as a read-only int64 array (converted once)."""
        if self._input_array is None:
            self._input_array = as_token_array(self.origin_input_ids)
        return self._input_array

    @property
    def prompt_key(self) -> RadixKey:
        """The prompt but its last token, under the request's namespace (built once)."""
        key = self._prompt_key
        if key is None or key.extra_key != self.extra_key:
            key = self._prompt_key = RadixKey(self.input_array[:-1], self.extra_key)
        return key

    @property
    def fill_ids(self) -> np.ndarray:
        """Tokens whose KV is in the pool (int64, read-only; a view of the prompt while prefilling)."""
        n, p = self.kv_len, self.input_array.shape[0]
        if n <= p:
            return self.input_array[:n]
        return np.concatenate([self.input_array, np.asarray(self.output_ids[: n - p], dtype=np.int64)])

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens not computed yet."""
        return len(self.origin_input_ids) - self.kv_len

    @property
    def own_pages_left(self) -> int:
        return max(self.max_pages - self.pages_allocated, 0)

    def held_pages(self, page_size: int) -> torch.Tensor:
        """Device slots of the pages this request owns (whole pages), for integrity checks."""
        own = self.kv_indices[self.prefix_indices.numel():]
        if own.numel() == 0:
            return empty_indices()
        pages = torch.unique(own // page_size)
        return (pages.view(-1, 1) * page_size + torch.arange(page_size)).view(-1)

    # ---- lifecycle -----------------------------------------------------------------------
    def set_cached(self, device: int, host: int, storage: int) -> None:
        self.cached_tokens = {CacheTier.DEVICE.value: device, CacheTier.HOST.value: host,
                              CacheTier.STORAGE.value: storage}

    def finish(self, reason: FinishReason, matched=None, message: str | None = None) -> None:
        if self.finished is None:
            self.finished = FinishInfo(reason, matched, message)

    def check_finished(self, last_token: int, context_len: int, tail_text=None) -> None:
        """After appending ``last_token``: set ``finished`` when a stop condition holds.

        ``tail_text``: a callable returning the decoded end of the output (for stop strings).
        """
        params = self.sampling_params
        if last_token in self.stop_token_ids:
            self.finish(FinishReason.STOP, matched=last_token)
        elif params.stop and tail_text is not None:
            tail = tail_text(self)
            hit = next((s for s in params.stop if s in tail), None)
            if hit is not None:
                self.finish(FinishReason.STOP, matched=hit)
        if self.finished is None and (
            len(self.output_ids) >= params.max_new_tokens
            or len(self.origin_input_ids) + len(self.output_ids) >= context_len
        ):
            self.finish(FinishReason.LENGTH)

    def make_output(self) -> ReqOutput:
        """Tokens since the last output; advances ``sent``."""
        start, end = self.sent, len(self.output_ids)
        self.sent = end
        out = ReqOutput(
            rid=self.rid,
            token_ids=self.output_ids[start:end],
            finish=self.finished.to_json() if self.finished else None,
            prompt_tokens=len(self.origin_input_ids),
            cached_tokens=dict(self.cached_tokens),
        )
        if self.return_logprob:
            out.logprobs = self.logprobs[start:end]
            out.top_logprobs = self.top_logprobs[start:end] if self.top_logprobs_num else None
        return out

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, in={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"
