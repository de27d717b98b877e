"""Top-k of the draft logits in one launch: PyTorch reference (the oracle) and a split-V Triton kernel.

`select_tokens` (mode "transition") starts from the K best candidates of every proposal slot:
logits [M, V] -> (values fp32 [M, K] sorted descending, indices int64 [M, K]), M = bs x N rows
(N = 15), V = 49k-152k, K = 4-16. Selection order, of the reference and the kernel alike: higher
logit first, an exact tie to the LOWER index, -0.0 ties +0.0, NaN above +inf (as torch.topk ranks
it). The order comes from packed int64 keys (dspine/kernels/topk_keys.py, shared with the injection's
top-k): order-preserving float bits high, `0xFFFFFFFF - index` low, so keys are distinct and one
max-reduction yields the value and its index.

Why a kernel: at bs 1 the logits are 15 x 152k x 2 B = 4.6 MB, about 1 us of HBM traffic (and
usually still in L2 after the lm_head GEMM), while torch.topk over 152k columns runs a multi-pass
radix select on few rows. The work is latency-bound, so `logits_topk_fwd_kernel` spreads every
row over S slices: grid (row tiles, S), rows x S a few times the SM count (`programs_per_sm`,
default 4; on the H200's 132 SMs: bs 1, 15 rows x 30 slices of 5 tiles; bs 8, 120 x 5; bs 32,
480 x 2; from 528 rows on, one slice a row and no merge). A program streams its slice in
[BLOCK_M, BLOCK_V] tiles (the next tile's load issued before the current one is inserted) and
keeps a running top-K per row in registers (`_insert_rows`). A tile is first screened in int32:
only if some row's largest ordered value beats that row's current k-th one are the int64 keys
built and inserted (after the first tiles of a slice, rarely on real logits), so most tiles cost
a load, a convert and one int32 max-reduction.

Merging the S partial lists (`merge`):
- "ticket" (default): one launch. A program writes its rows' K keys to `part` [M, S, K], then takes
  a ticket (an acq_rel atomic add on its row tile's counter, after a CTA barrier so every thread's
  stores precede the release); the program that draws the last ticket (S - 1) merges the S lists
  of its rows (loads bypass L1), writes the sorted result and resets the counter to zero. The
  default because the merge is tiny (S*K keys a row, L2-resident): a second launch adds a kernel
  boundary (the grid drains, the next kernel launches and ramps up) to save one atomic per
  program, and with tickets the rows whose slices finish early merge while others still scan.
  (Measured on the H200 at Qwen3-8B shapes, bs 1: 0.0201 ms against 0.0199 for merge="kernel",
  equal within noise; kernels_h200_details.json.) The counters
  live in a per-device buffer that is zero between launches (every launch returns them to zero);
  it is allocated once, outside graph capture (a launch captured before any eager launch on that
  device merges with "kernel" instead, see `_tickets`). Launches running concurrently on two
  streams of one device must not share it: pass merge="kernel" there.
- "kernel": the partial lists go to `logits_topk_merge_fwd_kernel`, one program per row tile. No
  shared state; one more launch.
With S = 1 a program owns its rows' whole top-k and writes it directly (no partials, no merge).

Output: the K keys of a row are ranked by pairwise comparison (a [KP, KP] tile; K is small) and
scattered to their sorted positions. Values are the logits converted to fp32 (exact for bf16/fp16).

Knobs (keyword arguments of `logits_topk`, swept by dspine/bench/kernels.py): `slices` (S; default
from `programs_per_sm` x SMs / row tiles, capped at one tile a slice), `block_m` rows a program,
`block_v` columns a tile, `warps`, `merge`. Static shapes, no host sync, no data-dependent
allocation: CUDA-graph capturable (`out=` takes preallocated outputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspine.kernels.lazy_jit import LazyJit
from dspine.kernels.topk_keys import (
    _cdiv,
    _empty_top,
    _insert_rows,
    _key_of,
    _multiprocessors,
    _next_pow2,
    _ordered_bits,
    _unpack_keys,
    ordered_keys_reference,
)
from dspine.kernels.topk_keys import _kernels as _topk_kernels

MERGES = ("ticket", "kernel")


def logits_topk_reference(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> (values fp32 [..., k] descending, indices int64 [..., k]).

    torch.topk over the packed int64 keys (`ordered_keys_reference`), which fixes the order where
    torch.topk of the logits leaves it open: an exact tie goes to the lower index (the order of
    `torch.sort(logits, descending=True, stable=True)[..., :k]`, which the tests also check)."""
    idx = ordered_keys_reference(logits).topk(k, dim=-1).indices
    return logits.float().gather(-1, idx), idx


# ------------------------------------------------------------------------------------------ Triton
# Handed to triton.jit at the first launch (dspine/kernels/lazy_jit.py); the packed-key helpers are
# dspine/kernels/topk_keys.py's.
_kernels = LazyJit(globals(), uses=(_topk_kernels,))


