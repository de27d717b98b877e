"""Block-verify attention with the prefix split across programs: PyTorch reference and Triton kernel.

A speculative round runs N query tokens per request through attention (the target's verify, the
drafter's block): each request b has a prefix of L_b tokens in the paged KV cache (slots
kv_indices[kv_indptr[b] : kv_indptr[b+1]]) and its own N new keys/values (rows b*N .. b*N+N-1 of
k / v). Query token t of the block sees the whole prefix and new token j when j <= t (causal, the
target's verify) or every new token (not causal, the drafter's bidirectional block). Grouped-query
heads: query head h reads KV head h // (Hq / Hkv).

SGLang's triton prefill kernel gives each (request, query head) one program that walks the whole
prefix alone: at one request that is Hq programs on a 132-SM GPU, each looping over L / 64 key
tiles. Here, flash-decode style, two launches with static shapes (CUDA-graph safe, no host sync):

- `verify_attention_split_fwd_kernel`, grid (bs, Hkv * R, S + 1): program (b, (h, r), s < S) takes
  split s of request b's prefix (S equal chunks of whole key tiles, sized on the device from L_b)
  for row tile r of the G*N query rows of KV head h (G = Hq / Hkv query heads x N tokens, row
  t*G + g; R tiles of at most 8k query elements: one tile up to G*N*D = 8192); program s = S takes
  the N new keys with the causal mask. Each writes its normalised partial output and
  log-sum-exp (a split without keys: output 0, LSE -inf, both written).
- `verify_attention_merge_fwd_kernel`, grid (bs*N, Hq): the S + 1 partials merged by their LSEs.

Shapes: q [bs*N, Hq, D], k / v [bs*N, Hkv, D], k_buffer / v_buffer [slots, Hkv, D] (any strides
along the first two dims, unit stride along D), out [bs*N, Hq, D]. D a power of two, 16..256.
fp32 accumulation; the output in out's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dspine.kernels.lazy_jit import LazyJit

DEFAULT_SPLITS = 16


def verify_attention_reference(q: Tensor, k: Tensor, v: Tensor, k_buffer: Tensor, v_buffer: Tensor,
                               kv_indptr: Tensor, kv_indices: Tensor, *, block: int, causal: bool,
                               scale: float) -> Tensor:
    """The attention of every request's block (see the module docstring), fp32 math, in q's dtype:
    [bs*N, Hq, D]."""
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty_like(q)
    for b in range(tokens // block):
        rows = slice(b * block, (b + 1) * block)
        slots = kv_indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].long()
        keys = torch.cat([k_buffer[slots], k[rows]]).float().repeat_interleave(hq // hkv, 1)     # [L+N, Hq, D]
        values = torch.cat([v_buffer[slots], v[rows]]).float().repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("thd,shd->hts", q[rows].float(), keys) * scale                    # [Hq, N, L+N]
        prefix = slots.numel()
        if causal:
            t = torch.arange(block, device=q.device)
            future = t[None, :] > t[:, None]                                                     # [N, N]: j > t
            scores[:, :, prefix:] = scores[:, :, prefix:].masked_fill(future, float("-inf"))
        out[rows] = torch.einsum("hts,shd->thd", scores.softmax(-1), values).to(q.dtype)
    return out


# ------------------------------------------------------------------------------------------ Triton
# Handed to triton.jit at the first launch (dspine/kernels/lazy_jit.py).
_kernels = LazyJit(globals())


@_kernels.jit
def verify_attention_split_fwd_kernel(
    q, k, v, k_buffer, v_buffer,  # see the module docstring
    kv_indptr,  # [bs + 1]
    kv_indices,  # [>= sum L_b]
    part_o,  # [bs*N, Hq, S + 1, D] fp32
    part_lse,  # [bs*N, Hq, S + 1] fp32
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    scale_log2,  # softmax scale x log2(e)
    Hq,
    R,  # row tiles per KV head: cdiv(N*G, BLOCK_M)
    N: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64) // R
    i_r = tl.program_id(1) % R
    i_s = tl.program_id(2)
    o_m = i_r * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D)
    t = o_m // G                                                        # query token of each row
    head = i_h * G + o_m % G                                            # its query head
    m_m = o_m < N * G
    row = i_b * N + t
    qt = tl.load(q + row[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :], mask=m_m[:, None],
                 other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if i_s < S:
        start = tl.load(kv_indptr + i_b).to(tl.int64)
        length = tl.load(kv_indptr + i_b + 1).to(tl.int64) - start
        tiles = tl.cdiv(length, BLOCK_N)
        per_split = tl.cdiv(tiles, S)
        lo = i_s * per_split * BLOCK_N
        hi = tl.minimum(lo + per_split * BLOCK_N, length)
        for n0 in range(lo, hi, BLOCK_N):
            o_n = n0 + tl.arange(0, BLOCK_N)
            m_n = o_n < hi
            slot = tl.load(kv_indices + start + o_n, mask=m_n, other=0).to(tl.int64)
            kt = tl.load(k_buffer + slot[:, None] * stride_kbs + i_h * stride_kbh + o_d[None, :], mask=m_n[:, None],
                         other=0.0)
            s = tl.dot(qt, tl.trans(kt)) * scale_log2
            s = tl.where(m_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            vt = tl.load(v_buffer + slot[:, None] * stride_vbs + i_h * stride_vbh + o_d[None, :], mask=m_n[:, None],
                         other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    else:
        o_e = tl.arange(0, BLOCK_E)
        m_e = o_e < N
        new = i_b * N + o_e
        kt = tl.load(k + new[:, None] * stride_kt + i_h * stride_kh + o_d[None, :], mask=m_e[:, None], other=0.0)
        s = tl.dot(qt, tl.trans(kt)) * scale_log2
        keep = m_e[None, :]
        if CAUSAL:
            keep = keep & (o_e[None, :] <= t[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_i = tl.max(s, axis=1)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(s - m_safe[:, None])
        vt = tl.load(v + new[:, None] * stride_vt + i_h * stride_vh + o_d[None, :], mask=m_e[:, None], other=0.0)
        acc = tl.dot(p.to(vt.dtype), vt)
        l_i = tl.sum(p, axis=1)
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))     # log2 units
    cell = (row * Hq + head) * (S + 1) + i_s
    tl.store(part_o + cell[:, None] * D + o_d[None, :], out, mask=m_m[:, None])
    tl.store(part_lse + cell, lse, mask=m_m)


@_kernels.jit
def verify_attention_merge_fwd_kernel(
    part_o,  # [bs*N, Hq, S + 1, D] fp32
    part_lse,  # [bs*N, Hq, S + 1] fp32
    out,  # [bs*N, Hq, D]
    stride_ot, stride_oh,
    Hq,
    S: tl.constexpr,
    SP: tl.constexpr,
    D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_s = tl.arange(0, SP)
    o_d = tl.arange(0, D)
    m_s = o_s < S + 1
    base = (i_t * Hq + i_h) * (S + 1)
    lse = tl.load(part_lse + base + o_s, mask=m_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))                                 # the causal split is never empty
    parts = tl.load(part_o + (base + o_s)[:, None] * D + o_d[None, :], mask=m_s[:, None], other=0.0)
    merged = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out + i_t * stride_ot + i_h * stride_oh + o_d, merged.to(out.dtype.element_ty))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def verify_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, k_buffer: Tensor, v_buffer: Tensor,
                     kv_indptr: Tensor, kv_indices: Tensor, *, block: int, causal: bool, scale: float,
                     splits: int = DEFAULT_SPLITS) -> Tensor:
    """Triton `verify_attention_reference`, written into `out` (returned). `splits`: prefix splits
    per request (S above)."""
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    assert tokens % block == 0 and hq % hkv == 0 and d & (d - 1) == 0 and 16 <= d <= 256
    assert k.shape == v.shape == (tokens, hkv, d) and out.shape == q.shape
    assert k_buffer.shape[1:] == v_buffer.shape[1:] == (hkv, d)
    for x in (q, k, v, out, k_buffer, v_buffer):
        assert x.stride(-1) == 1
    bs, groups = tokens // block, hq // hkv
    _kernels.build()
    part_o = torch.empty(tokens, hq, splits + 1, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(tokens, hq, splits + 1, dtype=torch.float32, device=q.device)
    rows = block * groups
    block_m = max(16, min(_next_pow2(rows), 8192 // d))          # a q tile of at most 8k elements
    row_tiles = -(-rows // block_m)
    verify_attention_split_fwd_kernel[(bs, hkv * row_tiles, splits + 1)](
        q, k, v, k_buffer, v_buffer, kv_indptr, kv_indices, part_o, part_lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        scale * math.log2(math.e), hq, row_tiles, N=block, G=groups, S=splits, D=d, CAUSAL=causal, BLOCK_M=block_m,
        BLOCK_N=64 if d <= 128 else 32, BLOCK_E=max(16, _next_pow2(block)), num_warps=4 if block_m <= 64 else 8)
    verify_attention_merge_fwd_kernel[(tokens, hq)](part_o, part_lse, out, out.stride(0), out.stride(1), hq, S=splits,
                                                SP=_next_pow2(splits + 1), D=d, num_warps=1 if d <= 64 else 2)
    return out
