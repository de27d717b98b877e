"""Packed-key running top-k: the Triton helpers shared by the split-V top-k kernels, and their PyTorch twin.

A score and its column index are packed into one int64 key: the order-preserving int32 of the
fp32 score in the high half, `0xFFFFFFFF - index` in the low half. Key order is then the selection
order: higher score first, and among equal scores the LOWER index first (the tie rule of every
kernel built on these keys, and of `ordered_keys_reference`). All keys of a row are distinct, so
one max-reduction yields value and argmax, and a k-th key identifies its slot. Canonical forms
before packing: -0.0 is +0.0 (they tie, as `==` says), every NaN is the positive NaN 0x7FFFFFFF,
which ranks above +inf (as `torch.topk` and `torch.sort` rank NaN).

Real keys have a high half of at least ord(-inf) = -2^31 + 2^23 - 1, so three literal sentinels lie
outside them: -(2^63 - 1) for masked entries, -(2^63 - 2) + slot for a running top-k's empty slots
(distinct, below any real key, above the masked one) and 2^63 - 1 for the padding slots >= k
(never the minimum, never replaced).

Running top-k (`_insert_rows`): the running list b_top [R, KP] of each row and a tile of candidate
keys [R, C]; while some row's best remaining candidate beats its k-th key, the k-th is replaced by
it (at most k rounds; after the first tiles of a stream usually none).

Users: dspine/kernels/adjacent_injection.py (scores of the transfer space), dspine/kernels/logits_topk.py (draft
logits). Their modules import these names and pass `_kernels` to their own `LazyJit(uses=...)`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dspine import env
from dspine.kernels.lazy_jit import LazyJit

MASKED_KEY = -(2**63 - 1)
EMPTY_KEY = -(2**63 - 2)      # + slot
PAD_KEY = 2**63 - 1


def ordered_keys_reference(scores: Tensor) -> Tensor:
    """PyTorch twin of `_pack_keys`: scores [..., V] (any float dtype) -> int64 keys [..., V] whose
    descending order is the selection order (score, then lower index first; NaN on top)."""
    s = scores.float()
    s = torch.where(s == 0, torch.zeros_like(s), s)                      # -0.0 -> +0.0
    bits = s.contiguous().view(torch.int32)
    bits = torch.where(s.isnan(), torch.full_like(bits, 0x7FFFFFFF), bits)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    index = torch.arange(s.shape[-1], device=s.device, dtype=torch.int64)
    return (ordered << 32) | (0xFFFFFFFF - index)


# ------------------------------------------------------------------------------------------ Triton
# Handed to triton.jit at the first launch (dspine/kernels/lazy_jit.py).
_kernels = LazyJit(globals())


@_kernels.jit
def _ordered_bits(b_s):
    """fp32 scores -> int32 with the same order (canonical -0.0 and NaN, see the module docstring)."""
    b_bits = tl.where(b_s == 0.0, 0.0, b_s).to(tl.int32, bitcast=True)
    b_bits = tl.where(b_s != b_s, 0x7FFFFFFF, b_bits)  # noqa: PLR0124 (the NaN test)
    return tl.where(b_bits < 0, b_bits ^ 0x7FFFFFFF, b_bits)


@_kernels.jit
def _key_of(b_ord, b_idx):
    """int32 ordered bits and column indices -> int64 keys (lower index wins a tie)."""
    return (b_ord.to(tl.int64) << 32) | (0xFFFFFFFF - b_idx.to(tl.int64))


@_kernels.jit
def _pack_keys(b_s, b_idx):
    return _key_of(_ordered_bits(b_s), b_idx)


@_kernels.jit
def _unpack_keys(b_key):
    """int64 keys -> (fp32 scores, int32 indices)."""
    b_hi = b_key >> 32
    b_ord = b_hi.to(tl.int32)
    b_bits = tl.where(b_ord < 0, b_ord ^ 0x7FFFFFFF, b_ord)
    return b_bits.to(tl.float32, bitcast=True), (0xFFFFFFFF - (b_key - (b_hi << 32))).to(tl.int32)


@_kernels.jit
def _insert_rows(b_top, b_key):
    """Merge candidate keys b_key [R, C] into the running top-k b_top [R, KP], row by row: while some
    row's best remaining candidate beats its k-th key, that candidate replaces the k-th and leaves
    the tile (at most k rounds)."""
    b_min = tl.min(b_top, axis=1)                                  # [R] current k-th key
    b_max = tl.max(b_key, axis=1)                                  # [R] best remaining candidate
    while tl.max((b_max > b_min).to(tl.int32), axis=0) > 0:
        b_ins = b_max > b_min
        b_top = tl.where((b_top == b_min[:, None]) & b_ins[:, None], b_max[:, None], b_top)
        b_key = tl.where(b_key == b_max[:, None], -9223372036854775807, b_key)
        b_min, b_max = tl.min(b_top, axis=1), tl.max(b_key, axis=1)
    return b_top


@_kernels.jit
def _empty_top(BLOCK_M: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """[BLOCK_M, KP] running top-k with nothing in it: distinct empty keys in slots < K, padding above."""
    o_k = tl.arange(0, KP)
    b_top = tl.where(o_k < K, -9223372036854775806 + o_k.to(tl.int64), 9223372036854775807)  # [KP]
    return tl.zeros([BLOCK_M, KP], dtype=tl.int64) + b_top[None, :]


# ------------------------------------------------------------------------------------ launch helpers
def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs keep the CPU tests quick


def _interpret() -> bool:
    return env.TRITON_INTERPRET.get()
