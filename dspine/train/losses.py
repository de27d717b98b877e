"""The training objective, with every vocabulary-sized loss computed in chunks of rows.

`linear_cross_entropy` is the one vocabulary loss. N rows, P levels of logits, each level adding a
linear head to the previous one:

    z_p = Σ_{k ≤ p} xs[k] · ws[k]ᵀ            xs[k]: [N, D_k], ws[k]: [V, D_k], z_p: [N, V]
    level_p = Σ_i row_weights[i] · CE(z_p[i], labels[i])
    loss = Σ_p coefs[p] · level_p

Final and transition CE are two levels (h · E_outᵀ, then + left · Uᵀ: the transition scores), the
layer-wise CE is one level (q_l · Uᵀ, the five layers' rows stacked). The rows go through in chunks
of `chunk_rows`: per chunk the products (in the compute dtype: bf16 under autocast), then fp32
log-softmax, loss, argmax and the gradient with respect to the logits, then the gradients of the
inputs (G_k · ws[k], and G_kᵀ · xs[k] for weights that require grad), with
G_k = Σ_{p ≥ k} coefs[p] · w · (softmax(z_p) − onehot(label)) (`chunk_gradients`; on CUDA the
trainer runs them as one Triton kernel, `fused_chunk_gradients`). The gradients are computed in the
forward (the loss is linear in its incoming gradient; backward only scales them), so no [N, V]
tensor outlives its chunk and the logits are never recomputed.

`DrafterObjective` is one micro-batch's loss of the drafter as a module (what DDP and FSDP wrap):
  Σ_j w_j · CE(final logits_j)                       final prediction (target lm_head)
+ Σ_j w_j · CE(final logits_j + T(label_{j-1}, ·))    transition scores (DSpine selection only)
+ Σ_l λ_l Σ_j w_j · CE(layer-l transfer scores_j)   layer-wise supervision (injection only; with
                                                   `layer_loss_fraction` < 1 over a random subset
                                                   of the blocks, reweighted to the same expectation)
+ c · BCE(confidence_j, [selected_j == label_j])      confidence head
+ d · Σ_j w_j · KL(p_target,j ‖ softmax(final logits_j))   distillation (`distill_weight` d > 0: the
                                                   target's whole next-token distribution, not its
                                                   one token, through `linear_kl`)
with position weights w_j = exp(-(j-1)/γ) on labelled slots, each term divided by its count over the
whole optimisation step (`step_norms`: all micro-batches of all ranks), so the micro-batches' terms
sum to the loss of the step's global batch taken as one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from dspine.kernels import dispatch
from dspine.kernels.cross_entropy import cross_entropy_grads

CHUNK_BYTES = 2 << 30  # working set of one chunk of logits, all levels and temporaries included


def chunk_gradients(parts: list[Tensor], labels: Tensor, weights: Tensor,
                    coefs: tuple[float, ...]) -> tuple[list[Tensor], Tensor, Tensor]:
    """One chunk of `linear_cross_entropy`. parts: P products [C, V] (level p's logits are the sum of
    parts 0..p, taken in fp32); labels: [C] int64 in [0, V); weights: [C] fp32.

    Returns (grads: P tensors [C, V] in the parts' dtype, G_k = Σ_{p ≥ k} coefs[p]·w·(softmax(z_p) −
    onehot); ce: [P, C] fp32 per-row CE; argmax: [P, C] int64). Pure: `torch.compile` may fuse it."""
    levels, z = [], None
    for part in parts:
        z = part.float() if z is None else z + part.float()
        levels.append(z)
    grads: list = [None] * len(parts)
    ces, argmaxes, running = [], [], None
    for p in reversed(range(len(parts))):
        z = levels[p]
        lse = torch.logsumexp(z, dim=-1)
        ces.append(lse - z.gather(1, labels[:, None]).squeeze(1))
        argmaxes.append(z.argmax(-1))
        scale = (coefs[p] * weights)[:, None]
        g = (z - lse[:, None]).exp_().mul_(scale).scatter_add_(1, labels[:, None], -scale)
        running = g if running is None else g.add_(running)  # a new sum: grads[p + 1] may alias `running`
        grads[p] = running.to(parts[p].dtype)
    return grads, torch.stack(ces[::-1]), torch.stack(argmaxes[::-1])


def fused_chunk_gradients(reference: Callable = chunk_gradients) -> Callable:
    """A `chunk_fn` that runs the fused Triton kernel (`dspine.kernels.cross_entropy`: the same
    contract, two passes over the logits) where `dispatch.use_triton` picks it for the parts (CUDA
    tensors; one or two levels), and `reference` (`chunk_gradients` or a compiled copy) elsewhere."""
    def chunk_fn(parts: list[Tensor], labels: Tensor, weights: Tensor, coefs: tuple[float, ...]):
        if len(parts) <= 2 and dispatch.use_triton(parts[0]):
            return cross_entropy_grads(parts, labels, weights, coefs)
        return reference(parts, labels, weights, coefs)
    return chunk_fn


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, labels: Tensor, weights: Tensor, coefs: tuple[float, ...], chunk_rows: int, dtype: torch.dtype,
                chunk_fn: Callable, n_parts: int, *tensors: Tensor):
        xs, ws = tensors[:n_parts], tensors[n_parts:]
        n, device = labels.shape[0], labels.device
        want_w = [ctx.needs_input_grad[7 + n_parts + k] for k in range(n_parts)]
        with torch.autocast(device.type, enabled=False):
            wc = [w.to(dtype) for w in ws]
            grad_x = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in xs]
            grad_w = [torch.zeros(w.shape, dtype=torch.float32, device=device) if want else None
                      for w, want in zip(ws, want_w)]
            levels = torch.zeros(n_parts, dtype=torch.float32, device=device)
            argmax = torch.empty(n_parts, n, dtype=torch.long, device=device)
            for start in range(0, n, chunk_rows):
                rows = slice(start, start + chunk_rows)
                xc = [x[rows].to(dtype) for x in xs]
                w = weights[rows].float()
                grads, ce, top = chunk_fn([x @ m.T for x, m in zip(xc, wc)], labels[rows], w, coefs)
                levels += ce @ w
                argmax[:, rows] = top
                for k, g in enumerate(grads):
                    grad_x[k][rows] = g @ wc[k]
                    if grad_w[k] is not None:
                        grad_w[k] += (g.T @ xc[k]).float()
            loss = sum(c * level for c, level in zip(coefs, levels.unbind()))
        ctx.n_parts, ctx.want_w = n_parts, want_w
        ctx.save_for_backward(*grad_x, *[g for g in grad_w if g is not None])
        ctx.mark_non_differentiable(levels, argmax)
        return loss, levels, argmax

    @staticmethod
    def backward(ctx, g_loss: Tensor, _levels, _argmax):
        saved = ctx.saved_tensors
        grad_x = [g * g_loss.to(g.dtype) for g in saved[:ctx.n_parts]]
        stored = iter(saved[ctx.n_parts:])
        grad_w = [next(stored) * g_loss if want else None for want in ctx.want_w]
        return (None,) * 7 + tuple(grad_x) + tuple(grad_w)


def linear_cross_entropy(xs: Sequence[Tensor], ws: Sequence[Tensor], labels: Tensor, row_weights: Tensor,
                         coefs: Sequence[float], *, chunk_rows: int | None = None,
                         chunk_fn: Callable = chunk_gradients) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted CE of P cumulative linear heads (module docstring), in chunks of rows.

    xs[k]: [N, D_k]; ws[k]: [V, D_k]; labels: [N] int64 (clamped to >= 0: give ignored rows weight 0);
    row_weights: [N] (the normalisation included); coefs: P floats. The products run in the autocast
    dtype when autocast is on for the inputs' device, else in the inputs' promoted dtype; softmax and
    sums in fp32. chunk_rows: rows per chunk (default: a CHUNK_BYTES working set); chunk_fn:
    `chunk_gradients` or a compiled copy of it.

    Returns (loss: scalar, Σ_p coefs[p]·level_p, differentiable in xs and in ws that require grad;
    levels: [P] fp32, no grad; argmax: [P, N] int64, argmax_v z_p[i, v]).
    """
    device_type = labels.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = xs[0].dtype
        for t in (*xs, *ws):
            dtype = torch.promote_types(dtype, t.dtype)
    vocab, parts = ws[0].shape[0], len(xs)
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_BYTES // (vocab * (6 * parts + 8)))
    return _LinearCrossEntropy.apply(labels.clamp(min=0), row_weights, tuple(float(c) for c in coefs), chunk_rows,
                                     dtype, chunk_fn, parts, *xs, *ws)


