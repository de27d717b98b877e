"""Gated adjacent injection for one draft layer: PyTorch reference (the oracle) and a fused Triton path.

For a batch of n blocks of B positions, position i states its token in the shared transfer space
U = E_out·P ([V, r]): scores s_i = (h_i W_s) · Uᵀ, its top-k candidates and their softmax weights
give the predicted feature t_i = Σ_j w_j U[c_j] (the anchor's feature is exact: t_0 = U[anchor]).
Position i+1 then receives h_{i+1} += σ(G [h_{i+1}; t_i]) ⊙ (t_i W_o).

Fused path (`adjacent_injection`), three launches after the small q = h W_sᵀ GEMM:

1. `transfer_topk_fwd_kernel`, grid (M-tiles, V-chunks): split-V. Each program holds a tile of
   query rows q [BLOCK_M, r] and streams its chunk of U in [BLOCK_V, r] tiles: scores
   [BLOCK_M, BLOCK_V] = q·Uᵀ (bf16 MMA, fp32 accumulate) feed a running top-k per row kept in
   registers, never in memory. A score and its vocabulary index are packed into one int64 key
   (order-preserving float bits high, index low; dspine/kernels/topk_keys.py, shared with the logits
   top-k), so one max-reduction yields value and argmax, all keys of a row are distinct, and an
   exact tie goes to the lower index. Insertion: while some row's best remaining tile key beats
   that row's current k-th key, replace the k-th by it (at most k rounds, usually 1-3 after the
   first tiles). Only rows that need scores are scored: positions 1..B-2 (the anchor's feature
   is U[anchor]; the last position has no successor). Output: [chunks, M, KP] int64 partials.
2. `transfer_merge_fwd_kernel`, one program per (block, position < B-1): merges the chunks'
   partial top-k, softmax over the k values (fp32), gathers the k rows of U and writes the
   feature t [n, B-1, r] fp32 (position 0: U[anchor]); on request also the k ids
   (`candidates_out`), which `injection_candidates = "first_layer"` hands to the later layers
   (below).
3. `injection_gate_fwd_kernel`, grid (M-tiles, H-tiles): out = h + σ(h G_hᵀ + t G_tᵀ + b) ⊙ (t W_oᵀ)
   for positions ≥ 1 (t of the previous position, cast to h's dtype as the reference does) and
   out = h at position 0, reading G once per M-tile without materialising [h; t].

Later layers of `injection_candidates = "first_layer"` (`inject_on_candidates`, PyTorch reference
`inject_on_candidates_reference`) re-weight layer 1's k candidates with their own scores instead
of scanning the vocabulary: t_i = softmax_j(q_i·U[c_ij]) mixes the same k rows of U. Such a layer
is the gate's GEMV plus a few KB of gathers, so launches, not bytes, were its excess (q GEMM, a
features kernel, the gate kernel: ~26 µs at 8B shapes, bs 1, against the gate's ~16 µs). Two:

a. `injection_hidden_fwd_kernel`, grid (M-tiles, H-tiles + r-tiles, splits): the one pass over
   the big weights, h [G_h; W_s]ᵀ, W_s's r rows being extra output columns after G_h's H (G_h is
   the first H columns of G, W_s is [r, H]: both contiguous along h's dimension, one tile loop).
   It writes fp32 [splits, n·B, H + r]: g_h = h G_hᵀ and q = h W_sᵀ. `hidden_split` > 1 splits
   each dot's H columns over that many programs (split-K, more bytes in flight at bs 1);
   the partials are summed in the fixed split order by (b), deterministic.
b. `candidate_gate_fwd_kernel`, grid (row tiles, H-spans): each program recomputes t of the
   positions before its rows (k gathers of U rows, scored against q; after the anchor t = U[anchor]
   exactly: the anchor id in slot 0, the other slots masked) -- redundant across the H-spans, but
   16 rows · k · r is ~64 KB from L2 at k = 8, r = 256, and saves a launch -- then out = h +
   σ(g_h + t G_tᵀ + b) ⊙ (t W_oᵀ) for its [rows, H-span] tiles (`_gate_out`, shared with the gate
   kernel; position 0 copied). The k slots stream through an online softmax, one [rows, r] gather
   per slot: `_softmax_mix` over the whole [16, k, r] tile spills at k = 8 (compiled offline for
   sm_90, 4 and 8 warps), this takes 185 registers at 8 warps, no spill. `mix_tiles_n` H-tiles per
   program share one t: fewer recomputations at large batch.
The bytes are those of the gate (G, W_o) plus W_s, as before. A one-launch variant would need a
grid-wide wait for q (t depends on all of h W_sᵀ) or a last-program-finishes counter that must
be zeroed per launch and is shared by concurrent streams: not done.

Bytes-moved floor per layer (bf16, 8B shapes: V = 151,936, r = 256, H = 4,096): U 77.8 MB (the
V-loop) + G 35.7 MB (gate GEMV, H × (H + r)) + W_s, W_o 2.1 MB each = 117.6 MB: 27 µs at the
H200's ~4.3 TB/s copy bandwidth, 137 µs for five layers (the V-loop alone: 18 µs a layer).
Partials and t are a few hundred KB. At SmolLM2 shapes (V = 49,152, H = 576) U is 25 MB and
stays in the 60 MB L2 across the five layers of a round. At bs = 1 the V-loop's arithmetic is
negligible (16 rows); from bs ≈ 8 (112 rows) the q·Uᵀ MMA and the insertion rounds dominate.
The gate's H × H block is 30% of the floor: a cheaper gate is the lever below ~0.1 ms a round.

Launch configuration: `blocks_for` picks defaults (`InjectionBlocks`); dspine/bench/kernels.py
sweeps alternatives on the device. Compiled offline for sm_90 (Triton 3.6 and 3.9) the default
top-k program takes ~155 registers and no local memory: 3 programs per SM, each prefetching its
next 32 KB U tile into registers while it inserts the current one.

Numerics: q is computed by the same torch op as the reference (bit-identical); scores stay fp32
(the reference rounds them to h's dtype before its top-k, which only matters at near-ties). In
fp32 the result equals the reference to rounding; in bf16 the gate runs in fp32 with one
rounding at the end. A later layer's q is accumulated in fp32 by (a) and rounded to h's dtype
once, as the reference's GEMM returns it (equal up to accumulation order). Static shapes, no
host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from dspine.kernels.lazy_jit import LazyJit
from dspine.kernels.topk_keys import (
    _cdiv,
    _empty_top,
    _insert_rows,
    _interpret,
    _multiprocessors,
    _next_pow2,
    _pack_keys,
    _unpack_keys,
)
from dspine.kernels.topk_keys import _kernels as _topk_kernels


def table_rows(table: Tensor, ids: Tensor) -> Tensor:
    """table [V, r], ids [...] int64 -> table[ids] [..., r], through `index_select`: its gradient is
    an `index_add_`, not advanced indexing's sort-based scatter (5 % of a training step's device
    time on an H100 at SmolLM2's shape)."""
    return table.index_select(0, ids.reshape(-1)).view(*ids.shape, table.shape[-1])


