"""ReplaySSM for Gated DeltaNet: replay accepted tokens into a state checkpoint, verify without snapshots.

The gated delta rule, per request and value head, in the convention of transformers'
`torch_recurrent_gated_delta_rule` (and fla's `fused_recurrent_gated_delta_rule`); S is [K, V] fp32:

    S   <- exp(g_t) * S
    d_t  = beta_t * (v_t - S^T k_t)            # [V]
    S   <- S + k_t d_t^T
    o_t  = S^T q_t                             # [V]

Inputs are what the layer feeds the recurrence, so replay is pure recurrence: q and k already
l2-normalised (transformers' `l2norm`, eps 1e-6), q already scaled by K**-0.5, both expanded to
the HV value heads (`repeat_interleave`); g = log-decay (<= 0) and beta in fp32.

Each V column of S evolves on its own (S^T k and the update are column-wise), so the kernel
(`gated_delta_fwd_kernel`: replay, or with VERIFY the outputs) splits V into blocks: one program per
(request, head, V-block) keeps a [K, BV] fp32 state tile in registers for the whole sequence.
Lengths are read on the device (no host sync, static shapes: CUDA-graph capturable).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspine.kernels.lazy_jit import LazyJit

_kernels = LazyJit(globals())  # triton.jit at the first launch: the references import without Triton


def gated_delta_step(s: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One recurrence step. s: [N, HV, K, V] fp32; k: [N, HV, K]; v: [N, HV, V]; g, beta: [N, HV]."""
    s = s * g.float().exp()[..., None, None]
    kv_mem = (s * k.float().unsqueeze(-1)).sum(dim=-2)  # [N, HV, V] = S^T k
    delta = (v.float() - kv_mem) * beta.float().unsqueeze(-1)
    return s + k.float().unsqueeze(-1) * delta.unsqueeze(-2)


def gated_delta_replay_reference(
    state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, accept_lens: Tensor
) -> Tensor:
    """Replay the first accept_lens[n] tokens of each request into its checkpoint (sequential).

    state: [N, HV, K, V] fp32 checkpoint (not modified); k: [N, T, HV, K]; v: [N, T, HV, V];
    g, beta: [N, T, HV]; accept_lens: [N] int in 0..T. Returns the new state [N, HV, K, V] fp32.
    """
    s = state.float().clone()
    for t in range(k.shape[1]):
        live = (accept_lens.to(s.device) > t)[:, None, None, None]  # [N, 1, 1, 1]
        s = torch.where(live, gated_delta_step(s, k[:, t], v[:, t], g[:, t], beta[:, t]), s)
    return s


