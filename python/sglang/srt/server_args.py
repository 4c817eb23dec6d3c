"""ServerArgs: every flag of ``python -m sglang.launch_server``, in one dataclass.

The dataclass is the one source of defaults: ``add_cli_args`` builds the argparse parser from
its fields (``--model-path`` for ``model_path``), and ``from_cli_args`` builds it back.
``__post_init__`` validates each field and each combination; an error names the flag, the
value and what is allowed. It makes two rewrites: upstream's, ``--hicache-io-backend direct``
with ``--hicache-mem-layout page_first`` becomes ``page_first_direct`` (warning), and
``--disaggregation-decode-enable-offload-kvcache`` turns on ``--enable-hierarchical-cache``
(the host tier is that offload's staging buffer; upstream builds a separate one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property

from sglang.srt.mem_cache.controller.hicache_config import (
    DEFAULT_HICACHE_RATIO,
    DEFAULT_PREFETCH_POLICY,
    PrefetchPolicy,
    WritePolicy,
)
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.srt.model_executor.state_pool_size import DEFAULT_MAMBA_FULL_MEMORY_RATIO

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")  # upstream's choices (EvictionPolicy: checked in a test)
HOST_MEMORY_MODES = ("cache", "buffer_only")
NPU_ONLY_LAYOUT = "page_first_kv_split"  # upstream's Ascend layout: accepted as a choice, refused with the reason
SCHEDULE_POLICIES = ("fcfs", "lpm", "lof", "random")  # managers.schedule_policy.SchedulePolicy (checked in a test)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("nixl", "mooncake")


def _choices(enum_cls) -> tuple[str, ...]:
    return tuple(m.value for m in enum_cls)


def _flag(help: str, choices: tuple | None = None, **extra) -> dict:
    return {"help": help, "choices": choices, **extra}


def opt(default, help: str, choices: tuple | None = None, **extra):
    """A dataclass field carrying its CLI help and choices."""
    return field(default=default, metadata=_flag(help, choices, **extra))


@dataclass
class ServerArgs:
    # model and runtime
    model_path: str = opt(None, "HF-format model directory (config.json, *.safetensors, tokenizer.json)", required=True)
    load_format: str = opt("auto", "weights: from safetensors, or random from config.json (dummy)", LOAD_FORMATS)
    device: str = opt("cpu", "device of the model and the KV pool", DEVICES)
    dtype: str = opt("auto", "model and KV dtype; auto: float32 on CPU, the checkpoint's on CUDA", DTYPES)
    tp_size: int = opt(1, "tensor parallel ranks (one process each)")
    pp_size: int = opt(1, "pipeline parallel stages: contiguous layer ranges, one stage per tp_size ranks, so "
                       "tp_size x pp_size processes (docs/engine.md, Parallelism)")
    attn_cp_size: int = opt(1, "attention context parallel ranks: each runs and caches the tokens of every "
                            "attn_cp_size-th page of a sequence and attends all queries over its share, partials "
                            "combined across ranks; tp_size x attn_cp_size processes (docs/engine.md, Parallelism)")
    context_length: int | None = opt(None, "max tokens per request (prompt + output); default: the model's")
    served_model_name: str | None = opt(None, "model id reported by /v1/models; default: the directory name")
    tokenizer_path: str | None = opt(None, "directory with tokenizer.json (and tokenizer_config.json); "
                                     "default: --model-path")
    trust_remote_code: bool = opt(False, "accepted for upstream compatibility; no effect (models are in-tree)")
    random_seed: int = opt(0, "seed of dummy weights")
    # memory and scheduling
    page_size: int = opt(1, "tokens per KV page (tree, host pool and storage granularity)")
    max_total_tokens: int | None = opt(None, "device KV pool size in tokens; default: from free memory")
    mem_fraction_static: float = opt(0.8, "fraction of free memory for the KV pool when --max-total-tokens is unset")
    max_running_requests: int = opt(64, "requests in flight at once (request table rows)")
    chunked_prefill_size: int = opt(2048, "max prefill tokens per step; -1 disables chunking")
    disable_radix_cache: bool = opt(False, "no prefix reuse: every prompt is computed from scratch")
    mamba_track_interval: int = opt(256, "state models: also checkpoint the linear-attention state every this "
                                    "many tokens (rounded to a multiple of --page-size); branch points and the "
                                    "last page of each prefill are always checkpointed")
    max_mamba_cache_size: int | None = opt(None, "state models: slots of the device state pool in all (running "
                                           "requests' own plus prefix checkpoints); fewer than "
                                           "--max-running-requests caps the requests running at once; default: "
                                           "sized by --mamba-full-memory-ratio")
    mamba_full_memory_ratio: float = opt(DEFAULT_MAMBA_FULL_MEMORY_RATIO, "state models without --max-mamba-cache-size: the state pool's "
                                         "checkpoint share, in bytes, is this ratio of the device KV pool's (at "
                                         "most one state per KV page), beside one slot per running request")
    radix_eviction_policy: str = opt("lru", "which unlocked prefix leaves the device first: lru (least recently "
                                     "used), lfu (least frequently used), slru (segmented LRU: prefixes hit fewer "
                                     "than protected_threshold times go first), priority (lower request priority "
                                     "first, then LRU); tlru is upstream's and refused here", EVICTION_POLICIES)
    radix_eviction_policy_config: str | None = opt(None, "parameters of --radix-eviction-policy as a JSON object, "
                                                   "e.g. '{\"protected_threshold\": 4}' for slru")
    schedule_policy: str = opt("fcfs", "order in which waiting requests are admitted: fcfs (arrival), lpm (longest "
                               "cached prefix first), lof (longest output first), random", SCHEDULE_POLICIES)
    schedule_conservativeness: float = opt(1.0, "scales the decode tokens reserved per admitted request (>= 1.0: "
                                           "running requests are never retracted, so never less than they may need)")
    # HTTP
    host: str = opt("127.0.0.1", "address to bind")
    port: int = opt(30000, "port to bind")
    log_level: str = opt("info", "logging level", LOG_LEVELS)
    api_key: str | None = opt(None, "API key of the server (also of the OpenAI routes): requests need 'Authorization: "
                              "Bearer KEY'; /health* and /metrics stay open (docs/server.md, Security)")
    admin_api_key: str | None = opt(None, "admin API key: the cache and storage routes (/flush_cache, L3 attach, detach, "
                                    "status, clear) need 'Authorization: Bearer KEY' and do not accept --api-key; "
                                    "without it they are refused (403)")
    enable_metrics: bool = opt(False, "accepted for upstream compatibility; /metrics is always served")
    enable_cache_report: bool = opt(False, "accepted for upstream compatibility; OpenAI usage always reports "
                                    "prompt_tokens_details.cached_tokens")
    # HiCache
    enable_hierarchical_cache: bool = opt(False, "keep evicted prefixes in a host pool (L2) and load them back")
    hicache_host_memory_mode: str = opt("cache", "host memory as a HiCache tier (cache); buffer_only (upstream's "
                                        "staging buffer to L3, implemented upstream only for its unified radix "
                                        "tree) is refused here", HOST_MEMORY_MODES)
    hicache_ratio: float | None = opt(None, f"host pool size as a multiple of the device pool (when --hicache-size "
                                      f"is 0); unset: {DEFAULT_HICACHE_RATIO}, lowered until the host pools fit "
                                      "--hicache-host-memory-fraction")
    hicache_size: float = opt(0.0, "host pool size in GB per rank; overrides --hicache-ratio when > 0")
    hicache_host_memory_fraction: float = opt(
        0.8, "fraction of the available host memory (MemAvailable bounded by the cgroup limits, less a reserve "
        "of min(10 GiB, a fifth of it)) that the host pools of all ranks on this machine may use; applies only "
        "when neither --hicache-ratio nor --hicache-size is given; lower it when several servers share the host")
    hicache_write_policy: str = opt("write_through", "when a device prefix gets its host copy", _choices(WritePolicy))
    hicache_io_backend: str | None = opt(None, "host<->device copies; default: kernel on CUDA, direct on CPU",
                                         _choices(IOBackend))
    hicache_mem_layout: str = opt("layer_first", "host pool layout (page_first_kv_split, upstream's Ascend NPU "
                                  "layout, is refused here)", _choices(HostLayout) + (NPU_ONLY_LAYOUT,))
    hicache_storage_backend: str | None = opt(None, "L3 storage backend, a name known to StorageBackendFactory "
                                              "(file, nixl, dynamic, ...); needs --enable-hierarchical-cache")
    hicache_storage_prefetch_policy: str = opt(DEFAULT_PREFETCH_POLICY.value,
                                               "when a request stops waiting for its L3 prefetch",
                                               _choices(PrefetchPolicy))
    hicache_storage_prefetch_retry_poll_interval: int = opt(
        8, "scheduling passes after which a queued request's L3 existence check that found nothing (its pages may "
        "still be landing: a backup in flight) is issued again; only requests waiting behind others are "
        "re-checked, the head of the queue never waits for one; 0: misses are not retried")
    hicache_storage_prefetch_retry_max_attempts: int = opt(
        8, "re-issued L3 existence checks per queued request; past it the request runs with what the device "
        "and host hold; 0: none")
    hicache_storage_backend_extra_config: str | None = opt(
        None, "backend options: a JSON object, or @path to a .json, .yaml, .yml or .toml file")
    hicache_storage_roots: str | None = opt(None, "directories (comma-separated, existing) under which a runtime "
                                            "attach may place L3 storage, besides the startup storage directory; "
                                            "an attach naming any other directory is refused")
    disable_hicache_numa_detect: bool = opt(False, "accepted for upstream compatibility; no effect (host pools "
                                            "are not NUMA-bound here)")
    # prefill/decode disaggregation (docs/pd_transfer.md)
    disaggregation_mode: str = opt("null", "null: a normal server; prefill / decode: one half of a PD deployment "
                                   "behind sglang-router --pd-disaggregation", DISAGGREGATION_MODES)
    disaggregation_transfer_backend: str = opt("nixl", "KV transfer engine between prefill and decode (both "
                                               "sides must agree; docs/pd_transfer.md, Transports)",
                                               DISAGGREGATION_TRANSFER_BACKENDS)
    disaggregation_bootstrap_port: int = opt(8998, "port of the bootstrap server a prefill server hosts (give it "
                                             "to the router after the prefill URL)")
    disaggregation_ib_device: str | None = opt(None, "mooncake: the RDMA device(s) of its transfer engine, "
                                               "e.g. mlx5_0 (default: Mooncake chooses); nixl: no effect, UCX "
                                               "picks the network devices itself (set UCX_NET_DEVICES)")
    disaggregation_decode_enable_offload_kvcache: bool = opt(
        False, "decode: write the KV of every finished request (prompt and generated tokens, whole pages) to "
        "the L3 storage of --hicache-storage-backend, under the keys a prefill server computes, so the next "
        "turn's prefill on a server sharing that storage finds it; turns on this server's host tier "
        "(write_through) as the staging buffer (docs/pd_transfer.md, Decode-side offload)")
    # KV cache events for KV-aware routers (docs/server.md, KV cache events)
    kv_events_config: str | None = opt(None, "publish the tree's KV cache events: a JSON object, e.g. "
                                       "'{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' "
                                       "(publishers: null, zmq; see disaggregation.kv_events.KVEventsConfig)")

    def __post_init__(self):
        self._check_ranges()
        self._check_choices()
        self._check_layout()
        self._check_eviction()
        self._resolve_decode_offload()
        self._check_hicache()
        self._check_host_memory_mode()
        self._check_pipeline()
        self._check_context_parallel()
        self._check_disaggregation()
        self._check_kv_events()

    # ---- validation ----------------------------------------------------------------------
    def _check_ranges(self) -> None:
        checks = [
            ("model_path", isinstance(self.model_path, str) and bool(self.model_path), "a directory path"),
            ("tp_size", self.tp_size >= 1, "an integer >= 1"),
            ("pp_size", self.pp_size >= 1, "an integer >= 1"),
            ("attn_cp_size", self.attn_cp_size >= 1, "an integer >= 1"),
            ("context_length", self.context_length is None or self.context_length >= 1, "unset or >= 1"),
            ("page_size", self.page_size >= 1, "an integer >= 1"),
            ("max_total_tokens", self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             f"unset or >= --page-size ({self.page_size})"),
            ("mem_fraction_static", 0 < self.mem_fraction_static <= 1, "in (0, 1]"),
            ("max_running_requests", self.max_running_requests >= 1, "an integer >= 1"),
            ("chunked_prefill_size", self.chunked_prefill_size == -1 or self.chunked_prefill_size >= self.page_size,
             f"-1 (no chunking) or >= --page-size ({self.page_size})"),
            ("mamba_track_interval", self.mamba_track_interval >= 1, "an integer >= 1"),
            ("max_mamba_cache_size", self.max_mamba_cache_size is None or self.max_mamba_cache_size >= 1,
             "unset or an integer >= 1"),
            ("mamba_full_memory_ratio", self.mamba_full_memory_ratio >= 0, "a number >= 0"),
            ("port", 1 <= self.port <= 65535, "in [1, 65535]"),
            ("schedule_conservativeness", 1.0 <= self.schedule_conservativeness <= 100.0, "in [1.0, 100.0]"),
            ("hicache_size", self.hicache_size >= 0, "a number of GB >= 0"),
            ("hicache_ratio", self.hicache_size > 0 or self.hicache_ratio is None or self.hicache_ratio > 0,
             "> 0 when --hicache-size is 0"),
            ("hicache_host_memory_fraction", 0 < self.hicache_host_memory_fraction <= 1, "in (0, 1]"),
            ("hicache_storage_prefetch_retry_poll_interval", self.hicache_storage_prefetch_retry_poll_interval >= 0,
             "an integer >= 0"),
            ("hicache_storage_prefetch_retry_max_attempts", self.hicache_storage_prefetch_retry_max_attempts >= 0,
             "an integer >= 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{flag_name(name)} {getattr(self, name)!r} is invalid; must be {allowed}")

    def _check_choices(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{flag_name(f.name)} {value!r} is not allowed; choose one of: {', '.join(choices)}")

    def _check_layout(self) -> None:
        if self.hicache_mem_layout == NPU_ONLY_LAYOUT:
            raise ValueError(f"--hicache-mem-layout {NPU_ONLY_LAYOUT} is refused: it is upstream's Ascend NPU layout "
                             "(separate K and V host buffers moved by the kernel_ascend IO backend); this server "
                             "runs on CPU and CUDA. Use page_first_direct (page-major, moved and stored page by "
                             "page) or layer_first")

    def _check_eviction(self) -> None:
        from sglang.srt.mem_cache.evict_policy import TLRU_REFUSED, EvictionPolicy, check_policy_config

        policy = EvictionPolicy.parse(self.radix_eviction_policy)
        if policy is EvictionPolicy.TLRU:
            raise ValueError(f"--radix-eviction-policy tlru is refused: {TLRU_REFUSED}")
        try:
            check_policy_config(policy, self.eviction_policy_config)
        except ValueError as exc:
            raise ValueError(f"--radix-eviction-policy-config: {exc}") from None

    def _resolve_decode_offload(self) -> None:
        """--disaggregation-decode-enable-offload-kvcache: decode only, with an L3 backend; it
        implies --enable-hierarchical-cache (upstream does not ask for it either): the host tier
        is the staging buffer of the device -> host -> L3 write (docs/pd_transfer.md)."""
        if not self.disaggregation_decode_enable_offload_kvcache:
            return
        flag = "--disaggregation-decode-enable-offload-kvcache"
        if self.disaggregation_mode != "decode":
            raise ValueError(f"{flag} is only for --disaggregation-mode decode, not {self.disaggregation_mode!r}: "
                             "a prefill or plain server writes its KV to L3 with --enable-hierarchical-cache "
                             "--hicache-storage-backend")
        if self.hicache_storage_backend is None:
            raise ValueError(f"{flag} needs --hicache-storage-backend: the decode server writes finished KV to "
                             "that L3 storage, which the prefill servers must share")
        if self.disable_radix_cache:
            raise ValueError(f"{flag} needs the radix cache (its pages are keyed by the tree's page hashes); "
                             "drop --disable-radix-cache")
        if self.hicache_write_policy != WritePolicy.WRITE_THROUGH.value:
            raise ValueError(f"{flag} needs --hicache-write-policy write_through, not "
                             f"{self.hicache_write_policy!r}: a finished request's pages are copied to the host "
                             "tier and on to L3 when it ends; the other policies copy only on repeated hits or "
                             "on eviction, after the next turn's prefill looked")
        if not self.enable_hierarchical_cache:
            logger.info("%s: enabling the host tier (--enable-hierarchical-cache) as its staging buffer", flag)
            self.enable_hierarchical_cache = True

    def _check_hicache(self) -> None:
        if not self.enable_hierarchical_cache:
            for name in ("hicache_storage_backend", "hicache_storage_backend_extra_config", "hicache_storage_roots"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{flag_name(name)} needs --enable-hierarchical-cache")
            return
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache")
        if self.resolved_io_backend == "direct" and self.hicache_mem_layout == "page_first":
            logger.warning("--hicache-io-backend direct cannot use --hicache-mem-layout page_first; "
                           "using page_first_direct")
            self.hicache_mem_layout = "page_first_direct"
        self._check_io_cell()
        if self.hicache_storage_backend is not None:
            from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

            known = StorageBackendFactory.known_backends()
            if self.hicache_storage_backend not in known:
                raise ValueError(f"--hicache-storage-backend {self.hicache_storage_backend!r} is not allowed; "
                                 f"choose one of: {', '.join(known)}")
        if self.hicache_storage_backend_extra_config is not None and self.hicache_storage_backend is None:
            raise ValueError("--hicache-storage-backend-extra-config needs --hicache-storage-backend")
        self.storage_extra_config  # parse now: a bad value stops the server at startup
        for root in self.storage_roots:
            if not os.path.isabs(root) or not os.path.isdir(root):
                raise ValueError(f"--hicache-storage-roots {root!r} is invalid; each entry must be an existing "
                                 "directory given by its absolute path")

    def _check_host_memory_mode(self) -> None:
        """buffer_only: upstream's prerequisites first (the most useful error), then our refusal."""
        if self.hicache_host_memory_mode == "cache":
            return
        flag = f"--hicache-host-memory-mode {self.hicache_host_memory_mode}"
        if not self.enable_hierarchical_cache:
            raise ValueError(f"{flag} needs --enable-hierarchical-cache")
        if self.hicache_storage_backend is None:
            raise ValueError(f"{flag} needs --hicache-storage-backend: host memory is then only a staging buffer "
                             "and every cached page lives in storage")
        if self.disaggregation_mode == "decode":
            raise ValueError(f"{flag} is not supported with --disaggregation-mode decode (upstream refuses it too)")
        raise ValueError(f"{flag} is not supported: upstream implements it only for its UnifiedRadixCache (the "
                         "unified radix tree), which this server does not have; allowed: cache (the default). To "
                         "keep the host tier small, use cache with a small --hicache-ratio or --hicache-size (or "
                         "a lower --hicache-host-memory-fraction) and the storage backend")

    def _check_io_cell(self) -> None:
        """The (layout, io_backend) cell must exist in the kvcacheio dispatch table (MHA pools)."""
        from sglang.srt.mem_cache.kvcacheio.dispatch import IO_TABLE
        from sglang.srt.mem_cache.memory_pool.base import PoolKind

        layout, io = HostLayout(self.hicache_mem_layout), IOBackend(self.resolved_io_backend)
        if (PoolKind.MHA, layout, io) not in IO_TABLE:
            cells = sorted(f"{lay.value}+{b.value}" for k, lay, b in IO_TABLE if k is PoolKind.MHA)
            default = "" if self.hicache_io_backend else f" (the default on --device {self.device})"
            raise ValueError(f"--hicache-mem-layout {layout.value} does not work with --hicache-io-backend "
                             f"{io.value}{default}; supported layout+io_backend: {', '.join(cells)}")

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode == "null":
            return
        mode = f"--disaggregation-mode {self.disaggregation_mode}"
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError(f"--disaggregation-bootstrap-port {self.disaggregation_bootstrap_port!r} is invalid; "
                             "must be in [1, 65535]")
        if self.disaggregation_mode == "prefill" and self.disaggregation_bootstrap_port == self.port:
            raise ValueError(f"--disaggregation-bootstrap-port {self.disaggregation_bootstrap_port} is also --port; "
                             "the bootstrap server needs a port of its own")
        if self.device != "cpu":
            raise ValueError(f"{mode} does not support --device {self.device} yet: PD transfer registers the KV "
                             "pool as host (DRAM) memory; use --device cpu")
        try:  # the transfer engine: fail at startup, not at the first request
            if self.disaggregation_transfer_backend == "mooncake":
                import mooncake.engine  # noqa: F401
            else:
                import nixl._api  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            extra = ("'sglang[pd,mooncake]' and Debian's libibverbs1 and librdmacm1"
                     if self.disaggregation_transfer_backend == "mooncake" else "'sglang[pd]'")
            raise ValueError(f"{mode} needs the transfer backend {self.disaggregation_transfer_backend!r}: "
                             f"{exc}; install the 'pd' extra (pip install {extra})") from None

    def _check_pipeline(self) -> None:
        """--pp-size > 1: the combinations a pipeline split cannot serve (the model's own limits,
        layers and architecture, are checked when it is loaded)."""
        if self.pp_size == 1:
            return
        self._refuse_with_split(
            f"--pp-size {self.pp_size}", "a pipeline stage holds only its layers", "--pp-size 1",
            "the stages hold different layers, so one byte budget gives them different host slot counts while "
            "the tree shares slot indices across ranks")

    def _check_context_parallel(self) -> None:
        """--attn-cp-size > 1: the combinations a CP split cannot serve (the architecture is checked
        when the model is loaded)."""
        if self.attn_cp_size == 1:
            return
        flag = f"--attn-cp-size {self.attn_cp_size}"
        if self.pp_size > 1:
            raise ValueError(f"{flag} is not supported with --pp-size {self.pp_size}: a CP rank runs the whole "
                             "model; allowed: --attn-cp-size 1 with --pp-size > 1, or --pp-size 1")
        self._refuse_with_split(flag, "a CP rank holds only its pages", "--attn-cp-size 1",
                                "every CP rank mirrors the same slots")

    def _refuse_with_split(self, flag: str, holds: str, allowed: str, why_ratio: str) -> None:
        """What a pipeline or context-parallel split (``flag``) cannot serve: PD, and a host pool
        sized in bytes (``why_ratio`` says why the split needs --hicache-ratio instead)."""
        if self.disaggregation_mode != "null":
            raise ValueError(f"{flag} is not supported with --disaggregation-mode {self.disaggregation_mode}: PD "
                             f"moves one rank's whole KV pool per transfer, and {holds}; allowed: {allowed}")
        if self.enable_hierarchical_cache and self.hicache_size > 0:
            raise ValueError(f"--hicache-size {self.hicache_size} is not supported with {flag}: {why_ratio}; use "
                             "--hicache-ratio")

    def _check_kv_events(self) -> None:
        if self.kv_events_config is None:
            return
        if self.disable_radix_cache:
            raise ValueError("--kv-events-config needs the radix cache (its events); drop --disable-radix-cache")
        from sglang.srt.disaggregation.kv_events import KVEventsConfig

        KVEventsConfig.from_cli(self.kv_events_config)  # a bad value stops the server at startup

    # ---- derived values ----------------------------------------------------------------------
    @property
    def resolved_io_backend(self) -> str:
        """--hicache-io-backend, or its device default (kernel on CUDA, direct elsewhere)."""
        if self.hicache_io_backend is not None:
            return self.hicache_io_backend
        return "kernel" if self.device == "cuda" else "direct"

    @property
    def resolved_hicache_ratio(self) -> float:
        """--hicache-ratio, or the default when unset (auto-sizing may lower that default)."""
        return DEFAULT_HICACHE_RATIO if self.hicache_ratio is None else self.hicache_ratio

    @property
    def resolved_host_memory_fraction(self) -> float | None:
        """--hicache-host-memory-fraction when it sizes the host pools (neither --hicache-ratio nor
        --hicache-size given, upstream's rule), else None (the explicit size is used as given)."""
        if self.hicache_ratio is not None or self.hicache_size > 0:
            return None
        return self.hicache_host_memory_fraction

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_path))

    @cached_property
    def storage_extra_config(self) -> dict:
        """--hicache-storage-backend-extra-config as a dict ({} when unset)."""
        return load_extra_config(self.hicache_storage_backend_extra_config)

    @cached_property
    def eviction_policy_config(self) -> dict | None:
        """--radix-eviction-policy-config as a dict (None when unset)."""
        value = self.radix_eviction_policy_config
        if value is None or value == "":
            return None
        try:
            data = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--radix-eviction-policy-config is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--radix-eviction-policy-config must be a JSON object, got {type(data).__name__}")
        return data

    @property
    def storage_roots(self) -> tuple[str, ...]:
        """--hicache-storage-roots as a tuple of directories (empty when unset)."""
        return tuple(r.strip() for r in (self.hicache_storage_roots or "").split(",") if r.strip())

    def url(self, path: str = "") -> str:
        return f"http://{self.host}:{self.port}{path}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_model(self) -> None:
        """Fail fast, naming --model-path, when the directory cannot hold a supported model."""
        from sglang.srt.model_executor.model_registry import resolve_architecture

        path = self.model_path
        if not os.path.isdir(path):
            raise ValueError(f"--model-path {path!r} is not a directory")
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise ValueError(f"--model-path {path!r} has no config.json")
        try:
            with open(config) as f:
                arch = json.load(f).get("architectures")
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"--model-path {path!r}: config.json is not a JSON object ({exc})") from None
        try:
            resolve_architecture(arch)
        except ValueError as exc:
            raise ValueError(f"--model-path {path!r}: {exc}") from None
        if self.tokenizer_path is not None:
            if not os.path.isfile(os.path.join(self.tokenizer_path, "tokenizer.json")):
                raise ValueError(f"--tokenizer-path {self.tokenizer_path!r} has no tokenizer.json")
        elif not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"--model-path {path!r} has no tokenizer.json")


