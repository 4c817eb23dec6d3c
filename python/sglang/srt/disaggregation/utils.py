"""Scheduler-side PD helpers shared by the prefill and decode halves.

``FirstTokenAux``: the aux buffers that carry a request's first output token (id, logprob, top
logprobs) from prefill to decode, one row per request-table row. ``build_kv_args``: the
``KVArgs`` of one rank from its model runner's device pool. ``transfer_config``: timeouts and
the NIXL / Mooncake settings from upstream's environment variables. ``get_kv_class``: a transfer
backend's manager, sender, receiver and bootstrap server. ``agreed_polls``: every TP rank of a server sees the same
transfer state before acting on it (a MIN all-reduce over the gloo group: Failed < Bootstrapping
< WaitingForInput < Transferring < Success).
"""

from __future__ import annotations

import logging
import math
import os
import socket

import torch

from sglang.srt.disaggregation.base.conn import LOOPBACK_HOSTS, KVArgs, KVPoll, TransferConfig
from sglang.srt.disaggregation.common.trust import ENV_ALLOWED_HOSTS, ENV_SECRET, is_loopback, parse_secret
from sglang.srt.disaggregation.nixl.agent import ENV_NIXL_BACKEND, ENV_NIXL_BACKEND_PARAMS, parse_nixl_backend_params
from sglang.srt.sampling.sampling_params import TOP_LOGPROBS_MAX

logger = logging.getLogger(__name__)


# Upstream's environment variables (seconds), read once per server start.
ENV_BOOTSTRAP_TIMEOUT = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
ENV_WAITING_TIMEOUT = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
ENV_HEARTBEAT_INTERVAL = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_MAX_FAILURE = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
ENV_CLAIM_TIMEOUT = "SGLANG_DISAGGREGATION_CLAIM_TIMEOUT"  # ours: see TransferConfig.claim_timeout_s
ENV_MOONCAKE_PROTOCOL = "MOONCAKE_PROTOCOL"  # upstream's: the Mooncake transport's protocol

TRANSFER_BACKENDS = ("nixl", "mooncake")
_KV_CLASSES = {
    "nixl": "sglang.srt.disaggregation.nixl.conn",
    "mooncake": "sglang.srt.disaggregation.mooncake.conn",
}
_KV_CLASS_KINDS = ("manager", "sender", "receiver", "bootstrap_server")


def get_kv_class(backend: str, kind: str):
    """The ``kind`` class ("manager", "sender", "receiver", "bootstrap_server") of transfer
    backend ``backend`` (upstream's name for this lookup); imported on first use."""
    import importlib

    if backend not in _KV_CLASSES:
        raise ValueError(f"unknown PD transfer backend {backend!r}; choose one of {list(_KV_CLASSES)}")
    if kind not in _KV_CLASS_KINDS:
        raise ValueError(f"unknown PD class kind {kind!r}; choose one of {list(_KV_CLASS_KINDS)}")
    prefix = {"nixl": "Nixl", "mooncake": "Mooncake"}[backend]
    name = prefix + {"manager": "KVManager", "sender": "KVSender", "receiver": "KVReceiver",
                     "bootstrap_server": "KVBootstrapServer"}[kind]
    return getattr(importlib.import_module(_KV_CLASSES[backend]), name)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def pd_secret() -> bytes | None:
    """The deployment's shared secret (``SGLANG_DISAGGREGATION_SECRET``), None when unset."""
    return parse_secret(os.environ.get(ENV_SECRET))


def allowed_bootstrap_hosts(host: str, secret: bytes | None) -> tuple[str, ...]:
    """``SGLANG_DISAGGREGATION_BOOTSTRAP_ALLOWED_HOSTS`` (comma-separated names, IPs, CIDR
    networks), else loopback plus this server's own address (when that is loopback, or a
    secret authenticates it)."""
    raw = os.environ.get(ENV_ALLOWED_HOSTS)
    if raw:
        return tuple(h.strip() for h in raw.split(",") if h.strip())
    own = (host,) if host and (secret or is_loopback(host)) and host not in LOOPBACK_HOSTS else ()
    return LOOPBACK_HOSTS + own