@_kernels.jit
def _store_sorted(b_top, values, indices, o_m, m_m, K: tl.constexpr, KP: tl.constexpr):
    """Write the running top-k b_top [BLOCK_M, KP] (K real, distinct keys in slots < K) of rows o_m
    sorted: slot j goes to position rank_j = #{keys above it}."""
    o_k = tl.arange(0, KP)
    m_k = o_k < K
    b_key = tl.where(m_k[None, :], b_top, -9223372036854775807)                     # padding ranks last
    b_rank = tl.sum((b_key[:, None, :] > b_key[:, :, None]).to(tl.int32), axis=2)    # [BLOCK_M, KP]
    b_val, b_idx = _unpack_keys(b_top)
    o_out = o_m.to(tl.int64)[:, None] * K + b_rank
    m_out = m_m[:, None] & m_k[None, :]
    tl.store(values + o_out, b_val, mask=m_out)
    tl.store(indices + o_out, b_idx.to(tl.int64), mask=m_out)


@_kernels.jit
def _merge_partials(part, o_m, m_m, S, K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """The top-k of rows o_m from their S partial lists part [M, S, K] (BLOCK_C keys per step)."""
    b_top = _empty_top(BLOCK_M, K, KP)
    o_c = tl.arange(0, BLOCK_C)
    o_row = o_m.to(tl.int64) * S * K
    for c0 in range(0, S * K, BLOCK_C):
        m_c = m_m[:, None] & (c0 + o_c < S * K)[None, :]
        b_key = tl.load(part + o_row[:, None] + c0 + o_c[None, :], mask=m_c, other=-9223372036854775807,
                        cache_modifier=".cg")                      # [BLOCK_M, BLOCK_C], written by other programs
        b_key = tl.where(b_key > -9223372036854775807 + KP, b_key, -9223372036854775807)  # a short slice's empty slots
        b_top = _insert_rows(b_top, b_key)
    return b_top


@_kernels.jit
def logits_topk_fwd_kernel(
    x,  # [M, V] logits (rows stride_m apart, unit column stride), any float dtype
    part,  # [M, S, K] int64 partial top-k keys of each slice (MERGE > 0)
    tickets,  # [cdiv(M, BLOCK_M)] int32 arrival counters, zero between launches (MERGE == 1)
    values,  # [M, K] fp32, sorted descending
    indices,  # [M, K] int64
    M,
    V,
    stride_m,
    CHUNK,  # columns per slice, a multiple of BLOCK_V
    S,  # slices per row: cdiv(V, CHUNK)
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,  # partial keys per merge step
    MERGE: tl.constexpr,  # 0: S == 1, write directly; 1: last program of a row tile merges; 2: merge kernel
):
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    o_m = i_t * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_x = x + o_m.to(tl.int64)[:, None] * stride_m                  # [BLOCK_M, 1] row pointers
    v_lo = i_s * CHUNK
    v_hi = tl.minimum(v_lo + CHUNK, V)

    b_top = _empty_top(BLOCK_M, K, KP)                              # [BLOCK_M, KP]
    o_v = v_lo + tl.arange(0, BLOCK_V)
    b_x = tl.load(o_x + o_v[None, :], mask=m_m[:, None] & (o_v < v_hi)[None, :], other=0.0)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_x = m_m[:, None] & (o_v < v_hi)[None, :]
        # Ordered int32 of the tile (padding below every real value), then prefetch the next tile.
        b_ord = tl.where(m_x, _ordered_bits(b_x.to(tl.float32)), -2147483647)  # [BLOCK_M, BLOCK_V]
        o_nxt = o_v + BLOCK_V
        b_x = tl.load(o_x + o_nxt[None, :], mask=m_m[:, None] & (o_nxt < v_hi)[None, :], other=0.0)
        # Screen: does any row's best value beat its k-th (empty slots: the lowest int32)? An equal
        # value cannot: its column is higher than every column this program has seen (tie rule).
        b_kth = (tl.min(b_top, axis=1) >> 32).to(tl.int32)         # [BLOCK_M]
        if tl.max((tl.max(b_ord, axis=1) > b_kth).to(tl.int32), axis=0) > 0:
            b_key = tl.where(m_x, _key_of(b_ord, o_v[None, :]), -9223372036854775807)
            b_top = _insert_rows(b_top, b_key)

    if MERGE == 0:
        _store_sorted(b_top, values, indices, o_m, m_m, K, KP)
    else:
        o_k = tl.arange(0, KP)
        tl.store(part + (o_m.to(tl.int64)[:, None] * S + i_s) * K + o_k[None, :], b_top,
                 mask=m_m[:, None] & (o_k < K)[None, :])
        if MERGE == 1:
            tl.debug_barrier()                                      # all threads' partials before the release
            ticket = tl.atomic_add(tickets + i_t, 1, sem="acq_rel")
            if ticket == S - 1:                                     # the last slice of this row tile to finish
                b_top = _merge_partials(part, o_m, m_m, S, K, KP, BLOCK_M, BLOCK_C)
                _store_sorted(b_top, values, indices, o_m, m_m, K, KP)
                tl.atomic_xchg(tickets + i_t, 0)                    # zero again for the next launch


@_kernels.jit
def logits_topk_merge_fwd_kernel(
    part,  # [M, S, K] int64 partial top-k keys
    values,  # [M, K] fp32
    indices,  # [M, K] int64
    M,
    S,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    b_top = _merge_partials(part, o_m, m_m, S, K, KP, BLOCK_M, BLOCK_C)
    _store_sorted(b_top, values, indices, o_m, m_m, K, KP)


# Arrival counters of the "ticket" merge, per device. Every launch leaves them at zero. A larger
# buffer is appended, never swapped in for a smaller one: graphs captured earlier keep using the
# address they recorded, which must stay allocated (and zero) for as long as the process lives.
_TICKETS: dict[torch.device, list[Tensor]] = {}


def _tickets(device: torch.device, count: int) -> Tensor | None:
    """A zeroed int32 counter buffer of >= count entries on `device`; None when one would have to be
    allocated during CUDA-graph capture (the capture would own its memory and its zeroing)."""
    bufs = _TICKETS.get(device)
    if bufs and bufs[-1].numel() >= count:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    _TICKETS.setdefault(device, []).append(torch.zeros(max(count, 1 << 14), dtype=torch.int32, device=device))
    return _TICKETS[device][-1]


def topk_grid(rows: int, vocab: int, device: torch.device, *, slices: int | None = None, block_m: int = 1,
              block_v: int = 1024, programs_per_sm: int = 4) -> tuple[int, int, int]:
    """(row tiles, slices S, columns per slice) of a launch. S defaults to enough programs for
    `programs_per_sm` per multiprocessor, at most one tile of `block_v` columns a slice."""
    tiles = _cdiv(rows, block_m)
    want = slices if slices is not None else _cdiv(programs_per_sm * _multiprocessors(device), tiles)
    want = max(1, min(want, _cdiv(vocab, block_v)))
    chunk = _cdiv(_cdiv(vocab, want), block_v) * block_v
    return tiles, _cdiv(vocab, chunk), chunk


def logits_topk(logits: Tensor, k: int, *, out: tuple[Tensor, Tensor] | None = None, slices: int | None = None,
                block_m: int = 1, block_v: int = 1024, warps: int = 4, programs_per_sm: int = 4,
                merge: str = "ticket") -> tuple[Tensor, Tensor]:
    """Triton `logits_topk_reference`: logits [..., V] (fp32/bf16/fp16, unit stride along V) ->
    (values fp32 [..., k] sorted descending, indices int64 [..., k]), written into `out` = (values,
    indices) when given (contiguous). Knobs: see the module docstring; the defaults are for the
    H200 at 15-960 rows of 49k-152k columns."""
    *lead, vocab = logits.shape
    assert 1 <= k <= vocab, f"k={k} must lie in [1, V={vocab}]"
    assert merge in MERGES, f"merge={merge!r}: use one of {MERGES}"
    assert block_m >= 1 and block_m & (block_m - 1) == 0 and block_v >= 16 and block_v & (block_v - 1) == 0
    _kernels.build()
    x = logits.reshape(-1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if out is None:
        out = (torch.empty(*lead, k, dtype=torch.float32, device=logits.device),
               torch.empty(*lead, k, dtype=torch.int64, device=logits.device))
    values, indices = out
    assert values.shape == (*lead, k) and values.dtype == torch.float32 and values.is_contiguous()
    assert indices.shape == (*lead, k) and indices.dtype == torch.int64 and indices.is_contiguous()
    if rows == 0:
        return values, indices
    tiles, splits, chunk = topk_grid(rows, vocab, logits.device, slices=slices, block_m=block_m, block_v=block_v,
                                     programs_per_sm=programs_per_sm)
    kp = max(2, _next_pow2(k))
    block_c = max(16, min(_next_pow2(splits * k), 4096 // block_m))
    if splits == 1:
        mode, part, tickets = 0, values, values                    # unused pointers
    else:
        part = torch.empty(rows, splits, k, dtype=torch.int64, device=logits.device)
        tickets = _tickets(logits.device, tiles) if merge == "ticket" else None
        mode = 1 if tickets is not None else 2
        tickets = part if tickets is None else tickets
    logits_topk_fwd_kernel[(tiles, splits)](x, part, tickets, values, indices, rows, vocab, x.stride(0), chunk, splits,
                                            K=k, KP=kp, BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_C=block_c,
                                            MERGE=mode, num_warps=warps)
    if mode == 2:
        logits_topk_merge_fwd_kernel[(tiles,)](part, values, indices, rows, splits, K=k, KP=kp, BLOCK_M=block_m,
                                               BLOCK_C=block_c, num_warps=warps)
    return values, indices