def transfer_features_reference(h: Tensor, score_weight: Tensor, table: Tensor, anchor_ids: Tensor,
                                top_k: int) -> tuple[Tensor, Tensor]:
    """h: [n, B, H]; score_weight: [r, H]; table: [V, r]; anchor_ids: [n].

    Returns (t [n, B, r] fp32 predicted features with t[:, 0] = U[anchor], scores [n, B, V]).
    """
    scores = (h @ score_weight.T) @ table.T                      # [n, B, V]
    top_val, top_idx = scores.topk(top_k, dim=-1)                # [n, B, k]
    weights = torch.softmax(top_val.float(), dim=-1)             # [n, B, k]
    t = torch.einsum("nbk,nbkr->nbr", weights, table_rows(table, top_idx).float())    # [n, B, r]
    t = torch.cat([table_rows(table, anchor_ids).float()[:, None], t[:, 1:]], dim=1)
    return t, scores


def transfer_features_on_candidates(h: Tensor, score_weight: Tensor, table: Tensor, anchor_ids: Tensor,
                                   candidates: Tensor) -> Tensor:
    """Features from given candidates instead of a vocabulary scan (`injection_candidates =
    "first_layer"`, layers 2..): t [n, B-1, r] fp32 with t[:, 0] = U[anchor] and, for positions
    1..B-2, the softmax over this layer's scores of `candidates` [n, B-1, k] (row i: the ids layer 1
    found for position i) of their U rows (fused with the gate: `inject_on_candidates`). With each
    position's own top-k as candidates it equals
    `transfer_features_reference` (same scores, fp32 softmax)."""
    q = (h[:, 1:-1] @ score_weight.T).float()                    # [n, B-2, r]
    rows = table_rows(table, candidates[:, 1:]).float()          # [n, B-2, k, r]
    weights = torch.softmax(torch.einsum("nbr,nbkr->nbk", q, rows), dim=-1)
    t = torch.einsum("nbk,nbkr->nbr", weights, rows)             # [n, B-2, r]
    return torch.cat([table_rows(table, anchor_ids).float()[:, None], t], dim=1)


def inject_features_reference(h: Tensor, t: Tensor, gate_weight: Tensor, gate_bias: Tensor,
                              out_weight: Tensor) -> Tensor:
    """The gate-and-add half of the injection: h [n, B, H], t [n, B(-1), r] fp32 features.
    Returns h_out [n, B, H]: position i+1 receives σ(G [h_{i+1}; t_i]) ⊙ (t_i W_o)."""
    t_prev = t[:, :h.shape[1] - 1].to(h.dtype)                   # [n, B-1, r]
    nxt = h[:, 1:]                                               # [n, B-1, H]
    gate = torch.sigmoid(torch.cat([nxt, t_prev], dim=-1) @ gate_weight.T + gate_bias)
    injected = nxt + gate * (t_prev @ out_weight.T)
    return torch.cat([h[:, :1], injected], dim=1)


