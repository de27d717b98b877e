"""dspine/train/losses.py: the chunked vocabulary loss and the drafter objective equal the unchunked
formulas (the baseline kept in dspine/bench/train_throughput.py), loss and gradients, in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspine.train.losses import linear_cross_entropy


def _unchunked(xs, ws, labels, row_weights, coefs):
    z, levels = None, []
    for x, w in zip(xs, ws):
        z = x @ w.T if z is None else z + x @ w.T
        levels.append((F.cross_entropy(z, labels.clamp(min=0), reduction="none") * row_weights).sum())
    argmax = torch.stack([sum(x @ w.T for x, w in zip(xs[:p + 1], ws[:p + 1])).argmax(-1) for p in range(len(xs))])
    return sum(c * v for c, v in zip(coefs, levels)), torch.stack(levels), argmax


@pytest.mark.parametrize("chunk_rows", [None, 7, 64])
def test_linear_cross_entropy_equals_the_unchunked_loss_and_gradients(chunk_rows):
    g = torch.Generator().manual_seed(0)
    n, vocab, hidden, rank = 37, 50, 12, 5
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    left = torch.randn(n, rank, generator=g, requires_grad=True)
    emb = torch.randn(vocab, hidden, generator=g)                  # frozen, like the target's lm_head
    table = torch.randn(vocab, rank, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[3, 20]] = -100
    row_weights = torch.rand(n, generator=g) * (labels >= 0)
    coefs = (1.0, 0.7)

    loss, levels, argmax = linear_cross_entropy([h, left], [emb, table], labels, row_weights, coefs,
                                                chunk_rows=chunk_rows)
    grads = torch.autograd.grad(3.0 * loss, [h, left, table])
    want_loss, want_levels, want_argmax = _unchunked([h, left], [emb, table], labels, row_weights, coefs)
    want_grads = torch.autograd.grad(3.0 * want_loss, [h, left, table])

    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(levels, want_levels.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(argmax, want_argmax)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not levels.requires_grad and argmax.dtype == torch.long


def test_objective_equals_the_unchunked_losses_and_their_gradients(llama_target):
    """DrafterObjective (chunked, layer-wise scores recomputed from the draft layers' outputs) against
    the materialised-logits baseline, for the injection modes and the ablation: every term and the
    gradient of every drafter parameter."""
    from conftest import drafter_for

    from dspine.bench.train_throughput import baseline_block_losses
    from dspine.train.blocks import make_block_batch
    from dspine.train.config import TrainConfig
    from dspine.train.losses import DrafterObjective, step_norms
    from dspine.train.trainer import target_hidden

    g = torch.Generator().manual_seed(3)
    records = [{"ids": torch.randint(4, 256, (int(n),), generator=g).tolist(), "answer_start": 5}
               for n in (40, 23, 31)]
    cfg = TrainConfig(data="unused", run_dir="unused", position_decay=4.0, confidence_weight=0.3)
    for opts in (dict(injection_candidates="per_layer"), dict(injection_candidates="first_layer"),
                 dict(injection=False, selection="argmax")):
        drafter = drafter_for(llama_target, block_size=6, layer_loss_weights=[0.5, 0.4, 0.3, 0.2, 0.1], **opts)
        drafter.train()
        batch = make_block_batch(records, block_size=6, blocks_per_seq=5, window=16, max_len=64, generator=g)
        want = baseline_block_losses(drafter, llama_target, batch, cfg)
        params = [p for p in drafter.parameters() if p.requires_grad]
        want_grads = torch.autograd.grad(want["total"], params, allow_unused=True)

        objective = DrafterObjective(drafter, position_decay=4.0, confidence_weight=0.3, chunk_rows=11)
        hidden = target_hidden(llama_target, batch.input_ids, drafter.config.target_layer_ids)
        got = objective(hidden, batch.anchor_ids, batch.block_positions, batch.mask, batch.labels,
                        step_norms([batch.labels], 4.0))
        grads = torch.autograd.grad(got["total"], params, allow_unused=True)

        assert set(got) == set(want), opts
        for name in want:
            torch.testing.assert_close(got[name], want[name].detach(), rtol=1e-5, atol=1e-5, msg=f"{opts} {name}")
        for p, a, b in zip(params, grads, want_grads):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=5e-4, atol=1e-5)  # fp32 sums in another order


def test_layer_loss_fraction_is_unbiased(llama_target, monkeypatch):
    """With `layer_loss_fraction` < 1 the layer-wise term is computed on m of the n blocks, reweighted
    by n/m: averaged over every m-subset it equals the full term; the other terms do not change; a
    draw is m distinct blocks."""
    import itertools

    from conftest import drafter_for

    from dspine.train.blocks import make_block_batch
    from dspine.train.losses import DrafterObjective, step_norms
    from dspine.train.trainer import target_hidden

    g = torch.Generator().manual_seed(5)
    records = [{"ids": torch.randint(4, 256, (int(n),), generator=g).tolist(), "answer_start": 5} for n in (40, 31)]
    drafter = drafter_for(llama_target, block_size=6, layer_loss_weights=[0.5, 0.4, 0.3, 0.2, 0.1]).train()
    batch = make_block_batch(records, block_size=6, blocks_per_seq=3, window=16, max_len=64, generator=g)
    hidden = target_hidden(llama_target, batch.input_ids, drafter.config.target_layer_ids)
    args = (hidden, batch.anchor_ids, batch.block_positions, batch.mask, batch.labels, step_norms([batch.labels], 4.0))
    with torch.no_grad():
        full = DrafterObjective(drafter, position_decay=4.0, confidence_weight=0.3)(*args)
        part = DrafterObjective(drafter, position_decay=4.0, confidence_weight=0.3, layer_loss_fraction=0.7)
        n = batch.labels.shape[0]
        keep, factor = part.layer_loss_blocks(n, "cpu")
        m = len(keep)
        assert m == round(0.7 * n) and len(set(keep.tolist())) == m and 0 <= keep.min() <= keep.max() < n
        assert factor == n / m
        subsets = list(itertools.combinations(range(n), m))
        terms = []
        for subset in subsets:
            monkeypatch.setattr(part, "layer_loss_blocks", lambda *_a, s=subset: (torch.tensor(s), n / m))
            terms.append(part(*args))
    mean = sum(t["layers"] for t in terms) / len(subsets)
    torch.testing.assert_close(mean, full["layers"], rtol=1e-5, atol=1e-6)
    draws = torch.stack([t["layers"] for t in terms])
    assert draws.max() - draws.min() > 1e-5                                         # the draws differ
    for name in ("final", "transition", "confidence"):
        torch.testing.assert_close(terms[0][name], full[name])


@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_linear_kl_equals_the_unchunked_divergence_and_its_gradient(chunk_rows):
    from dspine.train.losses import linear_kl

    g = torch.Generator().manual_seed(1)
    n, vocab, hidden = 13, 40, 8
    x = torch.randn(n, hidden, generator=g, requires_grad=True)
    teacher = torch.randn(n, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g)
    row_weights = torch.rand(n, generator=g)
    row_weights[5] = 0.0

    got = linear_kl(x, teacher, head, row_weights, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad(2.0 * got, [x])
    p_log = F.log_softmax(teacher @ head.T, dim=-1)
    want = (F.kl_div(F.log_softmax(x @ head.T, dim=-1), p_log, log_target=True, reduction="none").sum(-1)
            * row_weights).sum()
    (want_grad,) = torch.autograd.grad(2.0 * want, [x])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert float(linear_kl(teacher, teacher, head, row_weights)) == pytest.approx(0.0, abs=1e-5)


def test_distillation_term_reads_the_targets_distribution_before_each_label(llama_target):
    """`distill_weight`: the term equals d · Σ w_j · KL(p_j ‖ q_j) / Σ w, with p_j the target's own
    next-token distribution (its logits from transformers, at the position before label j) and q_j
    the drafter's final distribution at slot j; the other terms are those of the run without it."""
    from conftest import drafter_for

    from dspine.train.blocks import make_block_batch
    from dspine.train.losses import DrafterObjective, position_weights, step_norms
    from dspine.train.trainer import target_hidden

    g = torch.Generator().manual_seed(7)
    records = [{"ids": torch.randint(4, 256, (int(n),), generator=g).tolist(), "answer_start": 6} for n in (30, 22)]
    drafter = drafter_for(llama_target, block_size=5).train()
    batch = make_block_batch(records, block_size=5, blocks_per_seq=4, window=16, max_len=64, generator=g)
    norms = step_norms([batch.labels], 4.0)
    hidden, last = target_hidden(llama_target, batch.input_ids, drafter.config.target_layer_ids, final=True)
    torch.testing.assert_close(hidden, target_hidden(llama_target, batch.input_ids, drafter.config.target_layer_ids))
    args = (hidden, batch.anchor_ids, batch.block_positions, batch.mask, batch.labels, norms)
    with torch.no_grad():
        plain = DrafterObjective(drafter, position_decay=4.0, confidence_weight=0.3)(*args)
        got = DrafterObjective(drafter, position_decay=4.0, confidence_weight=0.3, distill_weight=0.5)(*args, last)
        with pytest.raises(ValueError, match="needs the target's last hidden states"):
            DrafterObjective(drafter, position_decay=4.0, confidence_weight=0.3, distill_weight=0.5)(*args)

        target_logits = llama_target(input_ids=batch.input_ids).logits                    # [bs, L, V]
        kv = drafter.context_key_values(drafter.project_context(hidden),
                                        torch.arange(hidden.shape[1])[None].expand(hidden.shape[0], -1))
        student = drafter.logits(drafter(batch.anchor_ids, batch.block_positions, kv, batch.mask).hidden[:, 1:])
        bs, nb = batch.anchor_ids.shape
        want = torch.zeros(())
        w = position_weights(batch.labels, 4.0)
        for b in range(bs):
            for k in range(nb):
                for j in range(1, 5):
                    weight = w[b * nb + k, j - 1]
                    if weight == 0:
                        continue
                    p_log = F.log_softmax(target_logits[b, batch.block_positions[b, k * 5 + j] - 1], -1)
                    q_log = F.log_softmax(student[b * nb + k, j - 1].float(), -1)
                    want += weight * (p_log.exp() * (p_log - q_log)).sum()
    torch.testing.assert_close(got["distill"], 0.5 * want / norms[0], rtol=1e-4, atol=1e-6)
    for name in plain:
        if name != "total":
            torch.testing.assert_close(got[name], plain[name])
    torch.testing.assert_close(got["total"], plain["total"] + got["distill"], rtol=1e-5, atol=1e-6)
