"""Transition cache and selection: λ=0 is independent argmax, Viterbi is the brute-force optimum,
sampled paths follow q, cached pair scores equal on-the-fly ones."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspine.kernels.transition_select import conditional_log_probs, transition_path_reference
from dspine.model.selection import select_tokens
from dspine.model.transition import SuccessorTable, TransitionScorer


def _lattice(bs=3, n=4, k=3, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, n, vocab, generator=g) * 3
    table = torch.randn(vocab, 8, generator=g)
    scorer = TransitionScorer(8)
    with torch.no_grad():
        scorer.weight.copy_(torch.randn(8, 8, generator=g))
    anchors = torch.randint(0, vocab, (bs,), generator=g)
    return logits, table, scorer, anchors


def test_lambda_zero_equals_independent_argmax():
    logits, table, scorer, anchors = _lattice()
    sel = select_tokens(logits, anchors, torch.zeros(3), mode="transition", top_k=3, lam=0.0, scorer=scorer,
                        table=table)
    assert torch.equal(sel.tokens, logits.argmax(-1))
    assert torch.equal(select_tokens(logits, anchors, torch.zeros(3), mode="argmax", top_k=3, lam=1.0,
                                     scorer=None, table=None).tokens, logits.argmax(-1))


def test_transition_changes_the_path():
    logits, table, scorer, anchors = _lattice(seed=4)
    sel = select_tokens(logits, anchors, torch.zeros(3), mode="transition", top_k=3, lam=5.0, scorer=scorer,
                        table=table)
    assert not torch.equal(sel.tokens, logits.argmax(-1))


@pytest.mark.parametrize("seed", range(5))
def test_viterbi_equals_brute_force(seed):
    bs, n, k = 2, 4, 3
    g = torch.Generator().manual_seed(seed)
    unary, pair = torch.randn(bs, n, k, generator=g), torch.randn(bs, n, k, k, generator=g)
    choice, _ = transition_path_reference(unary, pair, 0.7, torch.zeros(bs), torch.rand(bs, n, generator=g))
    s = conditional_log_probs(unary, pair, 0.7, torch.zeros(bs))
    for b in range(bs):
        best = max(itertools.product(range(k), repeat=n),
                   key=lambda path: s[b, 0, 0, path[0]] + sum(s[b, i, path[i - 1], path[i]] for i in range(1, n)))
        assert choice[b].tolist() == list(best)


def test_sampled_path_follows_q():
    n, k = 2, 3
    g = torch.Generator().manual_seed(0)
    unary, pair = torch.randn(1, n, k, generator=g), torch.randn(1, n, k, k, generator=g)
    draws = 20000
    u = torch.rand(draws, n, generator=g)
    choice, q = transition_path_reference(unary.expand(draws, -1, -1), pair.expand(draws, -1, -1, -1), 1.0,
                                          torch.ones(draws), u)
    s = conditional_log_probs(unary, pair, 1.0, torch.ones(1))[0].exp()
    for a, c in itertools.product(range(k), repeat=2):
        expected = float(s[0, 0, a] * s[1, a, c])
        observed = float(((choice[:, 0] == a) & (choice[:, 1] == c)).float().mean())
        assert observed == pytest.approx(expected, abs=0.015)
    # q is the distribution each choice was drawn from
    assert torch.allclose(q[:, 1], s[1][choice[:, 0]], atol=1e-6)


def test_successor_table_scores_equal_on_the_fly():
    logits, table, scorer, anchors = _lattice(vocab=40)
    succ = SuccessorTable(40, 6)
    prev = torch.randint(0, 40, (3, 4, 5))
    cur = torch.randint(0, 40, (3, 4, 5))
    cached = succ.pair(scorer, table, prev, cur)
    assert bool(succ.filled[prev.unique()].all()) and int(succ.filled.sum()) == prev.unique().numel()
    assert torch.allclose(cached, scorer.pair(table, prev, cur), atol=1e-5)
    row = int(prev[0, 0, 0])
    full = scorer.full_row(table, torch.tensor([row]))[0]
    assert torch.equal(succ.ids[row], full.topk(6).indices)
    hit_cur = succ.ids[row][None, None, :3].expand(1, 1, 3)
    assert torch.allclose(succ.pair(scorer, table, prev[:1, :1, :1], hit_cur)[0, 0, 0], succ.scores[row][:3])
