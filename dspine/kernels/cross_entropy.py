"""Fused cross-entropy gradients of one chunk of rows: the elementwise half of the trainer's
vocabulary losses in two passes over the logits.

Contract (the reference is `dspine.train.losses.chunk_gradients`): P <= 2 products parts[p] [C, V]
(bf16 or fp32; level p's logits are z_p = Σ_{k <= p} parts[k], taken in fp32), labels [C] int64 in
[0, V), weights [C] fp32, coefs P floats ->

    grads: P tensors [C, V] in the parts' dtype, G_k = Σ_{p >= k} coefs[p]·w·(softmax(z_p) − onehot)
    ce:    [P, C] fp32, logsumexp(z_p) − z_p[label]
    argmax:[P, C] int64, the first index of the largest z_p

`cross_entropy_grads_kernel`, one program per row: the first pass walks the row in BLOCK_V tiles
keeping each level's running max, rescaled sum of exponentials and argmax (online softmax), the
second recomputes the levels tile by tile and writes every G_k. The logits are read twice and each
gradient written once, in the parts' dtype: 6·P bytes a logit in bf16, where the reference's
separate fp32 passes (cast, logsumexp, exp, scale, scatter, sum, cast back) move several times that.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspine.kernels.lazy_jit import LazyJit

_kernels = LazyJit(globals())
BLOCK_V = 2048  # the tile: logits a program reads at once (the next power of two of a smaller vocabulary)


# ------------------------------------------------------------------------------------------ Triton
# Handed to triton.jit at the first launch (dspine/kernels/lazy_jit.py).
@_kernels.jit
def cross_entropy_grads_kernel(part0, part1, labels, weights, grad0, grad1, ce, argmax, C, V, coef0, coef1,
                               TWO: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * V
    cols = tl.arange(0, BLOCK_V)
    label = tl.load(labels + row)
    w = tl.load(weights + row).to(tl.float32)
    m0 = tl.zeros((), tl.float32) - float("inf")
    s0 = tl.zeros((), tl.float32)
    i0 = tl.zeros((), tl.int64)
    m1 = tl.zeros((), tl.float32) - float("inf")
    s1 = tl.zeros((), tl.float32)
    i1 = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        inside = offs < V
        z0 = tl.load(part0 + base + offs, mask=inside, other=-float("inf")).to(tl.float32)
        top0 = tl.max(z0, 0)
        at0 = tl.argmax(z0, 0).to(tl.int64)
        i0 = tl.where(top0 > m0, start + at0, i0)  # strictly larger: the first index wins
        new0 = tl.maximum(m0, top0)
        s0 = s0 * tl.exp(m0 - new0) + tl.sum(tl.exp(z0 - new0), 0)
        m0 = new0
        if TWO:
            z1 = z0 + tl.load(part1 + base + offs, mask=inside, other=0.0).to(tl.float32)
            top1 = tl.max(z1, 0)
            at1 = tl.argmax(z1, 0).to(tl.int64)
            i1 = tl.where(top1 > m1, start + at1, i1)
            new1 = tl.maximum(m1, top1)
            s1 = s1 * tl.exp(m1 - new1) + tl.sum(tl.exp(z1 - new1), 0)
            m1 = new1
    lse0 = m0 + tl.log(s0)
    at_label0 = tl.load(part0 + base + label).to(tl.float32)
    tl.store(ce + row, lse0 - at_label0)
    tl.store(argmax + row, i0)
    lse1 = lse0
    if TWO:
        lse1 = m1 + tl.log(s1)
        at_label1 = at_label0 + tl.load(part1 + base + label).to(tl.float32)
        tl.store(ce + C + row, lse1 - at_label1)
        tl.store(argmax + C + row, i1)
    scale0 = coef0 * w
    scale1 = coef1 * w
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        inside = offs < V
        hot = (offs == label).to(tl.float32)
        z0 = tl.load(part0 + base + offs, mask=inside, other=0.0).to(tl.float32)
        g0 = scale0 * (tl.exp(z0 - lse0) - hot)
        if TWO:
            z1 = z0 + tl.load(part1 + base + offs, mask=inside, other=0.0).to(tl.float32)
            g1 = scale1 * (tl.exp(z1 - lse1) - hot)
            tl.store(grad1 + base + offs, g1.to(grad1.dtype.element_ty), mask=inside)
            g0 = g0 + g1
        tl.store(grad0 + base + offs, g0.to(grad0.dtype.element_ty), mask=inside)


def cross_entropy_grads(parts: list[Tensor], labels: Tensor, weights: Tensor,
                        coefs: tuple[float, ...]) -> tuple[list[Tensor], Tensor, Tensor]:
    """The module docstring's contract, one launch of C programs. parts: 1 or 2 contiguous [C, V]
    tensors of one dtype on one device; labels [C] int64; weights [C] fp32; coefs as many floats."""
    if not 1 <= len(parts) <= 2 or len(coefs) != len(parts):
        raise ValueError(f"cross_entropy_grads takes 1 or 2 parts with a coefficient each, got {len(parts)} "
                         f"parts and {len(coefs)} coefficients")
    _kernels.build()
    parts = [p.contiguous() for p in parts]
    rows, vocab = parts[0].shape
    two = len(parts) == 2
    grads = [torch.empty_like(p) for p in parts]
    ce = torch.empty(len(parts), rows, dtype=torch.float32, device=parts[0].device)
    argmax = torch.empty(len(parts), rows, dtype=torch.long, device=parts[0].device)
    if rows:
        tile = min(BLOCK_V, 1 << (vocab - 1).bit_length())
        cross_entropy_grads_kernel[(rows,)](
            parts[0], parts[-1], labels.contiguous(), weights.float().contiguous(), grads[0], grads[-1], ce, argmax,
            rows, vocab, float(coefs[0]), float(coefs[-1]), TWO=two, BLOCK_V=tile)
    return grads, ce, argmax