# ---- the process's server args (upstream's global) ------------------------------------------------
_global_server_args: ServerArgs | None = None


def set_global_server_args_for_scheduler(server_args: ServerArgs) -> None:
    """Record the scheduler process's ServerArgs for code that reads them globally (upstream's
    helper). Our components take what they need as arguments; this is for upstream-style callers."""
    global _global_server_args
    if not isinstance(server_args, ServerArgs):
        raise TypeError(f"server_args must be a ServerArgs, got {type(server_args).__name__}")
    _global_server_args = server_args


def get_global_server_args() -> ServerArgs:
    """The ServerArgs set by ``set_global_server_args_for_scheduler``; ValueError before that."""
    if _global_server_args is None:
        raise ValueError("no global ServerArgs: call set_global_server_args_for_scheduler first")
    return _global_server_args


# ---- CLI --------------------------------------------------------------------------------------
def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _arg_type(f: dataclasses.Field):
    text = str(f.type)
    for name, typ in (("int", int), ("float", float)):
        if text.startswith(name):
            return typ
    return str


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One option per ServerArgs field; defaults are the dataclass's (the help shows them)."""
    for f in dataclasses.fields(ServerArgs):
        meta = f.metadata
        default = None if f.default is dataclasses.MISSING else f.default
        kwargs = {"dest": f.name, "help": f"{meta['help']} (default: {default})"}
        if f.type in ("bool", bool):
            parser.add_argument(flag_name(f.name), action="store_true", **kwargs)
            continue
        if meta.get("required"):
            kwargs["required"] = True
        parser.add_argument(flag_name(f.name), type=_arg_type(f), default=default, choices=meta.get("choices"),
                            **kwargs)
    return parser


