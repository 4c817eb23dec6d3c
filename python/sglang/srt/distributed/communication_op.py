"""Collectives over the tensor-parallel group (and the world group, for agreements every rank
of the server must reach); identity when the group has one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sglang.srt.distributed.parallel_state import get_tp_group, get_world_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over TP ranks (in place when there is more than one rank); returns the sum."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    dist.all_reduce(x, group=group.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x.contiguous(), group=group.device_group)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_cpu_all_reduce_min(values: list[int]) -> list[int]:
    """MIN-reduce small integers over the TP group's gloo group (control-plane agreement)."""
    return _cpu_all_reduce_min(get_tp_group(), values)


def tensor_model_parallel_cpu_gather_objects(obj) -> list:
    """Every TP rank's ``obj`` (picklable), in rank order, on every rank (gloo group)."""
    return _cpu_gather_objects(get_tp_group(), obj)


def world_cpu_all_reduce_min(values: list[int]) -> list[int]:
    """MIN-reduce small integers over every rank of the server (TP x PP; gloo), e.g. the KV
    slots every rank must hold alike."""
    return _cpu_all_reduce_min(get_world_group(), values)


def world_cpu_gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in global rank order, on every rank (gloo)."""
    return _cpu_gather_objects(get_world_group(), obj)


def _cpu_all_reduce_min(group, values: list[int]) -> list[int]:
    if group.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return t.tolist()


def _cpu_gather_objects(group, obj) -> list:
    if group.world_size == 1:
        return [obj]
    out = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out
