"""The kernel benchmark's training case: the fused cross-entropy gradients of one loss chunk
(`dspine.kernels.cross_entropy`) against the trainer's PyTorch chunk (`train.losses.chunk_gradients`,
eager and compiled), at the chunk the trainer takes for each shape's vocabulary."""

from __future__ import annotations

import torch

from dspine.bench.kernels_harness import Run
from dspine.kernels.cross_entropy import cross_entropy_grads
from dspine.train.losses import CHUNK_BYTES, chunk_gradients


def cross_entropy_case(run: Run, shape_name: str, shape: dict, levels: int) -> None:
    """One chunk of `levels` cumulative logit levels (1: the layer-wise loss; 2: final and transition)
    of bf16 logits [rows, V], rows the trainer's chunk (`linear_cross_entropy`'s default, 8 in the
    smoke run), recorded as case `cross_entropy_p<levels>` with bs = rows. The byte floor is the
    kernel's traffic: the logits read twice and the gradients written once, 6·P bytes a logit."""
    cfg, device = run.cfg, run.cfg.device
    vocab = shape["vocab"]
    rows = 8 if cfg.smoke else max(1, CHUNK_BYTES // (vocab * (6 * levels + 8)))
    g = torch.Generator(device=device).manual_seed(levels)
    parts = [(torch.randn(rows, vocab, generator=g, device=device) * 3).to(cfg.dtype) for _ in range(levels)]
    labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
    weights = torch.rand(rows, generator=g, device=device)
    coefs = (1.0, 1.0)[:levels]
    name = f"cross_entropy_p{levels}"
    got, want = cross_entropy_grads(parts, labels, weights, coefs), chunk_gradients(parts, labels, weights, coefs)
    ok = (all(torch.allclose(a.float(), b.float(), atol=2e-3, rtol=1e-2) for a, b in zip(got[0], want[0]))
          and torch.allclose(got[1], want[1], atol=1e-3, rtol=1e-4) and torch.equal(got[2], want[2]))
    run.details["correctness"].append({"kernel": name, "shape": shape_name, "bs": rows, "ok": bool(ok)})
    run.measure(name, shape_name, rows, lambda: cross_entropy_grads(parts, labels, weights, coefs),
                lambda: chunk_gradients(parts, labels, weights, coefs), 1 if cfg.smoke else 5,
                3 * levels * rows * vocab * parts[0].element_size(),
                compile_spec=(chunk_gradients, name, lambda fn: lambda: fn(parts, labels, weights, coefs)))