def inject_on_candidates_reference(h: Tensor, score_weight: Tensor, table: Tensor, anchor_ids: Tensor,
                                   candidates: Tensor, gate_weight: Tensor, gate_bias: Tensor,
                                   out_weight: Tensor) -> Tensor:
    """A later layer of `injection_candidates = "first_layer"`: the injection with the features of
    `transfer_features_on_candidates` (candidates [n, B-1, k], layer 1's top-k). h_out [n, B, H]."""
    t = transfer_features_on_candidates(h, score_weight, table, anchor_ids, candidates)
    return inject_features_reference(h, t, gate_weight, gate_bias, out_weight)


def adjacent_injection_reference(h: Tensor, score_weight: Tensor, table: Tensor, anchor_ids: Tensor,
                                 gate_weight: Tensor, gate_bias: Tensor, out_weight: Tensor,
                                 top_k: int) -> tuple[Tensor, Tensor]:
    """One layer's injection. h: [n, B, H]; gate_weight: [H, H + r]; gate_bias: [H];
    out_weight: [H, r]. Returns (h_out [n, B, H] in h's dtype, scores [n, B, V]).

    Invariant: h_out[:, 0] == h[:, 0] (nothing precedes the anchor).
    """
    t, scores = transfer_features_reference(h, score_weight, table, anchor_ids, top_k)
    return inject_features_reference(h, t, gate_weight, gate_bias, out_weight), scores


# ------------------------------------------------------------------------------------------ Triton
# Handed to triton.jit at the first launch (dspine/kernels/lazy_jit.py); the packed-key helpers
# (_pack_keys, _unpack_keys, _insert_rows, _empty_top) are dspine/kernels/topk_keys.py's.
_kernels = LazyJit(globals(), uses=(_topk_kernels,))


