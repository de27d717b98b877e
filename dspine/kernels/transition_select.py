"""Path selection over the block's candidate lattice: PyTorch reference (the oracle).

Each of the N proposal slots keeps K candidates with unary draft scores; adjacent slots are linked
by transition scores. Per request, the conditional log-probability of candidate c at slot i given
candidate a at slot i-1 is s_i(a, c) = log_softmax_c((unary_i(c) + λ·pair_i(a, c)) / T)
(slot 0's predecessor is the verified anchor: only row 0 of pair_0 is read). At T = 0 the path is
the Viterbi argmax of Σ s_i (T treated as 1); at T > 0 it is sampled left to right by inverse CDF
from the given uniforms, and q_i = exp(s_i(c_{i-1}, ·)) is the proposal distribution that makes
rejection-sampling verification exact.

Fused path (`transition_path`): `transition_path_fwd_kernel`, one program per request. The
lattice is tiny (N = 15 slots of K = 8 candidates: 15·64 pair scores), so one program holds a
slot's [K, K] conditional log-probabilities in registers, runs the Viterbi recursion with its
back-pointers in an [N, K] register tile, and walks the sampled path in the same pass (both are
computed; the request's temperature picks one). Static shapes, no host sync.
"""

from __future__ import annotations


import torch
from torch import Tensor

from dspine.kernels.lazy_jit import LazyJit


def conditional_log_probs(unary: Tensor, pair: Tensor, lam: float, temperature: Tensor) -> Tensor:
    """unary: [bs, N, K]; pair: [bs, N, K, K]; temperature: [bs] (0 = greedy, read as 1).
    Returns s [bs, N, K, K] fp32: s[b, i, a, c] = log q_i(c | a)."""
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    logits = (unary.float()[:, :, None, :] + lam * pair.float()) / temp[:, None, None, None]
    return torch.log_softmax(logits, dim=-1)


