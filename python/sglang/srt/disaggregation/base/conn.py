"""PD transfer interfaces: what a rank registers (KVArgs), the poll states, and the ABCs.

Index units: KV indices handed to senders and receivers are PAGE ids of the device pool (page p
covers token slots [p * page_size, (p + 1) * page_size)); state indices are request slot ids of
the state pool; an aux index is a row of every aux buffer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum, IntEnum

import numpy as np


LOOPBACK_HOSTS = ("127.0.0.0/8", "::1", "localhost")  # the default bootstrap allow-list


class KVPoll(IntEnum):
    """Where one request's transfer stands, on either side. Values match upstream."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class DisaggregationMode(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class StateType(str, Enum):
    """Per-request state moved beside the KV pages."""

    NONE = "none"
    MAMBA = "mamba"


class KVTransferError(RuntimeError):
    """A transfer failed: peer gone, timeout, abort, NIXL error. The message says which."""


class IncompatiblePeerError(ValueError):
    """Prefill and decode cannot exchange KV; the message names both values."""


class UntrustedPeerError(IncompatiblePeerError):
    """A peer this rank must not talk to: a bootstrap host outside the allow-list, or an answer
    or message that the shared secret does not authenticate. Never retried."""


def _check_same_len(name: str, **lists) -> None:
    lens = {k: len(v) for k, v in lists.items()}
    if len(set(lens.values())) > 1:
        raise ValueError(f"KVArgs {name} lists differ in length: {lens}")


