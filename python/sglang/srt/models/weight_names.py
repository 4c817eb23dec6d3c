"""Map HF checkpoint tensors onto a model's (fused, sharded) parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# Tensors some checkpoints carry that hold no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, parameter {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def _target(name: str, stacked_params_mapping) -> tuple[str, object]:
    for param_part, weight_part, shard_id in stacked_params_mapping:
        if weight_part in name:
            return name.replace(weight_part, param_part), shard_id
    return name, None


def _listing(names) -> str:
    names = sorted(names)
    return f"{names[:5]}{' ...' if len(names) > 5 else ''} ({len(names)} total)"


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    expected_shapes: dict[str, tuple[int, ...]],
    stacked_params_mapping,
) -> None:
    """Copy each ``(hf_name, full_tensor)`` into its parameter through the parameter's
    ``weight_loader`` (which keeps this rank's shard). Every name in ``expected_shapes`` must
    arrive exactly with that shape; anything else raises ValueError listing the names."""
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    seen, unexpected = set(), []
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name not in expected_shapes:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(expected_shapes[name]):
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(tensor.shape)}, config implies {expected_shapes[name]}"
            )
        param_name, shard_id = _target(name, stacked_params_mapping)
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        seen.add(name)
    missing = set(expected_shapes) - seen
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing weights {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected weights {_listing(unexpected)}")
        raise ValueError(f"checkpoint does not match {type(model).__name__}: " + "; ".join(parts))
