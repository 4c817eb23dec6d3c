"""ModelRunner: one rank's model, device KV pool, token allocator, request table, sampler.

A scheduler drives it per step: build a ``ForwardBatch`` (``init_extend`` / ``init_decode``),
call ``forward`` for the next-token logits, then ``sample``. See docs/engine.md.

Under ``--pp-size`` a runner holds one pipeline stage: its layers' weights and a KV pool of its
layers only (the same slots on every rank). ``forward`` receives the previous stage's hidden
states, runs its layers and sends them on; only the last stage has logits (the others return an
empty (batch, 0) placeholder), and ``sample`` hands the last stage's tokens to every stage.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.distributed import (
    destroy_model_parallel,
    get_attn_cp_group,
    init_distributed_environment,
    initialize_model_parallel,
    world_cpu_all_reduce_min,
)
from sglang.srt.distributed.pipeline import (
    PipelineStage,
    broadcast_from_last_stage,
    get_pp_indices,
    recv_proxy,
    send_proxy,
)
from sglang.srt.layers.attention.context_parallel_backend import (
    ContextParallelAttnBackend,
    forward_token_split,
    replicate_state_mixers,
)
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import Sampler, SamplerOutput
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool.req_to_token import ReqToTokenPool
from sglang.srt.mem_cache.pool_host.memory import available_host_bytes
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.srt.model_executor.model_loader import get_model
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or MemAvailable (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_bytes()


class ModelRunner:
    def __init__(self, config: ModelRunnerConfig):
        self.config = config
        self.tp_rank, self.tp_size = config.tp_rank, config.tp_size
        self.pp_rank, self.pp_size = config.pp_rank, config.pp_size
        self.page_size = config.page_size
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", config.rank)
        # Bad paths and configs fail here, before any rank waits on the others.
        self.model_config = ModelConfig.from_pretrained(
            config.model_path, config.dtype, self.device.type, config.context_length
        )
        check_pipeline_support(self.model_config, self.pp_size)
        self.attn_cp_rank, self.attn_cp_size = config.attn_cp_rank, config.attn_cp_size
        check_context_parallel_support(self.model_config, self.attn_cp_size)
        if config.world_size > 1:
            init_distributed_environment(config.world_size, config.rank, config.dist_init_method, self.device)
        initialize_model_parallel(config.tp_size, self.device, pipeline_model_parallel_size=config.pp_size,
                                  attn_context_parallel_size=config.attn_cp_size)
        self.dtype = self.model_config.dtype
        self.stage = PipelineStage.current(self.model_config.num_hidden_layers)
        self.model = get_model(self.model_config, config.load_format, self.device, config.seed)
        self._init_memory_pools()
        self.attn_backend = TorchNativeAttnBackend(self.device)
        if self.attn_cp_size > 1:  # this rank's share of the keys, partials combined over the CP group
            # tokens split over the CP ranks; linear-attention layers (a sequential state) run
            # on every token, replicated
            self.attn_backend = ContextParallelAttnBackend(self.device, self.page_size, get_attn_cp_group(),
                                                           token_split=True)
            replicated = replicate_state_mixers(self.model, self.attn_backend)
            logger.info("attention CP rank %d of %d: KV of pages p with p %% %d == %d; tokens split over the CP "
                        "ranks, %d linear-attention layers replicated", self.attn_cp_rank, self.attn_cp_size,
                        self.attn_cp_size, self.attn_cp_rank, replicated)
        self.sampler = Sampler()

    def _init_memory_pools(self) -> None:
        cfg, mc = self.config, self.model_config
        self.kv_pool_layout = layout = self._stage_kv_pool_layout()
        if cfg.max_total_tokens is not None:
            tokens = cfg.max_total_tokens
        else:
            per_token = layout.bytes_per_token(self.page_size)
            budget = int(available_memory_bytes(self.device) * cfg.mem_fraction_static)
            if layout.state is not None:  # the state pool comes out of the same budget
                tokens = cfg.state_pool_size.kv_tokens(budget, per_token, self.page_size, self._state_slot_bytes())
            else:
                tokens = max(budget, 0) // max(1, per_token)
            # More than every request slot at full context can never be in use at once.
            tokens = min(tokens, cfg.max_running_requests * mc.context_len)
        # Every rank (TP and PP) must hold the same slots: the scheduler's indices are shared.
        tokens = world_cpu_all_reduce_min([tokens])[0] // self.page_size * self.page_size
        if tokens < self.page_size:
            raise ValueError(f"KV pool would hold {tokens} tokens (< page_size {self.page_size}); free memory")
        self.max_total_num_tokens = tokens
        # The anchor holds the slots the tree tracks; sidecars use the same slots.
        self.token_to_kv_pool = layout.anchor.build(tokens, self.page_size, self.device)
        self.side_pools = {spec.kind: spec.build(tokens, self.page_size, self.device) for spec in layout.sidecars}
        self.state_pool = None
        if layout.state is not None:
            slots = cfg.state_pool_size.num_slots(tokens, layout.bytes_per_token(self.page_size), self.page_size,
                                                  self._state_slot_bytes())
            # pipeline stages differ in bytes per slot; the tree's state slot ids are shared
            slots = world_cpu_all_reduce_min([slots])[0]
            self.state_pool = layout.state.build(slots, 1, self.device)
            own = min(slots, cfg.max_running_requests)
            logger.info("state pool: %d slots, %d for running requests' own, %d for prefix checkpoints%s", slots,
                        own, slots - own, "" if own == cfg.max_running_requests else
                        f" (--max-mamba-cache-size {slots} caps the requests running at once to {slots})")
        self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(tokens, self.page_size, kvcache=self.token_to_kv_pool)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_running_requests, mc.context_len, self.device)
        logger.info(
            "KV pools: %d tokens (page %d), %s, %.1f MiB; %d request slots x context %d",
            tokens,
            self.page_size,
            " + ".join(p.kind.value for p in self.all_pools),
            sum(p.mem_usage_bytes() for p in self.all_pools) / 2**20,
            cfg.max_running_requests,
            mc.context_len,
        )

    def _stage_kv_pool_layout(self):
        """The pools of this stage's layers (all layers without pipeline parallelism)."""
        mc = self.model_config
        if self.pp_size == 1:
            return mc.kv_pool_layout(self.tp_size)
        hf = mc.model_class.pipeline_stage_hf_config(mc.hf_config, self.stage.start_layer, self.stage.end_layer)
        return mc.model_class.kv_pool_layout(hf, self.tp_size, mc.dtype)

    def _state_slot_bytes(self) -> int:
        """Bytes of one slot of the layout's state pool (model_executor/state_pool_size.py sizes it)."""
        return self.kv_pool_layout.state.build(1, 1, "meta").get_size_per_token()

    @property
    def all_pools(self) -> list:
        """Anchor, sidecars, then the state pool (what PD transfer and integrity checks walk)."""
        return [self.token_to_kv_pool, *self.side_pools.values(), *([self.state_pool] if self.state_pool else [])]

    @torch.no_grad()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Run the model on the batch's new tokens: writes their KV to ``out_cache_loc`` and
        returns next-token logits (batch_size, vocab_size) fp32, the same on every TP rank.
        A pipeline stage before the last sends its hidden states on and returns logits of
        shape (batch_size, 0): only the last stage samples (see ``sample``)."""
        counter = self.token_to_kv_pool.layer_transfer_counter
        if counter is not None:  # -1 too: a batch without loads must not wait on a stale set
            counter.set_consumer(forward_batch.hicache_consumer_index)
        self.attn_backend.init_forward_metadata(forward_batch)
        if getattr(self.attn_backend, "token_split", False):
            return forward_token_split(self.model, forward_batch, self.attn_backend)
        if self.pp_size == 1:
            return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        proxy = None
        if not self.stage.is_first:
            proxy = recv_proxy(forward_batch.input_ids.numel(), self.model_config.hf_config.hidden_size,
                               self.dtype, self.device)
        out = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch, pp_proxy_tensors=proxy)
        if self.stage.is_last:
            return out
        send_proxy(out)
        return LogitsProcessorOutput(next_token_logits=torch.empty((forward_batch.batch_size, 0)))

    def sample(
        self,
        logits_output: LogitsProcessorOutput,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
    ) -> SamplerOutput:
        """The next tokens (every rank the same; under pipeline parallelism the last stage
        samples and the others receive its output)."""
        out = None
        if self.stage.is_last:
            out = self.sampler(logits_output.next_token_logits, sampling_info, return_logprob, top_logprobs_nums)
        return broadcast_from_last_stage(out)

    def shutdown(self) -> None:
        """Leave the process group (more than one rank)."""
        destroy_model_parallel()


def check_pipeline_support(model_config: ModelConfig, pp_size: int) -> None:
    """ValueError unless ``model_config``'s architecture can be split over ``pp_size`` stages."""
    if pp_size == 1:
        return
    cls = model_config.model_class
    if not getattr(cls, "supports_pipeline_parallel", False):
        why = getattr(cls, "pipeline_unsupported_reason", "")
        raise ValueError(f"--pp-size {pp_size} is not supported for {model_config.architecture}: "
                         f"{why + '; ' if why else ''}only Llama, Qwen3, Qwen3-Next and DeepSeek-V2/V3/V3.2 build "
                         "one pipeline stage's layers and pools; use --pp-size 1")
    layers = model_config.num_hidden_layers
    if pp_size > layers:
        raise ValueError(f"--pp-size {pp_size} exceeds the model's {layers} layers; allowed: 1 to {layers}")
    for pp_rank in range(pp_size):  # every rank refuses the same split, before any waits on the others
        try:
            cls.pipeline_stage_hf_config(model_config.hf_config, *get_pp_indices(layers, pp_rank, pp_size))
        except ValueError as exc:
            raise ValueError(f"--pp-size {pp_size} is not supported for {model_config.architecture}: {exc}") from None


def check_context_parallel_support(model_config: ModelConfig, attn_cp_size: int) -> None:
    """ValueError unless ``model_config``'s attention can be split over ``attn_cp_size`` CP ranks
    (plain causal MHA/GQA: ``supports_attn_context_parallel``)."""
    if attn_cp_size == 1:
        return
    if not getattr(model_config.model_class, "supports_attn_context_parallel", False):
        raise ValueError(f"--attn-cp-size {attn_cp_size} is not supported for {model_config.architecture}: only "
                         "Llama, Qwen3 and Qwen3-Next (plain causal MHA/GQA over one KV pool; MLA, DSA, "
                         "DeepSeek-V4 and MiMo's sinks and windows are not split); use --attn-cp-size 1")