@dataclass
class KVArgs:
    """One rank's registration: its buffers and the shape facts a peer must agree with.

    ``kv_*`` lists hold one entry per (component, layer), component-major (MHA: K layers then V
    layers), as ``KVCache.get_contiguous_buf_infos`` returns them. ``kv_item_lens`` are bytes of
    ONE token slot of one layer; page p of buffer i starts at ``kv_data_ptrs[i] + p * page_size *
    kv_item_lens[i]``. ``aux_*``: one row (``aux_item_lens[i]`` bytes) per request slot.
    ``state_*``: one item per request slot; ``state_dim_per_tensor[i]`` is the size of the
    TP-sharded dimension (dim 0 of the item) of state buffer i on this rank;
    ``state_row_segments[i]``: how those rows split into segments sharded across TP separately
    (empty: one segment per buffer).
    """

    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    page_size: int
    kv_head_num: int
    head_dim: int
    layer_num: int
    kv_dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    total_kv_head_num: int = 0
    is_mla: bool = False
    aux_data_ptrs: list[int] = field(default_factory=list)
    aux_data_lens: list[int] = field(default_factory=list)
    aux_item_lens: list[int] = field(default_factory=list)
    state_type: StateType = StateType.NONE
    state_data_ptrs: list[int] = field(default_factory=list)
    state_data_lens: list[int] = field(default_factory=list)
    state_item_lens: list[int] = field(default_factory=list)
    state_dim_per_tensor: list[int] = field(default_factory=list)
    state_row_segments: list[tuple[int, ...]] = field(default_factory=list)
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self):
        self.state_type = StateType(self.state_type)
        for name in ("page_size", "kv_head_num", "head_dim", "layer_num", "tp_size", "pp_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KVArgs.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVArgs.tp_rank {self.tp_rank} outside [0, tp_size={self.tp_size})")
        if self.pp_size != 1:
            raise ValueError(f"KVArgs.pp_size {self.pp_size} is not supported; PD transfer supports pp_size 1")
        if self.total_kv_head_num < 0:
            raise ValueError(f"KVArgs.total_kv_head_num must be >= 0 (0 = unknown), got {self.total_kv_head_num}")
        _check_same_len("kv", ptrs=self.kv_data_ptrs, lens=self.kv_data_lens, item_lens=self.kv_item_lens)
        _check_same_len("aux", ptrs=self.aux_data_ptrs, lens=self.aux_data_lens, item_lens=self.aux_item_lens)
        _check_same_len(
            "state",
            ptrs=self.state_data_ptrs,
            lens=self.state_data_lens,
            item_lens=self.state_item_lens,
            dims=self.state_dim_per_tensor,
        )
        if not self.kv_data_ptrs:
            raise ValueError("KVArgs needs at least one KV buffer")
        if len(self.kv_data_ptrs) % self.layer_num:
            raise ValueError(
                f"KVArgs has {len(self.kv_data_ptrs)} KV buffers, not a multiple of layer_num {self.layer_num}"
            )
        for i, (length, item) in enumerate(zip(self.kv_data_lens, self.kv_item_lens)):
            if item < 1 or length < item * self.page_size:
                raise ValueError(f"KV buffer {i}: {length} bytes cannot hold one page of {item}-byte items")
        if (self.state_type is StateType.NONE) != (not self.state_data_ptrs):
            raise ValueError(
                f"state_type {self.state_type.value!r} with {len(self.state_data_ptrs)} state buffers; "
                "state buffers need state_type 'mamba' and 'mamba' needs buffers"
            )
        for i, (item, dim) in enumerate(zip(self.state_item_lens, self.state_dim_per_tensor)):
            if dim < 1 or item % dim:
                raise ValueError(f"state buffer {i}: item of {item} bytes does not split into {dim} rows")
        self.state_row_segments = [tuple(int(r) for r in seg) for seg in self.state_row_segments] or [
            (dim,) for dim in self.state_dim_per_tensor]
        if len(self.state_row_segments) != len(self.state_dim_per_tensor) or any(
                sum(seg) != dim or min(seg, default=0) < 1
                for seg, dim in zip(self.state_row_segments, self.state_dim_per_tensor)):
            raise ValueError(f"KVArgs.state_row_segments {self.state_row_segments} must split each of "
                             f"state_dim_per_tensor {self.state_dim_per_tensor} into positive row counts")

    @property
    def effective_total_kv_head_num(self) -> int:
        """Total KV heads of the model: the given total, else kv_head_num x tp_size, never below 1."""
        if self.total_kv_head_num > 0:
            return self.total_kv_head_num
        return max(1, self.kv_head_num * self.tp_size)

    @property
    def num_kv_pages(self) -> list[int]:
        """Pages each KV buffer can hold (page 0 included)."""
        return [n // (self.page_size * i) for n, i in zip(self.kv_data_lens, self.kv_item_lens)]

    @classmethod
    def from_pools(cls, kv_pool, *, engine_rank: int, tp_rank: int = 0, tp_size: int = 1,
                   total_kv_head_num: int = 0, aux_buffers=(), state_pool=None) -> "KVArgs":
        """KVArgs over device pools (MHA/MLA ``kv_pool``, optional MambaPool ``state_pool``) and
        contiguous aux tensors shaped (num_request_slots, ...). Reads pointers; mutates nothing."""
        ptrs, lens, items = kv_pool.get_contiguous_buf_infos()
        is_mla = hasattr(kv_pool, "kv_lora_rank")
        head_num = 1 if is_mla else kv_pool.head_num
        head_dim = kv_pool.kv_cache_dim if is_mla else kv_pool.head_dim
        return cls(
            engine_rank=engine_rank, kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items,
            page_size=kv_pool.page_size, kv_head_num=head_num, head_dim=head_dim,
            layer_num=kv_pool.layer_num, kv_dtype=str(kv_pool.dtype).removeprefix("torch."),
            tp_rank=tp_rank, tp_size=tp_size, total_kv_head_num=0 if is_mla else total_kv_head_num,
            is_mla=is_mla, **aux_fields(aux_buffers), **state_fields(state_pool),
        )


def state_fields(state_pool) -> dict:
    """KVArgs' ``state_*`` fields over a MambaPool (one buffer per component and layer,
    component-major; dim 0 of each item is TP-sharded by ``row_segments``); {} for None."""
    if state_pool is None:
        return {}
    ptrs, lens, items = state_pool.get_contiguous_buf_infos()
    comps = [c for c in state_pool.components for _ in range(state_pool.layer_num)]
    segments = getattr(state_pool, "row_segments", {})
    return dict(state_type=StateType.MAMBA, state_data_ptrs=ptrs, state_data_lens=lens, state_item_lens=items,
                state_dim_per_tensor=[c.item_shape[0] for c in comps],
                state_row_segments=[segments.get(c.name, (c.item_shape[0],)) for c in comps])


def aux_fields(aux_buffers) -> dict:
    """KVArgs' ``aux_*`` fields over contiguous tensors shaped (num_request_slots, ...)."""
    for t in aux_buffers:
        if not t.is_contiguous() or t.dim() < 1:
            raise ValueError(f"aux buffer must be a contiguous tensor with a row dim, got shape {tuple(t.shape)}")
    return dict(aux_data_ptrs=[t.data_ptr() for t in aux_buffers],
                aux_data_lens=[t.numel() * t.element_size() for t in aux_buffers],
                aux_item_lens=[t[0].numel() * t.element_size() for t in aux_buffers])


@dataclass(frozen=True)
class TransferConfig:
    """Timeouts (seconds) and addresses of one manager.

    ``bootstrap_addr`` ("host:port") is required on prefill, where every rank registers; a decode
    receiver gets the address per request. ``host`` is the address this rank's control socket binds.
    ``nixl_progress_thread``: NIXL's own progress thread busy-spins one core per agent (its delay
    is 0 in the Python binding), so by default transfers progress when the scheduler polls
    (prefill: handle checks; decode: notification drains) and on every heartbeat tick.
    ``staging_bytes``: registered DRAM through which KV travels in long runs instead of one
    descriptor per page or per token (see ``common/staging.py``); 0 disables it, and a request
    that does not fit falls back to direct descriptors.
    ``descriptor_cost_bytes``: the bytes a local copy moves in the time one NIXL descriptor costs
    (UCX/CMA on the 2-core dev box: ~3.7 us per descriptor x ~6.5 GB/s single-threaded copies).
    A route that adds k local copies of B bytes is taken instead of one that needs n more
    descriptors when n x descriptor_cost_bytes > k x B; 0 keeps staging only where the direct
    route would need per-token descriptors.
    ``pack_chunk_bytes``: staged KV is gathered and written in pieces of at most this many bytes,
    so decode scatters one piece while the next is on the wire.
    ``nixl_backend`` / ``nixl_backend_params``: the NIXL plugin the agent moves KV with and its
    init parameters (strings, as NIXL takes them), upstream's ``SGLANG_DISAGGREGATION_NIXL_BACKEND``
    / ``..._PARAMS``; whether the plugin is installed is checked when the agent is made
    (``nixl/agent.py``).
    ``claim_timeout_s``: prefill fails a room that no decode rank claimed within this time (a
    live decode server claims its room as soon as the request reaches it, before it waits for
    memory; the router sends both halves at once, so an unclaimed room means its decode server
    is down and nobody will ever serve it). Capped by ``bootstrap_timeout_s``.
    ``mooncake_protocol`` / ``mooncake_device``: the Mooncake transport's protocol ("tcp",
    "rdma", ...; "" picks rdma when the host has an RDMA device, else tcp; upstream's
    ``MOONCAKE_PROTOCOL``) and RDMA device names (upstream's ``--disaggregation-ib-device``; ""
    lets Mooncake choose); only ``mooncake/transport.py`` reads them.
    ``secret`` (the deployment's shared secret, never printed) and ``allowed_bootstrap_hosts``
    (names, IPs, CIDR networks): whom this rank trusts, see ``common/trust.py``.
    """

    host: str = "127.0.0.1"
    bootstrap_addr: str | None = None
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 300.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    nixl_progress_thread: bool = False
    staging_bytes: int = 64 << 20
    descriptor_cost_bytes: int = 24 << 10
    pack_chunk_bytes: int = 16 << 20
    nixl_backend: str = "UCX"
    nixl_backend_params: dict[str, str] = field(default_factory=dict)
    claim_timeout_s: float = 2.0
    mooncake_protocol: str = ""
    mooncake_device: str = ""
    secret: bytes | None = field(default=None, repr=False)
    allowed_bootstrap_hosts: tuple[str, ...] = LOOPBACK_HOSTS

    def __post_init__(self):
        if not isinstance(self.nixl_backend, str) or not self.nixl_backend:
            raise ValueError(f"TransferConfig.nixl_backend must be a NIXL plugin name such as 'UCX', "
                             f"got {self.nixl_backend!r}")
        check_nixl_backend_params(self.nixl_backend_params, "TransferConfig.nixl_backend_params")
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s",
                     "claim_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"TransferConfig.{name} must be a positive number of seconds, got {value!r}")
        for name in ("staging_bytes", "descriptor_cost_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TransferConfig.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.pack_chunk_bytes, int) or self.pack_chunk_bytes < 1:
            raise ValueError(f"TransferConfig.pack_chunk_bytes must be an int >= 1, got {self.pack_chunk_bytes!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"TransferConfig.heartbeat_timeout_s {self.heartbeat_timeout_s} must exceed "
                f"heartbeat_interval_s {self.heartbeat_interval_s}"
            )


def check_nixl_backend_params(params, source: str) -> None:
    """Raise ValueError unless ``params`` is a dict of str to str (NIXL's backend init params)."""
    if not isinstance(params, dict):
        raise ValueError(f"{source} must be a JSON object of parameter name to string value, "
                         f"got {type(params).__name__}: {params!r}")
    for key, value in params.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise ValueError(f"{source} must have string keys and string values (NIXL takes every backend "
                             f"parameter as a string, e.g. {{\"num_threads\": \"4\"}}), got {key!r}: {value!r}")


def as_page_ids(indices, what: str) -> np.ndarray:
    """``indices`` (tensor, array or sequence of ints) as a 1-D int64 numpy array."""
    arr = np.asarray(indices.cpu() if hasattr(indices, "cpu") else indices)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must be a 1-D sequence of ints, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


class BaseKVManager(ABC):
    """Owns a rank's transfer engine, control channel and per-request bookkeeping."""

    @abstractmethod
    def __init__(self, args: KVArgs, mode: DisaggregationMode, config: TransferConfig): ...

    @abstractmethod
    def close(self) -> None: ...


class BaseKVSender(ABC):
    """Prefill side of one request."""

    @abstractmethod
    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Declare the request's page count and its aux row."""

    @abstractmethod
    def send(self, kv_indices, state_indices=None) -> None:
        """Send the next chunk of source PAGE ids; the chunk that completes the count is the last."""

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def failure_exception(self) -> KVTransferError | None: ...

    @abstractmethod
    def abort(self) -> None: ...


class BaseKVReceiver(ABC):
    """Decode side of one request."""

    @abstractmethod
    def init(self, kv_indices, aux_index: int | None = None, state_indices=None) -> None:
        """Hand over destination PAGE ids (and aux row, state slots); the transfer starts."""

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def failure_exception(self) -> KVTransferError | None: ...

    @abstractmethod
    def abort(self) -> None: ...


class BaseKVBootstrapServer(ABC):
    @abstractmethod
    def close(self) -> None: ...
