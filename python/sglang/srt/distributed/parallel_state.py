"""Process groups for tensor, pipeline and attention context parallelism.

One ``GroupCoordinator`` describes a group: the TP group's ``device_group`` carries model
collectives (gloo on CPU, nccl on CUDA) and its ``cpu_group`` (always gloo) carries small
control-plane agreements such as the HiCache MIN all-reduces, so they never queue behind model
traffic. Before ``initialize_model_parallel`` the world is one rank and every collective is a
no-op, which is what single-process runs and tests use.

With ``--pp-size`` the world is ``tp_size x pp_size`` ranks, global rank
``pp_rank * tp_size + tp_rank`` (upstream's order): the TP group of a rank holds the ranks of its
pipeline stage, its PP group the ranks of every stage at its TP rank (hidden states travel
there, see ``pipeline.py``), and the world group (``get_world_group``, gloo only) carries the
scheduler's message broadcast and every agreement that all ranks holding one tree must reach.

With ``--attn-cp-size`` (not combined with ``--pp-size``) the grid is the same with CP in the
place of PP: global rank ``attn_cp_rank * tp_size + tp_rank``, the TP group of a rank holds one
CP rank's TP shards, its attention-CP group (``get_attn_cp_group``) the ranks holding the same
heads on every CP rank, over which the partial attentions are combined (``context_parallel.py``).
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
    ranks: tuple[int, ...] = (0,)  # global ranks of the group, in group-rank order

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last member."""
        return self.ranks[-1]


_TP = GroupCoordinator()
_PP = GroupCoordinator()
_CP = GroupCoordinator()
_WORLD = GroupCoordinator()


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


def initialize_model_parallel(tensor_model_parallel_size: int, device: str | torch.device = "cpu",
                              pipeline_model_parallel_size: int = 1, attn_context_parallel_size: int = 1) -> None:
    """Make the TP, PP, attention-CP and world groups over the default group, whose size must be
    ``tensor_model_parallel_size * pipeline_model_parallel_size * attn_context_parallel_size``
    (no data parallelism; PP and CP are not combined)."""
    global _TP, _PP, _CP, _WORLD
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, attn_context_parallel_size
    if pp > 1 and cp > 1:
        raise ValueError(f"pipeline_model_parallel_size {pp} with attn_context_parallel_size {cp} is not supported")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp * pp * cp != world:
        raise ValueError(
            f"tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp} x attn_context_parallel_size "
            f"{cp} must equal the world size {world}"
        )
    device = torch.device(device)
    if world == 1:
        _TP = _PP = _CP = _WORLD = GroupCoordinator(device=device)
        return
    rank = dist.get_rank()
    backend = backend_for_device(device)
    outer = pp * cp  # the stages or the CP ranks; the other dimension is 1
    # Every rank creates every group, in the same order (new_group is collective).
    tp_groups = [tuple(range(s * tp, (s + 1) * tp)) for s in range(outer)]
    outer_groups = [tuple(range(t, world, tp)) for t in range(tp)]
    _PP = _CP = GroupCoordinator(device=device)
    for kind, groups in (("tp", tp_groups), ("pp" if pp > 1 else "cp", outer_groups)):
        for ranks in groups:
            device_group = dist.new_group(list(ranks), backend=backend) if len(ranks) > 1 else None
            cpu_group = dist.new_group(list(ranks), backend="gloo") if len(ranks) > 1 else None
            if rank in ranks:
                coord = GroupCoordinator(ranks.index(rank), len(ranks), device_group, cpu_group, device, ranks)
                if kind == "tp":
                    _TP = coord
                elif kind == "pp":
                    _PP = coord
                else:
                    _CP = coord
    world_cpu = dist.new_group(list(range(world)), backend="gloo")
    _WORLD = GroupCoordinator(rank, world, None, world_cpu, device, tuple(range(world)))


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline group (one rank per stage, at this rank's TP rank)."""
    return _PP


def get_attn_cp_group() -> GroupCoordinator:
    """This rank's attention context-parallel group (one rank per CP rank, at this TP rank)."""
    return _CP


def get_world_group() -> GroupCoordinator:
    """Every rank of the server (``cpu_group`` only: control-plane broadcasts and agreements)."""
    return _WORLD


def get_pipeline_model_parallel_rank() -> int:
    return _PP.rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return _PP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def destroy_model_parallel() -> None:
    """Forget the TP, PP, attention-CP and world groups and leave the default process group (if any)."""
    global _TP, _PP, _CP, _WORLD
    _TP, _PP, _CP, _WORLD = GroupCoordinator(), GroupCoordinator(), GroupCoordinator(), GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
