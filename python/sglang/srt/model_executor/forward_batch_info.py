"""ForwardBatch: what one model forward needs, built by the scheduler from its requests.

Units: ``req_pool_indices`` are ReqToTokenPool rows; ``out_cache_loc`` and ``req_to_token``
entries are device token slots (``MHATokenToKVPool`` indices, from the token allocator);
lengths are tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto

import torch


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill: new tokens after a (possibly empty) cached prefix
    DECODE = auto()  # one new token per request

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # (num_tokens,) int64, device: the new tokens, request after request
    positions: torch.Tensor  # (num_tokens,) int64, device
    out_cache_loc: torch.Tensor  # (num_tokens,) int64, device: where the new tokens' KV goes
    req_pool_indices: torch.Tensor  # (batch_size,) int64, CPU
    seq_lens_cpu: list[int]  # prefix + new tokens, per request
    extend_prefix_lens_cpu: list[int]  # tokens whose KV is already in the pool
    extend_seq_lens_cpu: list[int]  # new tokens
    req_to_token_pool: object
    token_to_kv_pool: object
    attn_backend: object
    hicache_consumer_index: int = -1  # LayerDoneCounter slot to wait on; -1: nothing loading
    side_pools: dict = field(default_factory=dict)  # PoolKind -> sidecar pool (anchor's slots)
    state_pool: object = None  # own-slot state pool (Mamba), when the model has one
    mamba_slots: object = None  # linear_attention.StateSlots: per request, state slot to read / write

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Row of each request's last new token in ``input_ids``."""
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)

    @classmethod
    def init_extend(cls, model_runner, req_pool_indices, prefix_lens, input_ids, out_cache_loc, **kwargs):
        """Prefill ``input_ids[i]`` (the new tokens of request i) after ``prefix_lens[i]`` tokens
        whose slots the caller already wrote to ``req_to_token[req_pool_indices[i], :prefix_len]``.

        ``out_cache_loc`` holds the slots for all new tokens, request after request. Mutates
        ``req_to_token[r, prefix_len : prefix_len + len(input_ids[i])]`` to those slots.
        """
        new_lens = [len(ids) for ids in input_ids]
        flat_ids = [t for ids in input_ids for t in ids]
        return cls._build(
            model_runner, ForwardMode.EXTEND, req_pool_indices, prefix_lens, new_lens, flat_ids, out_cache_loc, kwargs
        )

    @classmethod
    def init_decode(cls, model_runner, req_pool_indices, input_ids, seq_lens, out_cache_loc, **kwargs):
        """One token per request: ``input_ids[i]`` sits at position ``seq_lens[i] - 1`` and its KV
        goes to ``out_cache_loc[i]``; mutates ``req_to_token[r, seq_lens[i] - 1]``."""
        prefix_lens = [n - 1 for n in seq_lens]
        return cls._build(
            model_runner,
            ForwardMode.DECODE,
            req_pool_indices,
            prefix_lens,
            [1] * len(input_ids),
            list(input_ids),
            out_cache_loc,
            kwargs,
        )

    @classmethod
    def _build(cls, runner, mode, req_pool_indices, prefix_lens, new_lens, flat_ids, out_cache_loc, kwargs):
        req_pool_indices = torch.as_tensor(req_pool_indices, dtype=torch.int64).cpu()
        out_cache_loc = torch.as_tensor(out_cache_loc, dtype=torch.int64)
        prefix_lens, seq_lens = list(prefix_lens), [p + n for p, n in zip(prefix_lens, new_lens)]
        _validate(runner, req_pool_indices, prefix_lens, new_lens, seq_lens, flat_ids, out_cache_loc)
        device = runner.device
        positions = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens)])
        out_cache_loc = out_cache_loc.to(device)
        offset = 0
        for r, p, s in zip(req_pool_indices.tolist(), prefix_lens, seq_lens):
            runner.req_to_token_pool.write((r, slice(p, s)), out_cache_loc[offset : offset + s - p])
            offset += s - p
        return cls(
            forward_mode=mode,
            batch_size=len(new_lens),
            input_ids=torch.tensor(flat_ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=list(new_lens),
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
            side_pools=getattr(runner, "side_pools", {}),
            state_pool=getattr(runner, "state_pool", None),
            **kwargs,
        )


def _validate(runner, req_pool_indices, prefix_lens, new_lens, seq_lens, flat_ids, out_cache_loc) -> None:
    bs = len(new_lens)
    if bs == 0:
        raise ValueError("a forward batch needs at least one request")
    if req_pool_indices.numel() != bs or len(prefix_lens) != bs:
        raise ValueError(
            f"req_pool_indices ({req_pool_indices.numel()}), prefix lens ({len(prefix_lens)}) and inputs ({bs}) "
            "must have one entry per request"
        )
    if min(new_lens) < 1 or min(prefix_lens) < 0:
        raise ValueError(f"every request needs >= 1 new token and a prefix >= 0; got {new_lens}, {prefix_lens}")
    if out_cache_loc.dim() != 1 or out_cache_loc.numel() != sum(new_lens):
        raise ValueError(f"out_cache_loc must hold one slot per new token ({sum(new_lens)}), got {out_cache_loc.numel()}")
    limit = runner.req_to_token_pool.max_context_len
    if max(seq_lens) > limit:
        raise ValueError(f"sequence length {max(seq_lens)} exceeds the context length {limit}")
    size = runner.req_to_token_pool.size
    if int(req_pool_indices.min()) < 0 or int(req_pool_indices.max()) >= size:
        raise ValueError(f"req_pool_indices must be in [0, {size}), got {req_pool_indices.tolist()}")
    vocab = runner.model_config.vocab_size
    if min(flat_ids) < 0 or max(flat_ids) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}), got min {min(flat_ids)}, max {max(flat_ids)}")