def from_cli_args(args: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)})


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server", description="Start an sglang server.")
    return from_cli_args(add_cli_args(parser).parse_args(argv))


# ---- extra config ---------------------------------------------------------------------------
def load_extra_config(value: str | None) -> dict:
    """A JSON object string, or ``@path`` to a .json / .yaml / .yml / .toml file, as a dict."""
    flag = "--hicache-storage-backend-extra-config"
    if value is None or value == "":
        return {}
    if value.startswith("@"):
        path = value[1:]
        ext = os.path.splitext(path)[1].lower()
        if ext not in CONFIG_FILE_EXTENSIONS:
            raise ValueError(f"{flag} {value!r}: the file must end in one of {', '.join(CONFIG_FILE_EXTENSIONS)}")
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise ValueError(f"{flag} {value!r}: cannot read the file ({exc.strerror})") from None
        return _parse_config_bytes(raw, ext, f"{flag} {value!r}")
    # the inline value is not quoted: it may hold credentials (access_key, secret_key)
    return _parse_config_bytes(value.encode(), ".json", f"{flag} (inline JSON, {len(value)} characters)")


CONFIG_FILE_EXTENSIONS = (".json", ".yaml", ".yml", ".toml")


def _yaml_module(what: str):
    try:
        import yaml
    except ImportError:
        raise ValueError(f"{what}: reading YAML needs the PyYAML package (pip install 'sglang[serve]')") from None
    return yaml


def _toml_module(what: str):
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(f"{what}: reading TOML needs Python 3.11+ or the tomli package") from None
    return tomllib


def _parse_config_bytes(raw: bytes, ext: str, what: str) -> dict:
    yaml = _yaml_module(what) if ext in (".yaml", ".yml") else None
    toml = _toml_module(what) if ext == ".toml" else None
    try:
        if toml is not None:
            data = toml.loads(raw.decode())
        elif yaml is not None:
            data = yaml.safe_load(raw.decode())  # plain data only: no tag builds an object
        else:
            data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, getattr(yaml, "YAMLError", ValueError)) as exc:
        # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "YAML" if ext in (".yaml", ".yml") else ext[1:].upper()
        raise ValueError(f"{what}: not valid {kind} ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: must be a JSON/YAML/TOML object (key -> value), got {type(data).__name__}")
    return data