@_kernels.jit
def _dot(b_a, b_b, b_acc, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """b_a [M, K] · b_b [K, N] + b_acc, fp32. The interpreter (Triton 3.9) multiplies bf16 tiles as
    their raw uint16 bits: there, upcast first (exact, so the CPU tests still check bf16 math)."""
    if INTERPRET:
        b_a, b_b = b_a.to(tl.float32), b_b.to(tl.float32)
    return tl.dot(b_a, b_b, b_acc, input_precision=DOT_PRECISION)


@_kernels.jit
def _anchor_row(table, anchor_ids, i_b, o_r, m_r, R: tl.constexpr):
    """Block i_b's anchor id and its exact feature U[anchor] ([RP] fp32)."""
    i_anchor = tl.load(anchor_ids + i_b).to(tl.int64)
    return i_anchor, tl.load(table + i_anchor * R + o_r, mask=m_r, other=0.0).to(tl.float32)


@_kernels.jit
def _candidate_rows(table, b_idx, o_r, m_k, m_r, R: tl.constexpr):
    """The table rows U[b_idx] of the candidates ([KP, RP] fp32; masked slots 0). Also a tile's rows:
    b_idx and m_k [BLOCK_M] -> [BLOCK_M, RP]."""
    return tl.load(table + b_idx[:, None] * R + o_r[None, :], mask=m_k[:, None] & m_r[None, :],
                   other=0.0).to(tl.float32)


@_kernels.jit
def _softmax_mix(b_s, b_u):
    """softmax(b_s) [KP] (masked slots at -inf) as weights over the candidate rows b_u [KP, RP]: [RP]."""
    b_w = tl.exp(b_s - tl.max(b_s, axis=0))
    b_w = b_w / tl.sum(b_w, axis=0)
    return tl.sum(b_w[:, None] * b_u, axis=0)


@_kernels.jit
def transfer_topk_fwd_kernel(
    q,  # [n * B, R] query rows h W_sᵀ
    table,  # [V, R]
    part,  # [S, M, KP] int64 packed partial top-k keys of each V-chunk
    M,  # n * (B - 2) scored rows
    V,
    CHUNK,  # vocabulary rows per program, a multiple of BLOCK_V
    B: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_m, i_s = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_r = tl.arange(0, RP)
    m_m, m_r = o_m < M, o_r < R
    o_row = (o_m // (B - 2)) * B + o_m % (B - 2) + 1                # positions 1..B-2 of each block
    b_q = tl.load(q + o_row[:, None] * R + o_r[None, :], mask=m_m[:, None] & m_r[None, :], other=0.0)  # [BLOCK_M, RP]

    b_top = _empty_top(BLOCK_M, K, KP)                              # [BLOCK_M, KP]
    v_lo = i_s * CHUNK
    v_hi = tl.minimum(v_lo + CHUNK, V)
    o_v = v_lo + tl.arange(0, BLOCK_V)
    b_u = tl.load(table + o_v[:, None] * R + o_r[None, :], mask=(o_v < v_hi)[:, None] & m_r[None, :], other=0.0)
    for v0 in range(0, CHUNK, BLOCK_V):                             # the last chunk's tail is masked
        o_v = v_lo + v0 + tl.arange(0, BLOCK_V)
        b_s = _dot(b_q, tl.trans(b_u), tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32), DOT_PRECISION,
                   INTERPRET)                                       # [BLOCK_M, BLOCK_V] fp32 scores
        # Prefetch the next [BLOCK_V, RP] tile of U: its latency hides behind the insertion below.
        o_nxt = o_v + BLOCK_V
        b_u = tl.load(table + o_nxt[:, None] * R + o_r[None, :], mask=(o_nxt < v_hi)[:, None] & m_r[None, :],
                      other=0.0)
        m_key = m_m[:, None] & (o_v < v_hi)[None, :]                # padding rows and columns never enter
        b_key = tl.where(m_key, _pack_keys(b_s, o_v[None, :]), -9223372036854775807)  # [BLOCK_M, BLOCK_V]
        b_top = _insert_rows(b_top, b_key)
    o_k = tl.arange(0, KP)
    tl.store(part + (i_s * M + o_m[:, None]) * KP + o_k[None, :], b_top, mask=m_m[:, None])


@_kernels.jit
def transfer_merge_fwd_kernel(
    part,  # [S, M, KP] int64 partial top-k keys
    table,  # [V, R]
    anchor_ids,  # [n]
    t,  # [n, B - 1, R] fp32 features of the positions that have a successor
    cand,  # [n, B - 1, K] int64 top-k ids (the anchor's id at position 0), written if WRITE_CAND
    M,
    S,
    B: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_S: tl.constexpr,  # chunks merged per step
    WRITE_CAND: tl.constexpr,
):
    i_p = tl.program_id(0)                                          # = blk * (B - 1) + pos
    i_b, i_pos = i_p // (B - 1), i_p % (B - 1)
    o_r = tl.arange(0, RP)
    m_r = o_r < R
    o_k = tl.arange(0, KP)
    m_k = o_k < K
    if i_pos == 0:
        i_anchor, b_t = _anchor_row(table, anchor_ids, i_b, o_r, m_r, R)
        if WRITE_CAND:
            tl.store(cand + i_p * K + o_k, tl.zeros([KP], dtype=tl.int64) + i_anchor, mask=m_k)
    else:
        i_m = i_b * (B - 2) + i_pos - 1
        o_s = tl.arange(0, BLOCK_S)
        b_top = _empty_top(1, K, KP)                                # [1, KP]
        for s0 in range(0, S, BLOCK_S):
            m_c = ((s0 + o_s)[:, None] < S) & (o_k[None, :] < K)
            b_key = tl.load(part + ((s0 + o_s)[:, None] * M + i_m) * KP + o_k[None, :], mask=m_c,
                            other=-9223372036854775807)             # [BLOCK_S, KP]
            b_key = tl.where(b_key > -9223372036854775807 + KP, b_key, -9223372036854775807)  # drop empty slots
            b_top = _insert_rows(b_top, tl.reshape(b_key, [1, BLOCK_S * KP]))
        b_val, b_idx = _unpack_keys(tl.reshape(b_top, [KP]))         # [KP]
        if WRITE_CAND:
            tl.store(cand + i_p * K + o_k, b_idx.to(tl.int64), mask=m_k)
        b_u = _candidate_rows(table, b_idx.to(tl.int64), o_r, m_k, m_r, R)           # [KP, RP]
        b_t = _softmax_mix(tl.where(m_k, b_val, float("-inf")), b_u)                # [RP]
    tl.store(t + i_p * R + o_r, b_t, mask=m_r)


@_kernels.jit
def _hidden_dot(x, w, o_m64, m_m, o_n, m_n, k_lo, k_hi, X_STRIDE, W_STRIDE, b_acc, BLOCK_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """b_acc + x[o_m, k_lo:k_hi] · w[o_n, k_lo:k_hi]ᵀ ([BLOCK_M, BLOCK_N] fp32); rows of x and of w
    contiguous along k, X_STRIDE and W_STRIDE apart. Reads w once per call, h rows from L2."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        b_x = tl.load(x + o_m64[:, None] * X_STRIDE + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(w + o_n[:, None] * W_STRIDE + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_acc = _dot(b_x, tl.trans(b_w), b_acc, DOT_PRECISION, INTERPRET)
    return b_acc


@_kernels.jit
def _gate_out(h, out, b_g, b_t, gate_w, gate_b, out_w, o_m64, o_n, m_m, m_n, m_live, H, R: tl.constexpr,
              RP: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Stores out = h + σ(b_g + t G_tᵀ + b) ⊙ (t W_oᵀ) on the live rows and out = h on the others,
    for the [BLOCK_M, BLOCK_N] tile (o_m, o_n). b_g: h G_hᵀ ([BLOCK_M, BLOCK_N] fp32); b_t: the
    features t of the previous positions ([BLOCK_M, RP], already in h's dtype)."""
    o_r = tl.arange(0, RP)
    m_r = o_r < R
    m_nr = m_n[:, None] & m_r[None, :]
    b_wt = tl.load(gate_w + o_n[:, None] * (H + R) + H + o_r[None, :], mask=m_nr, other=0.0)  # [BLOCK_N, RP]
    b_g = _dot(b_t, tl.trans(b_wt), b_g, DOT_PRECISION, INTERPRET)
    b_wo = tl.load(out_w + o_n[:, None] * R + o_r[None, :], mask=m_nr, other=0.0)  # [BLOCK_N, RP]
    b_o = _dot(b_t, tl.trans(b_wo), tl.zeros(b_g.shape, dtype=tl.float32), DOT_PRECISION, INTERPRET)
    b_bias = tl.load(gate_b + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_gate = tl.sigmoid(b_g + b_bias[None, :])
    m_out = m_m[:, None] & m_n[None, :]
    b_h = tl.load(h + o_m64[:, None] * H + o_n[None, :], mask=m_out, other=0.0).to(tl.float32)
    b_out = b_h + tl.where(m_live[:, None], b_gate * b_o, 0.0)
    tl.store(out + o_m64[:, None] * H + o_n[None, :], b_out.to(out.dtype.element_ty), mask=m_out)


@_kernels.jit
def injection_gate_fwd_kernel(
    h,  # [n * B, H]
    t,  # [n, B - 1, R] fp32
    gate_w,  # [H, H + R]
    gate_b,  # [H]
    out_w,  # [H, R]
    out,  # [n * B, H]
    M,  # n * B
    H,
    B: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < H
    i_pos = o_m % B
    m_live = m_m & (i_pos > 0)                                      # positions that receive a feature
    o_m64 = o_m.to(tl.int64)
    b_g = _hidden_dot(h, gate_w, o_m64, m_m, o_n, m_n, 0, H, H, H + R, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                      BLOCK_K, DOT_PRECISION, INTERPRET)            # h G_hᵀ (G is [H, H + R])
    o_r = tl.arange(0, RP)
    o_t = (o_m // B) * (B - 1) + i_pos - 1                          # t of the previous position
    b_t = tl.load(t + o_t[:, None] * R + o_r[None, :], mask=m_live[:, None] & (o_r < R)[None, :], other=0.0)
    _gate_out(h, out, b_g, b_t.to(h.dtype.element_ty), gate_w, gate_b, out_w, o_m64, o_n, m_m, m_n, m_live, H, R, RP,
              DOT_PRECISION, INTERPRET)                             # t cast to h's dtype, as the reference does


@_kernels.jit
def injection_hidden_fwd_kernel(
    h,  # [n * B, H]
    gate_w,  # [H, H + R]: its first H columns, G_h
    score_w,  # [R, H] W_s
    part,  # [S, n * B, H + R] fp32: split S's partial h G_hᵀ (columns < H) and h W_sᵀ (columns >= H)
    M,  # n * B
    H,
    K_SPLIT,  # columns of h per split, a multiple of BLOCK_K
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_m64 = o_m.to(tl.int64)
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, H)
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_h = tl.cdiv(H, BLOCK_N)
    if i_n < n_h:                                                   # output tiles of G_h ...
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < H
        b_acc = _hidden_dot(h, gate_w, o_m64, m_m, o_n, m_n, k_lo, k_hi, H, H + R, b_acc, BLOCK_K, DOT_PRECISION,
                            INTERPRET)
        o_c = o_n
    else:                                                           # ... then W_s's R rows as extra outputs
        o_n = (i_n - n_h) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < R
        b_acc = _hidden_dot(h, score_w, o_m64, m_m, o_n, m_n, k_lo, k_hi, H, H, b_acc, BLOCK_K, DOT_PRECISION,
                            INTERPRET)
        o_c = H + o_n
    tl.store(part + (i_s * M + o_m64)[:, None] * (H + R) + o_c[None, :], b_acc, mask=m_m[:, None] & m_n[None, :])


@_kernels.jit
def _previous_features_on_candidates(part, table, anchor_ids, cand, o_m64, m_m, m_live, i_pos, M, H,
                                     B: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, K: tl.constexpr,
                                     S: tl.constexpr):
    """The feature t of the position before each row o_m ([BLOCK_M, RP] fp32): the softmax over that
    position's scores q·U[c] of its candidates c, with q = Σ_s part[s, row - 1, H:] rounded to the
    table's dtype (what the reference's q GEMM returns), as weights over their rows U[c]. After the
    anchor: U[anchor], exactly (the anchor's id in slot 0, the other slots masked). Rows that receive
    nothing get U[anchor] or U[0], unused.

    The K slots stream through an online softmax (running max, rescaled sum): one [BLOCK_M, RP]
    gather at a time. `_softmax_mix` on the whole [BLOCK_M, K, RP] tile would hold it in registers:
    compiled offline for sm_90, 16 rows × 8 × 256 spill at 4 and 8 warps."""
    o_r = tl.arange(0, RP)
    m_r = o_r < R
    i_blk = o_m64 // B
    m_scored = m_live & (i_pos > 1)                                 # the previous position is 1..B-2
    b_q = tl.zeros([o_m64.shape[0], RP], dtype=tl.float32)
    for i_s in tl.static_range(S):
        b_q += tl.load(part + (i_s * M + o_m64 - 1)[:, None] * (H + R) + H + o_r[None, :],
                       mask=m_scored[:, None] & m_r[None, :], other=0.0)
    b_q = b_q.to(table.dtype.element_ty).to(tl.float32)             # [BLOCK_M, RP]
    o_cand = (i_blk * (B - 1) + i_pos - 1) * K                      # the previous position's K candidates
    b_t = tl.zeros([o_m64.shape[0], RP], dtype=tl.float32)          # Σ exp(s - max) U[c]
    b_max = tl.full([o_m64.shape[0]], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([o_m64.shape[0]], dtype=tl.float32)            # Σ exp(s - max)
    for k in tl.static_range(K):
        b_idx = tl.load(cand + o_cand + k, mask=m_scored, other=0)
        if k == 0:
            b_idx = tl.where(m_scored, b_idx, tl.load(anchor_ids + i_blk, mask=m_m, other=0))
            m_k = i_pos >= 0                                        # slot 0: every row
        else:
            m_k = m_scored
        b_u = _candidate_rows(table, b_idx.to(tl.int64), o_r, m_k, m_r, R)  # [BLOCK_M, RP]
        b_s = tl.where(m_k, tl.sum(b_u * b_q, axis=1), float("-inf"))     # [BLOCK_M] scores
        b_new = tl.maximum(b_max, b_s)
        b_scale, b_p = tl.exp(b_max - b_new), tl.exp(b_s - b_new)
        b_t = b_t * b_scale[:, None] + b_p[:, None] * b_u
        b_sum = b_sum * b_scale + b_p
        b_max = b_new
    return b_t / b_sum[:, None]


@_kernels.jit
def candidate_gate_fwd_kernel(
    h,  # [n * B, H]
    part,  # [S, n * B, H + R] fp32 partials of injection_hidden_fwd_kernel
    table,  # [V, R]
    anchor_ids,  # [n]
    cand,  # [n, B - 1, K] int64 candidate ids (row 0, the anchor's, is not read)
    gate_w,  # [H, H + R]
    gate_b,  # [H]
    out_w,  # [H, R]
    out,  # [n * B, H]
    M,  # n * B
    H,
    B: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES_N: tl.constexpr,  # consecutive H-tiles per program, sharing one computation of t
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    i_pos = o_m % B
    m_live = m_m & (i_pos > 0)                                      # positions that receive a feature
    o_m64 = o_m.to(tl.int64)
    b_t = _previous_features_on_candidates(part, table, anchor_ids, cand, o_m64, m_m, m_live, i_pos, M, H, B, R, RP,
                                           K, S).to(h.dtype.element_ty)  # as the reference casts t
    for j in range(TILES_N):
        o_n = (i_n * TILES_N + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < H
        b_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)       # h G_hᵀ: the sum of the split partials
        for i_s in tl.static_range(S):
            b_g += tl.load(part + (i_s * M + o_m64)[:, None] * (H + R) + o_n[None, :],
                           mask=m_m[:, None] & m_n[None, :], other=0.0)
        _gate_out(h, out, b_g, b_t, gate_w, gate_b, out_w, o_m64, o_n, m_m, m_n, m_live, H, R, RP, DOT_PRECISION,
                  INTERPRET)


@dataclass(frozen=True)
class Tiles:
    """The tiling of one kernel launch: block_m rows and block_n columns a program (for the top-k
    kernel: block_n vocabulary rows a tile), block_k the reduction step of a GEMM-like kernel, then
    warps and pipeline stages. A kernel ignores the fields it has no use for."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 128
    warps: int = 4
    stages: int = 4


@dataclass(frozen=True)
class InjectionBlocks:
    """Launch configuration of the fused path (the benchmark sweeps it; defaults from `blocks_for`).

    topk: the split-V top-k kernel (programs_per_sm: how many V-chunk programs to aim for per
    multiprocessor); gate: the gate kernel. A later layer of `injection_candidates = "first_layer"`
    (`inject_on_candidates`): hidden for its pass over h (hidden_split: programs splitting the H
    columns of each dot, their partials summed by the next kernel), mix for its features-and-gate
    kernel (mix_tiles_n: consecutive H-tiles per program, which share one computation of t)."""

    topk: Tiles = Tiles(block_n=64, stages=3)
    programs_per_sm: int = 3
    gate: Tiles = Tiles()
    hidden: Tiles = Tiles()
    hidden_split: int = 1
    mix: Tiles = Tiles(warps=8)
    mix_tiles_n: int = 1

    def updated(self, **changes) -> InjectionBlocks:
        """A copy with `changes`; a launch's name takes a dict of its `Tiles` fields:
        `updated(hidden={"block_k": 256}, hidden_split=2)`."""
        return dataclasses.replace(self, **{
            name: dataclasses.replace(getattr(self, name), **value) if isinstance(value, dict) else value
            for name, value in changes.items()})


def blocks_for(n: int, block_size: int) -> InjectionBlocks:
    """Default launch configuration for n blocks of `block_size` positions."""
    rows, gate_rows = n * (block_size - 2), n * block_size
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    gate = Tiles(block_m=16 if gate_rows <= 16 else 32 if gate_rows <= 32 else 64,
                 block_n=32 if gate_rows <= 64 else 64)
    # A later layer's pass over h is the gate's GEMM plus W_s's rows: the gate's tiles, each dot split
    # in two (hidden_split 2: 0.0188 vs 0.0213 ms at bs 1, 0.0428 vs 0.0435 at bs 8, Qwen3-8B shapes on
    # the H200, kernels_h200_details.json). Its second kernel keeps 16-row tiles (a [16, k, r] gather of
    # candidate rows), one H-tile per program (wider spans were slower at bs 8: 0.0428 vs 0.0399 ms).
    return InjectionBlocks(topk=Tiles(block_m=block_m, block_n=64, stages=3), gate=gate, hidden=gate,
                           hidden_split=2, mix=Tiles(block_n=32 if gate_rows <= 64 else 64, warps=8))


def _precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # fp32 tests compare exactly: no tf32


def transfer_features(h: Tensor, score_weight: Tensor, table: Tensor, anchor_ids: Tensor, top_k: int,
                      blocks: InjectionBlocks | None = None, out: Tensor | None = None,
                      candidates_out: Tensor | None = None) -> Tensor:
    """Fused `transfer_features_reference` without the [n, B, V] scores: t [n, B-1, r] fp32 for the
    positions that have a successor (t[:, 0] = U[anchor]); written into `out` when given. Scores
    of the anchor and the last position are never computed. `candidates_out` ([n, B-1, k] int64,
    optional) receives each position's top-k ids in no particular order (position 0: the anchor's)."""
    n, blk, hidden = h.shape
    vocab, rank = table.shape
    assert blk >= 2 and 1 <= top_k <= vocab and score_weight.shape == (rank, hidden)
    assert table.is_contiguous() and anchor_ids.shape == (n,)
    _kernels.build()
    rows = n * (blk - 2)
    blocks = blocks or blocks_for(n, blk)
    rp, kp = max(16, _next_pow2(rank)), max(2, _next_pow2(top_k))
    t = torch.empty(n, blk - 1, rank, dtype=torch.float32, device=h.device) if out is None else out
    assert t.shape == (n, blk - 1, rank) and t.dtype == torch.float32 and t.is_contiguous()
    anchor_ids = anchor_ids.contiguous()
    if rows > 0:
        q = (h @ score_weight.T).contiguous()                       # [n, B, r], the reference's own op
        assert q.dtype == table.dtype, "h, score_weight and table must share a dtype"
        tiles = blocks.topk
        m_tiles = _cdiv(rows, tiles.block_m)
        chunks = max(1, blocks.programs_per_sm * _multiprocessors(h.device) // m_tiles)  # V-chunks wanted
        chunk = _cdiv(_cdiv(vocab, chunks), tiles.block_n) * tiles.block_n
        splits = _cdiv(vocab, chunk)
        part = torch.empty(splits, rows, kp, dtype=torch.int64, device=h.device)
        transfer_topk_fwd_kernel[(m_tiles, splits)](
            q, table, part, rows, vocab, chunk, B=blk, R=rank, RP=rp, K=top_k, KP=kp, BLOCK_M=tiles.block_m,
            BLOCK_V=tiles.block_n, DOT_PRECISION=_precision(table.dtype), INTERPRET=_interpret(),
            num_warps=tiles.warps, num_stages=tiles.stages)
    else:
        splits, part = 1, torch.empty(1, 1, kp, dtype=torch.int64, device=h.device)
    block_s = max(1, min(_next_pow2(splits), 4096 // kp))
    if candidates_out is not None:
        assert candidates_out.shape == (n, blk - 1, top_k) and candidates_out.dtype == torch.int64
        assert candidates_out.is_contiguous()
    transfer_merge_fwd_kernel[(n * (blk - 1),)](part, table, anchor_ids, t,
                                                candidates_out if candidates_out is not None else t,
                                                max(rows, 1), splits, B=blk, R=rank, RP=rp, K=top_k, KP=kp,
                                                BLOCK_S=block_s, WRITE_CAND=candidates_out is not None, num_warps=8)
    return t


def inject_features(h: Tensor, t: Tensor, gate_weight: Tensor, gate_bias: Tensor, out_weight: Tensor,
                    blocks: InjectionBlocks | None = None, out: Tensor | None = None) -> Tensor:
    """Fused `inject_features_reference`: h [n, B, H], t [n, B-1, r] fp32 -> h_out [n, B, H]
    (written into `out` when given)."""
    n, blk, hidden = h.shape
    rank = t.shape[-1]
    assert t.shape == (n, blk - 1, rank) and t.dtype == torch.float32 and t.is_contiguous()
    assert gate_weight.shape == (hidden, hidden + rank) and out_weight.shape == (hidden, rank)
    assert gate_weight.dtype == out_weight.dtype == h.dtype, "gate/out weights must share h's dtype"
    _kernels.build()
    h, gate_weight, gate_bias, out_weight = (x.contiguous() for x in (h, gate_weight, gate_bias, out_weight))
    blocks = blocks or blocks_for(n, blk)
    out = torch.empty_like(h) if out is None else out
    assert out.shape == h.shape and out.dtype == h.dtype and out.is_contiguous()
    rows = n * blk
    gate = blocks.gate
    grid = (_cdiv(rows, gate.block_m), _cdiv(hidden, gate.block_n))
    injection_gate_fwd_kernel[grid](h, t, gate_weight, gate_bias, out_weight, out, rows, hidden, B=blk, R=rank,
                                    RP=max(16, _next_pow2(rank)), BLOCK_M=gate.block_m, BLOCK_N=gate.block_n,
                                    BLOCK_K=gate.block_k, DOT_PRECISION=_precision(h.dtype), INTERPRET=_interpret(),
                                    num_warps=gate.warps, num_stages=gate.stages)
    return out


def adjacent_injection(h: Tensor, score_weight: Tensor, table: Tensor, anchor_ids: Tensor, gate_weight: Tensor,
                       gate_bias: Tensor, out_weight: Tensor, top_k: int,
                       blocks: InjectionBlocks | None = None, out: Tensor | None = None,
                       candidates_out: Tensor | None = None) -> Tensor:
    """Fused `adjacent_injection_reference` without the scores: h_out [n, B, H] in h's dtype.

    h: [n, B, H]; score_weight: [r, H]; table: [V, r] contiguous; anchor_ids: [n]; gate_weight:
    [H, H + r]; gate_bias: [H]; out_weight: [H, r]; all in one dtype (bf16 or fp32), on one
    device. `out` ([n, B, H], optional) receives the result; `blocks` overrides the launch config;
    `candidates_out` receives the top-k ids (see `transfer_features`).
    """
    t = transfer_features(h, score_weight, table, anchor_ids, top_k, blocks, candidates_out=candidates_out)
    return inject_features(h, t, gate_weight, gate_bias, out_weight, blocks, out)


def inject_on_candidates(h: Tensor, score_weight: Tensor, table: Tensor, anchor_ids: Tensor, candidates: Tensor,
                         gate_weight: Tensor, gate_bias: Tensor, out_weight: Tensor,
                         blocks: InjectionBlocks | None = None, out: Tensor | None = None) -> Tensor:
    """Fused `inject_on_candidates_reference` (a later layer of `injection_candidates = "first_layer"`):
    h_out [n, B, H] in h's dtype, written into `out` when given. Two launches (module docstring):
    `injection_hidden_fwd_kernel` (h [G_h; W_s]ᵀ, split-K partials) and `candidate_gate_fwd_kernel`
    (features from `candidates` [n, B-1, k] int64, gate, add). Arguments as `adjacent_injection`'s;
    `blocks` overrides the launch configuration (its hidden and mix fields)."""
    n, blk, hidden = h.shape
    rank = table.shape[1]
    top_k = candidates.shape[-1]
    assert blk >= 2 and score_weight.shape == (rank, hidden) and anchor_ids.shape == (n,)
    assert candidates.shape == (n, blk - 1, top_k) and candidates.dtype == torch.int64
    assert gate_weight.shape == (hidden, hidden + rank) and out_weight.shape == (hidden, rank)
    assert h.dtype == score_weight.dtype == table.dtype == gate_weight.dtype == out_weight.dtype, \
        "h and the weights must share a dtype"
    _kernels.build()
    h, score_weight, table, gate_weight, gate_bias, out_weight = (
        x.contiguous() for x in (h, score_weight, table, gate_weight, gate_bias, out_weight))
    blocks = blocks or blocks_for(n, blk)
    out = torch.empty_like(h) if out is None else out
    assert out.shape == h.shape and out.dtype == h.dtype and out.is_contiguous()
    rows = n * blk
    hid, mix = blocks.hidden, blocks.mix
    k_split = _cdiv(_cdiv(hidden, blocks.hidden_split), hid.block_k) * hid.block_k
    splits = _cdiv(hidden, k_split)
    part = torch.empty(splits, rows, hidden + rank, dtype=torch.float32, device=h.device)
    precision, interpret = _precision(h.dtype), _interpret()
    grid = (_cdiv(rows, hid.block_m), _cdiv(hidden, hid.block_n) + _cdiv(rank, hid.block_n), splits)
    injection_hidden_fwd_kernel[grid](h, gate_weight, score_weight, part, rows, hidden, k_split, R=rank,
                                      BLOCK_M=hid.block_m, BLOCK_N=hid.block_n, BLOCK_K=hid.block_k,
                                      DOT_PRECISION=precision, INTERPRET=interpret, num_warps=hid.warps,
                                      num_stages=hid.stages)
    span = mix.block_n * blocks.mix_tiles_n
    candidate_gate_fwd_kernel[(_cdiv(rows, mix.block_m), _cdiv(hidden, span))](
        h, part, table, anchor_ids.contiguous(), candidates.contiguous(), gate_weight, gate_bias, out_weight, out,
        rows, hidden, B=blk, R=rank, RP=max(16, _next_pow2(rank)), K=top_k, S=splits,
        BLOCK_M=mix.block_m, BLOCK_N=mix.block_n, TILES_N=blocks.mix_tiles_n, DOT_PRECISION=precision,
        INTERPRET=interpret, num_warps=mix.warps)
    return out
