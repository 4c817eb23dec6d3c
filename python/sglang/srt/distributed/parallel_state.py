"""Process groups for tensor parallelism.

One ``GroupCoordinator`` describes the TP group: its ``device_group`` carries model
collectives (gloo on CPU, nccl on CUDA) and its ``cpu_group`` (always gloo) carries small
control-plane agreements such as the HiCache MIN all-reduces, so they never queue behind model
traffic. Before ``initialize_model_parallel`` the world is one rank and every collective is a
no-op, which is what single-process runs and tests use.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Device type -> torch.distributed backend for model collectives.
BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


@dataclass
class GroupCoordinator:
    """A process group seen from one rank. ``device_group``/``cpu_group`` are None when
    ``world_size == 1``."""

    rank_in_group: int = 0
    world_size: int = 1
    device_group: object = None
    cpu_group: object = None
    device: torch.device = torch.device("cpu")

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0


_TP = GroupCoordinator()


def backend_for_device(device: str | torch.device) -> str:
    device_type = torch.device(device).type
    if device_type not in BACKEND_BY_DEVICE:
        raise ValueError(f"no distributed backend for device {device_type!r}; supported: {sorted(BACKEND_BY_DEVICE)}")
    return BACKEND_BY_DEVICE[device_type]


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    device: str | torch.device = "cpu",
    timeout_s: float = 300.0,
) -> None:
    """Join the default process group (idempotent). ``init_method`` is e.g.
    ``tcp://127.0.0.1:29500``; the backend follows the device (see ``BACKEND_BY_DEVICE``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"process group already initialized with world size {dist.get_world_size()}")
        return
    backend = backend_for_device(device)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    logger.info("init process group: backend=%s rank=%d/%d via %s", backend, rank, world_size, init_method)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def initialize_model_parallel(tensor_model_parallel_size: int, device: str | torch.device = "cpu") -> None:
    """Make the TP group: all ranks of the default group (only TP is supported)."""
    global _TP
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tensor_model_parallel_size != world:
        raise ValueError(
            f"tensor_model_parallel_size {tensor_model_parallel_size} must equal the world size {world} "
            "(only tensor parallelism is supported)"
        )
    if world == 1:
        _TP = GroupCoordinator(device=torch.device(device))
        return
    ranks = list(range(world))
    device_group = dist.new_group(ranks, backend=backend_for_device(device))
    cpu_group = dist.new_group(ranks, backend="gloo")
    _TP = GroupCoordinator(dist.get_rank(), world, device_group, cpu_group, torch.device(device))


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def destroy_model_parallel() -> None:
    """Forget the TP group and leave the default process group (if any)."""
    global _TP
    _TP = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