def transfer_config(host: str, bootstrap_addr: str | None, ib_device: str | None = None) -> TransferConfig:
    """TransferConfig of one rank. Timeouts: ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (a
    request waits this long for its peer; default 300), ``..._WAITING_TIMEOUT`` (for its KV once
    both sides met; 300), ``..._HEARTBEAT_INTERVAL`` (1) x ``..._HEARTBEAT_MAX_FAILURE`` (5):
    a peer silent that long is dead and its requests fail; ``..._CLAIM_TIMEOUT`` (2): prefill
    fails a room no decode server claimed in that time. NIXL: ``SGLANG_DISAGGREGATION_NIXL_BACKEND``
    (the plugin, default UCX) and ``..._NIXL_BACKEND_PARAMS`` (a JSON object of strings, default {}).
    Trust: ``SGLANG_DISAGGREGATION_SECRET`` and ``..._BOOTSTRAP_ALLOWED_HOSTS`` (``common/trust.py``).
    Mooncake: ``MOONCAKE_PROTOCOL`` (default rdma on a host with an RDMA device, else tcp) and
    ``ib_device`` (``--disaggregation-ib-device``)."""
    interval = _env_seconds(ENV_HEARTBEAT_INTERVAL, 1.0)
    failures = _env_seconds(ENV_HEARTBEAT_MAX_FAILURE, 5.0)
    secret = pd_secret()
    return TransferConfig(
        host=host, bootstrap_addr=bootstrap_addr,
        bootstrap_timeout_s=_env_seconds(ENV_BOOTSTRAP_TIMEOUT, 300.0),
        transfer_timeout_s=_env_seconds(ENV_WAITING_TIMEOUT, 300.0),
        heartbeat_interval_s=interval, heartbeat_timeout_s=interval * max(failures, 1.5),
        nixl_backend=os.environ.get(ENV_NIXL_BACKEND) or "UCX",
        nixl_backend_params=parse_nixl_backend_params(os.environ.get(ENV_NIXL_BACKEND_PARAMS) or "{}"),
        claim_timeout_s=_env_seconds(ENV_CLAIM_TIMEOUT, 2.0),
        mooncake_protocol=os.environ.get(ENV_MOONCAKE_PROTOCOL) or "", mooncake_device=ib_device or "",
        secret=secret, allowed_bootstrap_hosts=allowed_bootstrap_hosts(host, secret),
    )


def advertised_host(bind_host: str) -> str:
    """The address peers reach this server at: ``bind_host`` unless it is a wildcard, else the
    address of the interface that routes outwards (no packet is sent)."""
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class FirstTokenAux:
    """Per request-table row: the first output token, its logprob and its top logprobs.

    Prefill writes the row of the request it just prefilled; the transfer copies the row to the
    decode request's row; decode reads it back. Contiguous CPU tensors (registered with NIXL).
    """

    def __init__(self, rows: int, top_k: int = TOP_LOGPROBS_MAX):
        self.top_k = top_k
        self.token = torch.full((rows, 2), -1, dtype=torch.int64)  # [token id, number of top entries]
        self.logprob = torch.zeros((rows, 1), dtype=torch.float32)
        self.top_ids = torch.zeros((rows, top_k), dtype=torch.int64)
        self.top_logprobs = torch.zeros((rows, top_k), dtype=torch.float32)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [self.token, self.logprob, self.top_ids, self.top_logprobs]

    def write(self, row: int, token: int | None, logprob: float, top: list[tuple[int, float]]) -> None:
        top = list(top or [])[: self.top_k]
        self.token[row, 0] = -1 if token is None else int(token)
        self.token[row, 1] = len(top)
        self.logprob[row, 0] = float(logprob)
        for i, (tid, lp) in enumerate(top):
            self.top_ids[row, i] = int(tid)
            self.top_logprobs[row, i] = float(lp)

    def read(self, row: int) -> tuple[int | None, float, list[tuple[int, float]]]:
        token, n = int(self.token[row, 0]), int(self.token[row, 1])
        top = [(int(self.top_ids[row, i]), float(self.top_logprobs[row, i])) for i in range(n)]
        return (None if token < 0 else token), float(self.logprob[row, 0]), top

    def clear(self, row: int) -> None:
        self.token[row] = -1


def build_kv_args(runner, aux: FirstTokenAux) -> KVArgs:
    """KVArgs over the runner's device pools (anchor, sidecars, state pool: ``common/pool_plan.py``)
    plus the first-token aux buffers.

    Raises ValueError naming what is missing for pools PD transfer cannot move together, or for a
    device pool outside host memory (NIXL registers DRAM here).
    """
    from sglang.srt.disaggregation.common.pool_plan import kv_args_of_pools

    if runner.device.type != "cpu":
        raise ValueError(f"PD serving registers the KV pool as host memory; --device {runner.device.type} "
                         "is not supported with --disaggregation-mode yet")
    total_heads = int(getattr(runner.model_config.hf_config, "num_key_value_heads", 0) or 0)
    return kv_args_of_pools(runner.token_to_kv_pool, list(getattr(runner, "side_pools", {}).values()),
                            getattr(runner, "state_pool", None), engine_rank=runner.tp_rank, tp_rank=runner.tp_rank,
                            tp_size=runner.tp_size, total_kv_head_num=total_heads, aux_buffers=aux.buffers)


def page_ids_of(kv_indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of a request's slots (whole pages from position 0; one id per page)."""
    return kv_indices[::page_size] // page_size


def agreed_polls(states: list[KVPoll]) -> list[KVPoll]:
    """The same poll results on every TP rank: the minimum over ranks, per request."""
    if not states:
        return []
    from sglang.srt.distributed import tensor_model_parallel_cpu_all_reduce_min

    return [KVPoll(v) for v in tensor_model_parallel_cpu_all_reduce_min([int(s) for s in states])]
