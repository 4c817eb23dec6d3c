"""Linear-attention kernels in plain torch: the gated delta rule and a causal depthwise conv1d.

One code path for CPU and CUDA; every function works on one request's tokens (or, for the
single-token forms, a batch of requests whose per-element arithmetic does not depend on the batch),
so a token's result never depends on which other requests share the forward.

Gated delta rule (Gated DeltaNet, as in Qwen3-Next). Per value head, with a state ``S`` of shape
``(dk, dv)``, for each token t with L2-normalised ``q_t``/``k_t`` (q also scaled by ``dk**-0.5``),
decay ``g_t <= 0`` (log space) and write strength ``beta_t`` in (0, 1)::

    S   <- exp(g_t) * S
    u_t  = beta_t * (v_t - S^T k_t)        # the delta rule: write only what S mispredicts
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

``recurrent_gated_delta_rule`` runs that token by token (decode). ``chunk_gated_delta_rule``
computes the same thing ``chunk_size`` tokens at a time: inside a chunk starting from ``S0``, with
cumulative decays ``G_t = exp(sum_{s<=t} g_s)``, the corrections solve a unit lower-triangular
system ``(I + A) U = beta V - diag(beta G) K S0`` with ``A_tj = beta_t (G_t / G_j) k_t.k_j`` (j < t),
after which outputs and the end-of-chunk state are matrix products. Both forms agree to float
rounding (about 1e-6 relative in fp32); they are not bitwise equal.

No fast kernel (``fla``, ``causal_conv1d``) is wired in: these torch forms run on CPU and CUDA
alike and are what the tests compare with HF. A fast path would be an optional, lazily imported
alternative to ``chunk_gated_delta_rule`` with the same signature, never a requirement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang.srt.layers.activation import invariant_pointwise

DEFAULT_CHUNK_SIZE = 64
L2NORM_EPS = 1e-6
ZERO_STATE = -1  # a source slot meaning "start from zeros" (a sequence start)


@dataclass(frozen=True)
class StateSlots:
    """Per request of a ForwardBatch (batch order): the state-pool slot its linear-attention layers
    read their incoming state from (``ZERO_STATE`` at a sequence start; a cached prefix's slot on a
    prefix hit; its own slot when continuing) and the slot they write the outgoing state to (its
    own). Built by the scheduler (``managers/mamba_state.py``)."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    # Checkpoints (prefill only): per request, ``(offset, slot)`` pairs, offsets strictly increasing in
    # (0, extend length): the state after the request's first ``offset`` new tokens goes to ``slot`` too.
    track: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __post_init__(self):
        if len(self.src) != len(self.dst):
            raise ValueError(f"StateSlots: {len(self.src)} sources for {len(self.dst)} destinations")
        if self.track and len(self.track) != len(self.dst):
            raise ValueError(f"StateSlots: {len(self.track)} checkpoint lists for {len(self.dst)} requests")
        for points in self.track:
            offsets = [o for o, _ in points]
            if offsets != sorted(set(offsets)) or any(o < 1 for o in offsets) or any(s < 1 for _, s in points):
                raise ValueError(f"StateSlots: checkpoints must have increasing offsets >= 1 and slots >= 1, "
                                 f"got {list(points)}")

    def checkpoints(self, i: int) -> tuple[tuple[int, int], ...]:
        """Request ``i``'s ``(offset, slot)`` checkpoints (none when nothing is tracked)."""
        return self.track[i] if self.track else ()
        if any(d < 1 for d in self.dst):
            raise ValueError(f"StateSlots: destination slots must be >= 1 (slot 0 is padding), got {list(self.dst)}")


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / HF convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised, q scaled by dk**-0.5; key heads repeated to the value heads they serve."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    groups = num_v_heads // q.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: ``q``/``k`` (B, Hk, dk), ``v`` (B, Hv, dv), ``g``/``beta`` (B, Hv), ``state``
    (B, Hv, dk, dv). Returns ``(out (B, Hv, dv) fp32, new state (B, Hv, dk, dv) fp32)``.

    Elementwise products and reductions over dk only, so each row's result is independent of B.
    """
    q, k = _prepare_qk(q, k, v.shape[-2])
    s = state.float() * invariant_pointwise(torch.exp, g.float())[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)  # (B, Hv, dv): what the state predicts for k
    u = (v.float() - kv_mem) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * u.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(dim=-2)
    return out, s


def recurrent_gated_delta_rule_seq(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token form over one request's sequence: ``q``/``k`` (T, Hk, dk), ``v`` (T, Hv, dv),
    ``g``/``beta`` (T, Hv), ``state`` (Hv, dk, dv). Returns ``(out (T, Hv, dv), final state)``, fp32.
    The reference the chunked form is tested against."""
    outs, s = [], state.float().unsqueeze(0)
    for t in range(q.shape[0]):
        o, s = recurrent_gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        outs.append(o)
    return torch.cat(outs), s[0]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's ``T`` tokens: ``q``/``k`` (T, Hk, dk), ``v`` (T, Hv, dv), ``g``/``beta`` (T, Hv),
    ``state`` (Hv, dk, dv) or None (zeros). Returns ``(out (T, Hv, dv) fp32, final state fp32)``.

    Chunks start at the first token of the call (the tail chunk is zero-padded: ``beta = 0`` and
    ``g = 0`` there leave the state untouched).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    T, Hv, dv = v.shape
    q, k = _prepare_qk(q, k, Hv)
    dk = k.shape[-1]
    # (Hv, T, d) head-major, padded to whole chunks
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    pad = (-T) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n, C = (T + pad) // chunk_size, chunk_size
    q, k, v = (x.reshape(Hv, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(Hv, n, C), beta.reshape(Hv, n, C)

    log_decay = g.cumsum(dim=-1)  # log G_t inside each chunk
    strictly_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)  # [t, j] = log(G_t / G_j)
    ratio_strict = diff.masked_fill(~strictly_lower, float("-inf")).exp()
    ratio_causal = diff.masked_fill(~lower, float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    a = (k_beta @ k.transpose(-1, -2)) * ratio_strict  # A: strictly lower
    system = a + torch.eye(C, dtype=a.dtype, device=a.device)
    rhs_v = v * beta.unsqueeze(-1)
    rhs_s = k_beta * log_decay.exp().unsqueeze(-1)
    u_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(system, rhs_s, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * ratio_causal
    q_decayed = q * log_decay.exp().unsqueeze(-1)
    end_decay = log_decay[..., -1:]
    k_to_end = k * (end_decay - log_decay).exp().unsqueeze(-1)  # k_j * G_C / G_j

    s = torch.zeros(Hv, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty(Hv, n, C, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = u_v[:, i] - u_s[:, i] @ s  # the chunk's corrections given the incoming state
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ u
        s = s * end_decay[:, i].exp().unsqueeze(-1) + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(Hv, n * C, dv)[:, :T].transpose(0, 1)
    return out, s


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one request's tokens, continuing from ``state``.

    ``x`` (C, T) channels by tokens, ``weight`` (C, K), ``state`` (C, K - 1): the K - 1 inputs
    before ``x`` (None: zeros, a sequence start). Returns ``(out (C, T), new state (C, K - 1))``
    in ``x``'s dtype, no activation. Also works batched: ``x`` (B, C, T), ``state`` (B, C, K - 1).

    The K taps are summed in a fixed order with elementwise products, so a token's output does not
    depend on T or on the batch.
    """
    K = weight.shape[-1]
    if state is None:
        state = x.new_zeros(*x.shape[:-1], K - 1)
    full = torch.cat([state.to(x.dtype), x], dim=-1)  # (..., C, K - 1 + T)
    T = x.shape[-1]
    w = weight.to(x.dtype)
    out = full[..., 0:T] * w[:, 0:1]
    for j in range(1, K):
        out = out + full[..., j : j + T] * w[:, j : j + 1]
    return out, full[..., T:].clone()
