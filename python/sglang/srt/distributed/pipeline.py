"""Pipeline parallelism (``--pp-size``): which layers a stage holds and how stages talk.

A model of L layers is cut into ``pp_size`` contiguous ranges (``get_pp_indices``, upstream's
rule: ``L // pp_size`` layers each, the last ``L % pp_size`` stages one more). The first stage
holds the embedding, the last the final norm and the LM head; a part a stage does not hold is a
``PPMissingLayer`` (no parameters). One forward pass runs stage after stage: a stage receives
the hidden states and the residual of its predecessor (``PPProxyTensors``), runs its layers and
sends both on (``send_proxy`` / ``recv_proxy`` over the PP group's device group: gloo on CPU,
nccl on CUDA). No micro-batching: a stage waits while the others compute.

Only the last stage samples; ``broadcast_from_last_stage`` gives every stage its tokens, so all
ranks run the same scheduler on the same inputs and make the same decisions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sglang.srt.distributed.parallel_state import get_pp_group

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the layers stage ``pp_rank`` holds: ``num_hidden_layers // pp_size``
    each, one more on each of the last ``num_hidden_layers % pp_size`` stages (upstream's rule).
    ValueError when a stage would hold no layer or the rank is out of range."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, pp_size={pp_size}), got {pp_rank}")
    if num_hidden_layers < pp_size:
        raise ValueError(f"--pp-size {pp_size} exceeds the model's {num_hidden_layers} layers; "
                         f"allowed: 1 to {num_hidden_layers} (every stage holds at least one layer)")
    base, extra = divmod(num_hidden_layers, pp_size)
    first_long = pp_size - extra  # stages from here on hold base + 1 layers
    if pp_rank < first_long:
        start = pp_rank * base
        return start, start + base
    start = first_long * base + (pp_rank - first_long) * (base + 1)
    return start, start + base + 1


@dataclass(frozen=True)
class PipelineStage:
    """One stage's place: its layer range and whether it holds the embedding / the head."""

    pp_rank: int
    pp_size: int
    start_layer: int
    end_layer: int

    @classmethod
    def current(cls, num_hidden_layers: int) -> PipelineStage:
        """The stage of this process (from the PP group; the whole model without one)."""
        group = get_pp_group()
        start, end = get_pp_indices(num_hidden_layers, group.rank_in_group, group.world_size)
        return cls(group.rank_in_group, group.world_size, start, end)

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def owns_weight(self, name: str, tied_embeddings: bool, lm_head_name: str = "lm_head") -> bool:
        """Whether the checkpoint tensor ``name`` (an HF name) is loaded on this stage: its own
        layers, the embedding on the first stage (and on the last when tied: it is the head),
        the final norm and the head on the last; any other name on every stage."""
        m = _LAYER_NAME.match(name)
        if m is not None:
            return self.start_layer <= int(m.group(1)) < self.end_layer
        if name.startswith("model.embed_tokens."):
            return self.is_first or (tied_embeddings and self.is_last)
        if name.startswith(("model.norm.", f"{lm_head_name}.")):
            return self.is_last
        return True


class PPMissingLayer(nn.Module):
    """A part of the model another stage holds (upstream's name): no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model lives on another pipeline stage")


@dataclass
class PPProxyTensors:
    """What one stage hands the next: hidden states and residual, each (num_tokens, hidden)."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


def send_proxy(proxy: PPProxyTensors) -> None:
    """Send ``proxy`` to the next stage (one tensor: hidden states stacked on the residual)."""
    group = get_pp_group()
    packed = torch.stack([proxy.hidden_states, proxy.residual]).contiguous()
    dist.send(packed, dst=group.ranks[group.rank_in_group + 1], group=group.device_group)


def recv_proxy(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> PPProxyTensors:
    """Receive the previous stage's hidden states and residual for ``num_tokens`` tokens."""
    group = get_pp_group()
    packed = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    dist.recv(packed, src=group.ranks[group.rank_in_group - 1], group=group.device_group)
    return PPProxyTensors(packed[0], packed[1])


def broadcast_from_last_stage(obj):
    """``obj`` as the last stage holds it, on every stage (picklable; the PP group's gloo group).
    The last stage passes its value, the others anything (ignored)."""
    group = get_pp_group()
    if group.world_size == 1:
        return obj
    box = [obj if group.is_last_rank else None]
    dist.broadcast_object_list(box, src=group.last_rank, group=group.cpu_group)
    return box[0]