def transition_path_reference(unary: Tensor, pair: Tensor, lam: float, temperature: Tensor,
                              uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """unary [bs, N, K], pair [bs, N, K, K], temperature [bs], uniforms [bs, N] in [0, 1).

    Returns (choice [bs, N] int64 candidate index per slot, q [bs, N, K] fp32 proposal
    probabilities of the chosen predecessor's row; one-hot at the choice for greedy rows).
    """
    s = conditional_log_probs(unary, pair, lam, temperature)
    bs, n, k = unary.shape
    # Greedy rows: Viterbi.
    best = s[:, 0, 0]                                            # [bs, K]
    back = []
    for i in range(1, n):
        cand = best[:, :, None] + s[:, i]                         # [bs, K(prev), K(cur)]
        best, arg = cand.max(dim=1)
        back.append(arg)
    viterbi = torch.empty(bs, n, dtype=torch.long, device=unary.device)
    viterbi[:, n - 1] = best.argmax(-1)
    for i in range(n - 1, 0, -1):
        viterbi[:, i - 1] = back[i - 1].gather(1, viterbi[:, i:i + 1]).squeeze(1)
    # Sampled rows: inverse CDF left to right.
    sampled = torch.empty(bs, n, dtype=torch.long, device=unary.device)
    q = torch.empty(bs, n, k, dtype=torch.float32, device=unary.device)
    prev = torch.zeros(bs, dtype=torch.long, device=unary.device)
    rows = torch.arange(bs, device=unary.device)
    for i in range(n):
        probs = s[rows, i, prev].exp()                            # [bs, K]
        cdf = probs.cumsum(-1)
        pick = (cdf < uniforms[:, i:i + 1] * cdf[:, -1:]).sum(-1).clamp(max=k - 1)
        sampled[:, i], q[:, i], prev = pick, probs, pick
    greedy = (temperature <= 0)[:, None]
    choice = torch.where(greedy, viterbi, sampled)
    one_hot = torch.nn.functional.one_hot(choice, k).float()
    return choice, torch.where(greedy[..., None], one_hot, q)


# ------------------------------------------------------------------------------------------ Triton
# Handed to triton.jit at the first launch (dspine/kernels/lazy_jit.py).
_kernels = LazyJit(globals())


@_kernels.jit
def transition_path_fwd_kernel(
    unary,  # [bs, N, K]
    pair,  # [bs, N, K, K]
    temperature,  # [bs]
    uniforms,  # [bs, N]
    choice,  # [bs, N] int64
    q,  # [bs, N, K] fp32
    lam,
    N: tl.constexpr,
    K: tl.constexpr,
    NP: tl.constexpr,
    KP: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_a = tl.arange(0, KP)                                          # predecessor candidate (rows)
    o_c = tl.arange(0, KP)                                          # current candidate (columns)
    o_n = tl.arange(0, NP)                                          # slot
    m_a, m_c = o_a < K, o_c < K
    b_temp = tl.load(temperature + i_b).to(tl.float32)
    greedy = b_temp <= 0
    b_temp = tl.where(greedy, 1.0, b_temp)

    # Slot 0: its predecessor is the anchor, row 0 of pair_0.
    b_u = tl.load(unary + i_b * N * K + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_p = tl.load(pair + i_b * N * K * K + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_x = tl.where(m_c, (b_u + lam * b_p) / b_temp, float("-inf"))  # [KP]
    b_x = b_x - tl.max(b_x, axis=0)
    b_s = b_x - tl.log(tl.sum(tl.exp(b_x), axis=0))                 # [KP] log q_0(c)
    b_best = b_s                                                    # Viterbi: best path score ending in c
    b_back = tl.zeros([NP, KP], dtype=tl.int32)                     # back-pointers per slot
    # Sampled path: inverse CDF left to right.
    b_prob = tl.exp(b_s)
    b_cdf = tl.cumsum(b_prob, axis=0)
    b_tot = tl.sum(tl.where(o_c == K - 1, b_cdf, 0.0), axis=0)
    b_uni = tl.load(uniforms + i_b * N).to(tl.float32)
    prev = tl.minimum(tl.sum(((b_cdf < b_uni * b_tot) & m_c).to(tl.int32), axis=0), K - 1)
    b_samp = tl.where(o_n == 0, prev, tl.zeros([NP], dtype=tl.int32))  # [NP]
    b_q = tl.where(o_n[:, None] == 0, b_prob[None, :], 0.0)         # [NP, KP]

    for i in tl.static_range(1, N):
        b_u = tl.load(unary + (i_b * N + i) * K + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_p = tl.load(pair + ((i_b * N + i) * K + o_a[:, None]) * K + o_c[None, :],
                      mask=m_a[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [KP, KP]
        b_x = tl.where(m_c[None, :], (b_u[None, :] + lam * b_p) / b_temp, float("-inf"))
        b_x = b_x - tl.max(b_x, axis=1)[:, None]
        b_s = b_x - tl.log(tl.sum(tl.exp(b_x), axis=1))[:, None]    # [KP, KP] log q_i(c | a)
        # Viterbi step (rows a >= K carry -inf in b_best).
        b_cand = b_best[:, None] + b_s
        b_best = tl.max(b_cand, axis=0)
        b_arg = tl.argmax(b_cand, axis=0).to(tl.int32)
        b_back = tl.where(o_n[:, None] == i, b_arg[None, :], b_back)
        # Sampling step from the previous pick's row.
        b_row = tl.sum(tl.where(o_a[:, None] == prev, b_s, 0.0), axis=0)  # [KP]
        b_prob = tl.exp(b_row)
        b_cdf = tl.cumsum(b_prob, axis=0)
        b_tot = tl.sum(tl.where(o_c == K - 1, b_cdf, 0.0), axis=0)
        b_uni = tl.load(uniforms + i_b * N + i).to(tl.float32)
        prev = tl.minimum(tl.sum(((b_cdf < b_uni * b_tot) & m_c).to(tl.int32), axis=0), K - 1)
        b_samp = tl.where(o_n == i, prev, b_samp)
        b_q = tl.where(o_n[:, None] == i, b_prob[None, :], b_q)

    # Viterbi backtrack.
    cur = tl.argmax(tl.where(m_c, b_best, float("-inf")), axis=0).to(tl.int32)
    b_vit = tl.where(o_n == N - 1, cur, tl.zeros([NP], dtype=tl.int32))
    for j in tl.static_range(1, N):
        i = N - j
        cur = tl.sum(tl.sum(tl.where((o_n[:, None] == i) & (o_c[None, :] == cur), b_back, 0), axis=1), axis=0)
        b_vit = tl.where(o_n == i - 1, cur, b_vit)

    b_choice = tl.where(greedy, b_vit, b_samp)                      # [NP]
    b_q = tl.where(greedy, (o_c[None, :] == b_choice[:, None]).to(tl.float32), b_q)
    m_n = o_n < N
    tl.store(choice + i_b * N + o_n, b_choice.to(tl.int64), mask=m_n)
    tl.store(q + (i_b * N + o_n[:, None]) * K + o_c[None, :], b_q, mask=m_n[:, None] & m_c[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def transition_path(unary: Tensor, pair: Tensor, lam: float, temperature: Tensor, uniforms: Tensor,
                    out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Triton `transition_path_reference`: same arguments, same (choice [bs, N] int64, q [bs, N, K]
    fp32), written into `out` = (choice, q) when given."""
    bs, n, k = unary.shape
    assert pair.shape == (bs, n, k, k) and temperature.shape == (bs,) and uniforms.shape == (bs, n)
    _kernels.build()
    unary, pair, uniforms = unary.contiguous(), pair.contiguous(), uniforms.contiguous()
    if out is None:
        out = (torch.empty(bs, n, dtype=torch.long, device=unary.device),
               torch.empty(bs, n, k, dtype=torch.float32, device=unary.device))
    choice, q = out
    assert choice.shape == (bs, n) and choice.dtype == torch.long and choice.is_contiguous()
    assert q.shape == (bs, n, k) and q.dtype == torch.float32 and q.is_contiguous()
    transition_path_fwd_kernel[(bs,)](unary, pair, temperature.contiguous(), uniforms, choice, q, float(lam),
                                      N=n, K=k, NP=max(2, _next_pow2(n)), KP=max(2, _next_pow2(k)), num_warps=1)
    return choice, q
