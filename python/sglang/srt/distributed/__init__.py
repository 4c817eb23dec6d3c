"""Tensor- and pipeline-parallel process groups and collectives (gloo on CPU, nccl on CUDA)."""

from sglang.srt.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_cpu_all_reduce_min,
    tensor_model_parallel_cpu_gather_objects,
    world_cpu_all_reduce_min,
    world_cpu_gather_objects,
)
from sglang.srt.distributed.parallel_state import (
    GroupCoordinator,
    destroy_model_parallel,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_attn_cp_group,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
)

__all__ = [
    "GroupCoordinator",
    "destroy_model_parallel",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_attn_cp_group",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_cpu_all_reduce_min",
    "tensor_model_parallel_cpu_gather_objects",
    "world_cpu_all_reduce_min",
    "world_cpu_gather_objects",
]