class _LinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, teacher: Tensor, w: Tensor, row_weights: Tensor, chunk_rows: int, dtype: torch.dtype):
        n, device = x.shape[0], x.device
        with torch.autocast(device.type, enabled=False):
            wc = w.to(dtype)
            grad_x = torch.empty(x.shape, dtype=x.dtype, device=device)
            total = torch.zeros((), dtype=torch.float32, device=device)
            for start in range(0, n, chunk_rows):
                rows = slice(start, start + chunk_rows)
                log_q = torch.log_softmax((x[rows].to(dtype) @ wc.T).float(), dim=-1)
                log_p = torch.log_softmax((teacher[rows].to(dtype) @ wc.T).float(), dim=-1)
                p, rw = log_p.exp(), row_weights[rows].float()
                total += ((p * (log_p - log_q)).sum(-1) * rw).sum()
                grad_x[rows] = ((log_q.exp_() - p).mul_(rw[:, None])).to(dtype) @ wc
        ctx.save_for_backward(grad_x)
        return total

    @staticmethod
    def backward(ctx, g_loss: Tensor):
        (grad_x,) = ctx.saved_tensors
        return grad_x * g_loss.to(grad_x.dtype), None, None, None, None, None


def linear_kl(x: Tensor, teacher: Tensor, w: Tensor, row_weights: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """Σ_i row_weights[i] · KL(softmax(teacher_i · wᵀ) ‖ softmax(x_i · wᵀ)): the student rows x [N, D]
    against the teacher rows [N, D] through one frozen head w [V, D] (the target's lm_head), in
    chunks of rows, the gradient of x computed in the forward as `linear_cross_entropy`'s is
    (w·(softmax(z_x) − softmax(z_teacher)), no [N, V] tensor outliving its chunk). Differentiable
    in x only. The products run in the autocast dtype when autocast is on, softmax and sums in fp32."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else \
        torch.promote_types(x.dtype, w.dtype)
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_BYTES // (w.shape[0] * 20))
    return _LinearKL.apply(x, teacher, w, row_weights, chunk_rows, dtype)


def position_weights(labels: Tensor, decay: float) -> Tensor:
    """labels: [n, B-1] (-100 = none) -> w [n, B-1] fp32: exp(-j/decay) on labelled slots, 0 elsewhere."""
    slots = torch.arange(labels.shape[1], device=labels.device)
    return torch.exp(-slots / decay)[None] * (labels >= 0)


def step_norms(label_batches: Sequence[Tensor], decay: float) -> Tensor:
    """[3] fp32 on the labels' device: Σ w, the labelled slots and the labelled first slots over
    `label_batches` (one optimisation step's micro-batches on this rank; sum over ranks for the step)."""
    sums = [torch.stack([position_weights(y, decay).sum(), (y >= 0).sum().float(), (y[:, 0] >= 0).sum().float()])
            for y in label_batches]
    return torch.stack(sums).sum(0)


class DrafterObjective(nn.Module):
    """`forward(hidden, anchor_ids, block_positions, mask, labels, norms)` -> the loss terms of one
    micro-batch (scalars, each normalised by the step's `norms`): final, transition (DSpine
    selection), layers (injection), confidence (with a confidence head), distill (with
    `distill_weight` > 0), total (their sum) and acc1
    (first-slot accuracy of the final logits, not optimised). The drafter's forward records
    gradients, so its injections take their PyTorch path (`AdjacentInjection._fused`); its
    parameters are this module's."""

    def __init__(self, drafter: nn.Module, *, position_decay: float, confidence_weight: float,
                 chunk_fn: Callable = chunk_gradients, chunk_rows: int | None = None,
                 layer_loss_fraction: float = 1.0, distill_weight: float = 0.0):
        super().__init__()
        self.drafter = drafter
        self.position_decay, self.confidence_weight = position_decay, confidence_weight
        self.chunk_fn, self.chunk_rows = chunk_fn, chunk_rows
        self.layer_loss_fraction = layer_loss_fraction
        self.distill_weight = distill_weight

    def layer_loss_blocks(self, n: int, device) -> tuple[Tensor | None, float]:
        """(blocks whose layer-wise losses this micro-batch computes, the factor on their weights):
        all of them and 1, or with `layer_loss_fraction` f < 1 a uniform random subset of
        m = max(1, round(f·n)) of the n blocks (torch's RNG on `device`) and n/m, so the expected
        term equals the full one."""
        if self.layer_loss_fraction >= 1:
            return None, 1.0
        m = max(1, round(self.layer_loss_fraction * n))
        return torch.randperm(n, device=device)[:m], n / m

    def _ce(self, xs, ws, labels, weights, coefs):
        with record_function("dspine.train.vocab_losses"):
            return linear_cross_entropy(xs, ws, labels, weights, coefs, chunk_rows=self.chunk_rows,
                                        chunk_fn=self.chunk_fn)

    def forward(self, hidden: Tensor, anchor_ids: Tensor, block_positions: Tensor, mask: Tensor, labels: Tensor,
                norms: Tensor, teacher: Tensor | None = None) -> dict[str, Tensor]:
        """hidden: [bs, L, K·H] target hidden states; anchor_ids: [bs, nb]; block_positions: [bs, nb·B];
        mask: [bs, nb·B, L + nb·B]; labels: [bs·nb, B-1]; norms: [3] (`step_norms`); teacher: [bs, L, H]
        the target's last hidden states (after its final norm), needed when `distill_weight` > 0."""
        model, dc = self.drafter, self.drafter.config
        bs, length = hidden.shape[:2]
        layer_out: list[Tensor] = []
        hooks = ([layer.register_forward_hook(lambda _m, _a, out: layer_out.append(out)) for layer in model.layers]
                 if model.injections is not None else [])
        try:
            with record_function("dspine.train.drafter"):
                kv = model.context_key_values(model.project_context(hidden),
                                              torch.arange(length, device=hidden.device)[None].expand(bs, -1))
                out = model(anchor_ids, block_positions, kv, mask)
        finally:
            for hook in hooks:
                hook.remove()
        n, slots = labels.shape
        y = labels.reshape(-1)
        w = (position_weights(labels, self.position_decay) / norms[0]).reshape(-1)
        h = out.hidden[:, 1:].reshape(n * slots, -1)                                       # [n(B-1), H]
        xs, ws = [h], [model.target_tensor("output_embeddings")]
        table = model.transfer_table()
        if model.transition is not None:
            prev = torch.cat([anchor_ids.reshape(-1, 1), labels[:, :-1].clamp(min=0)], dim=1)   # [n, B-1]
            xs.append(model.transition.left(table, prev).reshape(n * slots, -1))
            ws.append(table)
        loss, levels, argmax = self._ce(xs, ws, y, w, [1.0] * len(xs))
        terms = {"final": levels[0]}
        if self.distill_weight > 0:
            if teacher is None:
                raise ValueError("distill_weight > 0 needs the target's last hidden states (`teacher`)")
            # slot j (label ids[a + j]) is distilled from the target's distribution at position a + j - 1
            before = (block_positions.view(bs, -1, dc.block_size)[:, :, 1:] - 1).clamp(0, length - 1).reshape(bs, -1)
            rows = teacher.gather(1, before[..., None].expand(-1, -1, teacher.shape[-1])).reshape(n * slots, -1)
            with record_function("dspine.train.vocab_losses"):
                distill = self.distill_weight * linear_kl(h, rows, ws[0], w, chunk_rows=self.chunk_rows)
            terms["distill"] = distill.detach()
            loss = loss + distill
        if model.transition is not None:
            terms["transition"] = levels[1]
        if layer_out:
            keep, factor = self.layer_loss_blocks(n, labels.device)
            pick = (lambda t: t) if keep is None else (lambda t: t.index_select(0, keep))
            q = torch.cat([(pick(o.view(n, dc.block_size, -1))[:, 1:] @ inj.score_proj.weight.T).flatten(0, 1)
                           for o, inj in zip(layer_out, model.injections)])                     # [layers·m(B-1), r]
            kept_w = pick(w.view(n, slots)).reshape(-1) * factor
            lw = torch.cat([lam * kept_w for lam in dc.layer_loss_weights])
            layers, _, _ = self._ce([q], [table], pick(labels).reshape(-1).repeat(len(layer_out)), lw,
                                    [1.0])
            terms["layers"] = layers.detach()
            loss = loss + layers
        conf = model.confidence_logits(out.hidden[:, 1:])
        valid = labels >= 0
        if conf is not None:
            correct = (argmax[-1].view(n, slots) == labels).float()
            bce = F.binary_cross_entropy_with_logits(conf.float(), correct, reduction="none")
            confidence = self.confidence_weight * (bce * valid).sum() / norms[1]
            terms["confidence"] = confidence.detach()
            loss = loss + confidence
        terms["total"] = loss
        with torch.no_grad():
            terms["acc1"] = ((argmax[0].view(n, slots)[:, 0] == labels[:, 0]) & valid[:, 0]).sum() / norms[2]
        return terms