def gated_delta_verify_outputs_reference(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> Tensor:
    """Outputs of all T drafted tokens from the checkpoint, keeping only a running state.

    state: [N, HV, K, V] fp32 (not modified); q, k: [N, T, HV, K]; v: [N, T, HV, V];
    g, beta: [N, T, HV]. Returns o: [N, T, HV, V] fp32.
    """
    s = state.float()
    o = []
    for t in range(k.shape[1]):
        s = gated_delta_step(s, k[:, t], v[:, t], g[:, t], beta[:, t])
        o.append((s * q[:, t].float().unsqueeze(-1)).sum(dim=-2))  # [N, HV, V] = S^T q
    return torch.stack(o, dim=1)


@_kernels.jit
def _gated_delta_step(b_s, b_k, b_v, b_g, b_beta):
    # b_s: [BK, BV] fp32; b_k: [BK]; b_v: [BV]; b_g, b_beta: scalars
    b_s = b_s * tl.exp(b_g)
    b_d = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta  # [BV]
    return b_s + b_k[:, None] * b_d[None, :]


@_kernels.jit
def _load_token(k, v, g, beta, i_tok, o_k, o_v, m_k, m_v, K: tl.constexpr, V: tl.constexpr):
    # fp32 (k [BK], v [BV], g, beta) of token row i_tok
    b_k = tl.load(k + i_tok * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_tok * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    return b_k, b_v, tl.load(g + i_tok).to(tl.float32), tl.load(beta + i_tok).to(tl.float32)


@_kernels.jit
def gated_delta_fwd_kernel(
    state,  # [N, HV, K, V] fp32 checkpoint, read only
    q,  # [N, T, HV, K] (VERIFY only)
    k,  # [N, T, HV, K]
    v,  # [N, T, HV, V]
    g,  # [N, T, HV]
    beta,  # [N, T, HV]
    accept_lens,  # [N] int (replay only)
    out,  # replay: [N, HV, K, V] fp32 new state, may alias state; VERIFY: o [N, T, HV, V] fp32
    T,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    VERIFY: tl.constexpr,  # False: replay accept_lens[n] tokens, store the state; True: all T, store o_t
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // HV, i_nh % HV
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = i_nh * K * V + o_k[:, None] * V + o_v[None, :]

    i_row = i_n * T * HV + i_h  # row of token t is i_row + t * HV
    if VERIFY:
        n_tok = T
        b_q = tl.load(q + i_row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    else:
        n_tok = tl.minimum(tl.load(accept_lens + i_n).to(tl.int32), T)
    b_k, b_v, b_g, b_beta = _load_token(k, v, g, beta, i_row, o_k, o_v, m_k, m_v, K, V)
    b_s = tl.load(state + p_s, mask=m_s, other=0.0)
    for t in range(0, n_tok):
        # prefetch token t+1 (clamped: stays in bounds) while token t is folded in; the loop is latency-bound
        i_nxt = i_row + tl.minimum(t + 1, n_tok - 1) * HV
        if VERIFY:
            n_q = tl.load(q + i_nxt * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        n_k, n_v, n_g, n_beta = _load_token(k, v, g, beta, i_nxt, o_k, o_v, m_k, m_v, K, V)
        b_s = _gated_delta_step(b_s, b_k, b_v, b_g, b_beta)
        if VERIFY:
            tl.store(out + (i_row + t * HV) * V + o_v, tl.sum(b_s * b_q[:, None], axis=0), mask=m_v)
            b_q = n_q
        b_k, b_v, b_g, b_beta = n_k, n_v, n_g, n_beta
    if not VERIFY:
        tl.store(out + p_s, b_s, mask=m_s)


def _check(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[int, ...]:
    N, T, HV, K = k.shape
    V = v.shape[-1]
    assert state.shape == (N, HV, K, V) and state.dtype == torch.float32, "state must be [N, HV, K, V] fp32"
    assert T >= 1 and v.shape == (N, T, HV, V) and g.shape == beta.shape == (N, T, HV), "inputs: [N, T >= 1, HV, *]"
    assert all(x.is_contiguous() for x in (state, k, v, g, beta)), "kernels assume contiguous tensors"
    return N, T, HV, K, V


def _launch(N: int, HV: int, K: int, V: int, *args, verify: bool) -> None:
    """One program per (V-block, request x head). A [K, 16] fp32 tile on one warp was fastest on
    H200 at K = V = 128 (sweep of BV 8..64 x 1..8 warps): the loop is latency-bound, so many small
    programs beat few wide ones."""
    import triton

    BK, BV = triton.next_power_of_2(K), min(triton.next_power_of_2(V), 16)
    grid = (triton.cdiv(V, BV), N * HV)
    gated_delta_fwd_kernel[grid](*args, HV=HV, K=K, V=V, BK=BK, BV=BV, VERIFY=verify, num_warps=max(1, BK // 128))


def gated_delta_replay(
    state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, accept_lens: Tensor, out: Tensor | None = None
) -> Tensor:
    """Triton `gated_delta_replay_reference`: same arguments and result.

    out: [N, HV, K, V] fp32, fully written; pass `out=state` to replay in place; allocated when None.
    k, v may be bf16 or fp32 (math in fp32). accept_lens: [N] int on the device, clamped to T.
    """
    _kernels.build()
    N, T, HV, K, V = _check(state, k, v, g, beta)
    out = torch.empty_like(state) if out is None else out
    assert out.shape == state.shape and out.dtype == torch.float32 and out.is_contiguous()
    assert accept_lens.shape == (N,) and not accept_lens.is_floating_point()
    _launch(N, HV, K, V, state, state, k, v, g, beta, accept_lens, out, T, verify=False)  # q unused
    return out


def gated_delta_verify_outputs(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, out: Tensor | None = None
) -> Tensor:
    """Triton `gated_delta_verify_outputs_reference`: o [N, T, HV, V] fp32 (`out` if given)."""
    _kernels.build()
    N, T, HV, K, V = _check(state, k, v, g, beta)
    assert q.shape == k.shape and q.is_contiguous()
    out = state.new_empty(N, T, HV, V) if out is None else out
    assert out.shape == (N, T, HV, V) and out.dtype == torch.float32 and out.is_contiguous()
    _launch(N, HV, K, V, state, q, k, v, g, beta, out, out, T, verify=True)  # accept_lens unused
    return out
