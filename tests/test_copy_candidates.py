"""Copy candidates in the selection lattice: config, history buffer, score tables and their fit, the
lattice against brute-force path enumeration, greedy parity and τ of the reference engine, exact
sampling at T > 0, and copy candidates off = the lattice of before."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import drafter_for, fixed_prompts, tiny_llama
from dspine import generate
from dspine.engine import proposer as proposer_module
from dspine.kernels import dispatch
from dspine.model.checkpoint import read_config, save_checkpoint
from dspine.model.config import ConfigError, DSpineConfig
from dspine.model.copy_candidates import (REMATCH_OFF_ENTRY_LOG_ODDS, CopyCounts, CopyTables, TokenHistory,
                                          constant_copy_scores, copy_candidates, count_copy_outcomes, find_copies,
                                          fit_copy_tables, recorded_histories)
from dspine.model.selection import (CopyCandidates, candidate_topk, copy_scores, pair_scores, select_tokens,
                                    walk_path)
from dspine.model.transition import TransitionScorer
from test_sampling_exact import DRAWS, chi2_pvalue, empirical, exact_joint
from test_suffix_match import brute_suffix_match

BASE = dict(hidden_size=16, vocab_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
            num_target_layers=6, mask_token_id=3, block_size=8)


# ------------------------------------------------------------------------------------------ config
def test_config_defaults_and_round_trip_through_config_json(tmp_path, llama_target):
    cfg = DSpineConfig(**BASE)
    assert not cfg.copy_candidates and cfg.copy_max_span is None and cfg.replace(block_size=4).copy_max_span is None
    assert len(cfg.copy_follow_log_odds) == len(cfg.copy_match_buckets) == len(cfg.copy_reenter_log_odds)
    model = drafter_for(llama_target, copy_candidates=True, copy_min_match=3, copy_max_span=5,
                        **constant_copy_scores(1.5, -0.25))
    saved = read_config(save_checkpoint(model, tmp_path / "ckpt", dtype=torch.float32))
    assert saved == model.config and saved.copy_follow_log_odds == [[1.5]] and saved.copy_score == "logit"


@pytest.mark.parametrize("changes, field", [
    (dict(copy_min_match=0), "copy_min_match"),
    (dict(copy_min_match=4, copy_max_match=3), "copy_max_match"),
    (dict(copy_max_span=8), "copy_max_span"),
    (dict(copy_history_window=2), "copy_history_window"),
    (dict(copy_score="max"), "copy_score"),
    (dict(copy_match_buckets=[1, 4, 2]), "copy_match_buckets"),
    (dict(copy_follow_log_odds=[[0.0]]), "copy_follow_log_odds"),
    (dict(copy_match_buckets=[1], copy_follow_log_odds=[[0.0]], copy_reenter_log_odds=[[float("nan")]]),
     "copy_reenter_log_odds"),
    (dict(copy_candidates=True, selection="argmax"), "copy_candidates"),
    (dict(copy_candidates=True, selection_top_k=64), "selection_top_k"),
])
def test_config_rejects_impossible_copy_settings(changes, field):
    with pytest.raises(ConfigError, match=rf"dspine_config\.{field} = .*: "):
        DSpineConfig(**BASE, **changes)


# ---------------------------------------------------------------------------------- history, scores
def test_token_history_keeps_the_most_recent_tokens_of_every_row():
    g = torch.Generator().manual_seed(0)
    capacity = 9
    rows = [list(range(5)), list(range(100, 112)), [7]]
    tokens = torch.zeros(3, 12, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = torch.tensor(r)
    hist = TokenHistory(tokens, torch.tensor([len(r) for r in rows]), capacity)
    for step in range(12):
        fed = torch.randint(0, 1000, (len(rows), 4), generator=g)
        keep = torch.randint(1, 5, (len(rows),), generator=g)
        hist.extend(fed, keep)
        rows = [r + fed[b, :int(keep[b])].tolist() for b, r in enumerate(rows)]
        if step == 6:
            hist.select(torch.tensor([2, 0]))
            rows = [rows[2], rows[0]]
        anchors = torch.randint(0, 1000, (len(rows),), generator=g)
        full, lengths = hist.with_anchor(anchors)
        assert full.shape[1] == max(min(len(r), capacity) for r in rows) + 1
        for b, r in enumerate(rows):
            want = r[-capacity:] + [int(anchors[b])]
            assert int(lengths[b]) == len(want) and full[b, :len(want)].tolist() == want


def test_tables_look_up_buckets_and_slots_and_feed_the_candidates():
    cfg = DSpineConfig(**BASE, copy_min_match=1, copy_match_buckets=[1, 3, 8],
                       copy_follow_log_odds=[[0.0, 0.1], [1.0, 1.1], [2.0, 2.1]],
                       copy_reenter_log_odds=[[0.0, -0.1], [1.0, -1.1], [2.0, -2.1]])
    tables = CopyTables.from_config(cfg)
    follow, reenter = tables.lookup(torch.tensor([1, 2, 3, 7, 8, 40]), 3)
    assert follow[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert torch.allclose(follow[4], torch.tensor([2.0, 2.1, 2.1]))
    assert torch.allclose(reenter[2], torch.tensor([1.0, -1.1, -1.1]))
    history = torch.tensor([[5, 6, 7, 9, 5, 6, 7, 0], [1, 2, 3, 4, 5, 6, 7, 8]])
    single = cfg.replace(copy_rematch=False)
    copies = copy_candidates(history, torch.tensor([7, 8]), single, tables, 4)
    assert copies.ids.tolist() == [[[9, 5, 6, 7]], [[-1, -1, -1, -1]]] and copies.mode == "mixture"
    assert torch.allclose(copies.follow[0, 0], torch.tensor([1.0, 1.1, 1.1, 1.1]))   # a 3-token match
    assert copies.scored.tolist() == [[[True] * 4], [[False] * 4]]
    short = copy_candidates(history, torch.tensor([7, 8]), single.replace(copy_max_span=2), tables, 4)
    assert short.ids[0, 0].tolist() == [9, 5, -1, -1]
    with pytest.raises(ValueError, match="first_draft"):
        copy_candidates(history, torch.tensor([7, 8]), cfg, tables, 4)


def test_the_rematched_chain_copies_after_the_drafters_first_token():
    """Chain 1: the drafter's first-slot token as its entry (unscored), then the copy after history +
    that token (brute force) from slot 1, scored one table column back and entered off its entry with
    REMATCH_OFF_ENTRY_LOG_ODDS; none where chain 0 already starts with that token."""
    cfg = DSpineConfig(**BASE, copy_min_match=1, copy_match_buckets=[1, 3],
                       copy_follow_log_odds=[[0.5, 0.6, 0.7], [1.5, 1.6, 1.7]],
                       copy_reenter_log_odds=[[0.5, -0.6, -0.7], [1.5, -1.6, -1.7]])
    g = torch.Generator().manual_seed(4)
    history = torch.randint(0, 5, (6, 40), generator=g)
    lengths = torch.tensor([40, 33, 20, 12, 40, 5])
    first = torch.randint(0, 5, (6,), generator=g)
    n = 5
    copies = copy_candidates(history, lengths, cfg, CopyTables.from_config(cfg), n, first)
    assert copies.ids.shape == (6, 2, n)
    for b in range(6):
        tokens = history[b, : int(lengths[b])].tolist()
        ids0, _ = brute_suffix_match(tokens, n, 1, 32, n, 8192)
        assert copies.ids[b, 0].tolist() == ids0
        ids1, m1 = brute_suffix_match(tokens + [int(first[b])], n - 1, 1, 32, n - 1, 8192)
        if ids0[0] == int(first[b]):
            ids1 = [-1] * (n - 1)
        assert copies.ids[b, 1].tolist() == [int(first[b])] + ids1
        assert copies.scored[b, 1].tolist() == [False] + [i >= 0 for i in ids1]
        row = 0 if m1 < 3 else 1
        follow, reenter = cfg.copy_follow_log_odds[row], cfg.copy_reenter_log_odds[row]
        col = lambda i: min(i, 2)  # noqa: E731
        assert copies.follow[b, 1, 1:].tolist() == pytest.approx([follow[col(i - 1)] for i in range(1, n)])
        assert copies.reenter[b, 1, 2:].tolist() == pytest.approx([reenter[col(i - 1)] for i in range(2, n)])
        assert float(copies.reenter[b, 1, 1]) == REMATCH_OFF_ENTRY_LOG_ODDS
    assert int((copies.ids[:, 1, 1:] >= 0).sum()) > 0 and int((copies.ids[:, 1, 1:] < 0).sum()) > 0


def test_triton_find_copies_equals_the_torch_path():
    cfg = DSpineConfig(**BASE, copy_min_match=1)
    history = torch.randint(0, 4, (3, 50), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([50, 17, 2])
    with dispatch.forced("torch"):
        want = find_copies(history, lengths, cfg, 7)
    with dispatch.forced("triton"):
        got = find_copies(history, lengths, cfg, 7)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and int((want[0] >= 0).sum()) > 0


# ------------------------------------------------------------------------------------------ fitting
def test_counts_equal_a_brute_force_count():
    cfg = DSpineConfig(**BASE, copy_min_match=3, copy_max_match=6, copy_match_buckets=[1, 2, 4],
                       copy_follow_log_odds=[[0.0]] * 3, copy_reenter_log_odds=[[0.0]] * 3, copy_history_window=20)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 3, (60,), generator=g).tolist()
    counts = count_copy_outcomes(tokens, 10, cfg, chunk=7)
    want = CopyCounts.zeros(3, 7)
    for t in range(10, len(tokens) - 1):
        ids, m = brute_suffix_match(tokens[:t + 1], 7, 1, 6, 7, 20)      # every match counted
        bucket = 0 if m < 2 else 1 if m < 4 else 2
        hits = [0 <= ids[i] and t + 1 + i < len(tokens) and ids[i] == tokens[t + 1 + i] for i in range(7)]
        exists = [0 <= ids[i] and t + 1 + i < len(tokens) for i in range(7)]
        for i in range(7):
            if exists[i] and all(hits[:i]):
                want.follow_trials[bucket, i] += 1
                want.follow_hits[bucket, i] += hits[i]
            if i and exists[i] and exists[i - 1] and not hits[i - 1]:
                want.reenter_trials[bucket, i] += 1
                want.reenter_hits[bucket, i] += hits[i]
    for name in ("follow_trials", "follow_hits", "reenter_trials", "reenter_hits"):
        assert torch.equal(getattr(counts, name), getattr(want, name)), name
    assert int(counts.follow_trials.sum()) > 0 and int(counts.reenter_trials.sum()) > 0


def test_fit_is_the_log_odds_of_shrunk_rates():
    counts = CopyCounts.zeros(2, 3)
    counts.follow_trials[0] = torch.tensor([1000, 500, 0])
    counts.follow_hits[0] = torch.tensor([900, 100, 0])
    counts.reenter_trials[0] = torch.tensor([0, 400, 10])
    counts.reenter_hits[0] = torch.tensor([0, 40, 1])
    fields = fit_copy_tables(counts, [1, 5], prior=8.0)
    follow, reenter = fields["copy_follow_log_odds"], fields["copy_reenter_log_odds"]
    assert fields["copy_match_buckets"] == [1, 5]
    assert follow[0][0] == pytest.approx(math.log(9), abs=0.05)                    # 900 / 1000
    assert follow[0][1] == pytest.approx(math.log(0.25), abs=0.1)                  # 100 / 500
    bucket = (1000 + 8 * 1001 / 1502) / (1500 + 8)                                # an empty cell: its bucket's rate
    assert follow[0][2] == pytest.approx(math.log(bucket / (1 - bucket)), abs=1e-3)
    assert reenter[0][0] == follow[0][0] and reenter[0][1] == pytest.approx(math.log(1 / 9), abs=0.05)
    assert follow[1] == [follow[1][0]] * 3                                         # no data: the overall rate
    DSpineConfig(**BASE, **fields)


def test_recorded_histories_take_every_assistant_message_with_its_context():
    def render(messages, prompt):                                   # one token per character
        text = "".join(f"<{m['role'][0]}>{m.get('content') or ''}" for m in messages) + ("<a>" if prompt else "")
        return [ord(ch) for ch in text]

    messages = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "copy abc"},
                {"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "abc"},
                {"role": "assistant", "content": "abc!"}]
    (tokens, start), = recorded_histories(messages, render)      # the opening and the tool-call turns: none
    assert "".join(map(chr, tokens)) == "<a>hi<u>copy abc<a><t>abc<a>abc!"
    assert "".join(map(chr, tokens[start:])) == "abc!"


# ---------------------------------------------------------------------------------------- lattice
def _brute_force_lattice(logits, anchor, chains, mode, scorer, table, lam, k):
    """One row's lattice by its definition. chains: per chain (ids, follow, reenter, scored) lists of
    N. Per slot, candidates = top-k ids plus every chain's token. x_i(a, c) = u_i(c) + bonus_i(a, c)
    + lam*T(a, c): u = the highest copy score of the chains that score c at slot i (rho = follow at
    slot 0, reenter after), else c's draft logit; bonus = the highest score(follow) - score(reenter)
    of the chains holding a at slot i-1 and c at slot i, else 0. Conditionals: log-softmax over the
    slot's candidates. Returns (candidate lists, conditional(i, a, T))."""
    n = logits.shape[0]
    cands = []
    for i in range(n):
        ids = logits[i].topk(k).indices.tolist()
        for chain_ids, _, _, _ in chains:
            if chain_ids[i] >= 0 and chain_ids[i] not in ids:
                ids.append(chain_ids[i])
        cands.append(ids)

    def score(i, c, rho):
        return copy_scores(logits[i, c], logits[i].logsumexp(-1), torch.tensor(rho), mode).item()

    def x(i, a, c):
        scores = [score(i, c, follow[i] if i == 0 else reenter[i])
                  for ids, follow, reenter, scored in chains if ids[i] == c and scored[i]]
        val = max(scores) if scores else logits[i, c].item()
        bonuses = [(score(i, c, follow[i]) - score(i, c, reenter[i])) if mode == "mixture" else follow[i] - reenter[i]
                   for ids, follow, reenter, _ in chains if i and ids[i] == c and ids[i - 1] == a]
        val += max(bonuses) if bonuses else 0.0
        return val + lam * scorer.pair(table, torch.tensor([a]), torch.tensor([c]))[0, 0].item()

    def conditional(i, a, temperature=1.0):
        xs = torch.tensor([x(i, a, c) for c in cands[i]]) / temperature
        return dict(zip(cands[i], torch.log_softmax(xs, 0).tolist()))

    return cands, conditional


def _chains(bs, n, vocab, logits, k, g):
    """Two chains per row covering the cases: chain 0 a plain copy chain (a token already a candidate,
    tokens outside every top-k, a one-slot span, none at all); chain 1 a re-matched chain entered
    from the drafter's first-slot top-1 (unscored) whose tokens sometimes equal chain 0's."""
    ids0 = torch.randint(0, vocab, (bs, n), generator=g)
    ids0[0, 0] = logits[0, 0].argmax()                                          # already a candidate
    ids0[1] = logits[1].topk(k + 3).indices[:, -1]                              # outside every top-k
    ids0[2, 1:] = -1                                                            # a span of one slot
    ids0[3] = -1                                                                # no copy at all
    ids1 = torch.randint(0, vocab, (bs, n), generator=g)
    ids1[:, 0] = logits[:, 0].argmax(-1)                                        # the entry
    ids1[0, 1:] = ids0[0, 1:]                                                   # the same chain twice
    ids1[1, 2:] = logits[1, 2:].topk(k + 4).indices[:, -1]
    ids1[3, 2:] = -1
    scored1 = ids1 >= 0
    scored1[:, 0] = False
    follow, reenter = torch.randn(bs, 2, n, generator=g) * 2, torch.randn(bs, 2, n, generator=g) * 2
    return torch.stack([ids0, ids1], 1), follow, reenter, torch.stack([ids0 >= 0, scored1], 1)


@pytest.mark.parametrize("mode", ["mixture", "logit"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n_chains", [1, 2])
@torch.no_grad()
def test_copy_lattice_equals_brute_force_paths(mode, seed, n_chains):
    g = torch.Generator().manual_seed(seed)
    bs, n, k, vocab = 4, 3, 2, 12
    logits = torch.randn(bs, n, vocab, generator=g) * 2
    table = torch.randn(vocab, 6, generator=g)
    scorer = TransitionScorer(6)
    with torch.no_grad():
        scorer.weight.copy_(torch.randn(6, 6, generator=g) * 0.5)
    anchors = torch.randint(0, vocab, (bs,), generator=g)
    ids, follow, reenter, scored = (t[:, :n_chains] for t in _chains(bs, n, vocab, logits, k, g))
    copies = CopyCandidates(ids=ids, follow=follow, reenter=reenter, scored=scored, mode=mode)
    for temperature in (0.0, 0.7):
        sel = select_tokens(logits, anchors, torch.full((bs,), temperature), mode="transition", top_k=k, lam=0.8,
                            scorer=scorer, table=table, copies=copies, generator=torch.Generator().manual_seed(seed))
        assert sel.cand_ids.shape == (bs, n, k + n_chains)
        for b in range(bs):
            chains = [tuple(t[b, c].tolist() for t in (ids, follow, reenter, scored)) for c in range(n_chains)]
            cands, cond = _brute_force_lattice(logits[b], int(anchors[b]), chains, mode, scorer, table, 0.8, k)
            for i in range(n):
                assert len(set(sel.cand_ids[b, i].tolist())) == k + n_chains       # ids unique in a slot
                assert set(cands[i]) <= set(sel.cand_ids[b, i].tolist())
                extra = [j for j, c in enumerate(sel.cand_ids[b, i].tolist()) if c not in cands[i]]
                assert all(float(sel.q[b, i, j]) == 0.0 for j in extra)
            if temperature == 0.0:
                def path_score(path):
                    prev = [int(anchors[b])] + list(path[:-1])
                    return sum(cond(i, prev[i])[path[i]] for i in range(n))
                best = max(itertools.product(*cands), key=path_score)
                assert sel.tokens[b].tolist() == list(best)
            else:
                prev = [int(anchors[b])] + sel.tokens[b, :-1].tolist()
                for i in range(n):
                    want = {c: math.exp(v) for c, v in cond(i, prev[i], temperature).items()}
                    got = dict(zip(sel.cand_ids[b, i].tolist(), sel.q[b, i].tolist()))
                    assert all(got[c] == pytest.approx(p, abs=1e-5) for c, p in want.items())
                    assert got[int(sel.tokens[b, i])] > 0


def test_mixture_score_is_the_copy_mixture():
    """Against the whole vocabulary the copy token weighs p + (1-p)*pi_c, any other x (1-p)*pi_x."""
    g = torch.Generator().manual_seed(5)
    logits, rho, c = torch.randn(50, generator=g) * 3, torch.tensor(0.8), 17
    unary = logits.clone()
    unary[c] = copy_scores(logits[c], logits.logsumexp(0), rho, "mixture")
    p, pi = torch.sigmoid(rho), torch.softmax(logits, 0)
    want = (1 - p) * pi
    want[c] += p
    assert torch.allclose(torch.softmax(unary, 0), want, atol=1e-6)
    assert float(copy_scores(torch.tensor(float("-inf")), torch.tensor(2.0), rho, "mixture")) == pytest.approx(2.8)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_triton_selection_with_copies_equals_the_torch_path(temperature):
    g = torch.Generator().manual_seed(9)
    bs, n, k, vocab = 4, 7, 4, 300
    logits, table = torch.randn(bs, n, vocab, generator=g) * 2, torch.randn(vocab, 8, generator=g)
    scorer = TransitionScorer(8)
    ids, follow, reenter, scored = _chains(bs, n, vocab, logits, k, g)
    copies = CopyCandidates(ids=ids, follow=follow, reenter=reenter - 2, scored=scored)
    anchors = torch.randint(0, vocab, (bs,), generator=g)
    picks = {}
    with torch.no_grad():
        for mode in ("torch", "triton"):
            with dispatch.forced(mode):
                picks[mode] = select_tokens(logits, anchors, torch.full((bs,), temperature), mode="transition",
                                            top_k=k, lam=1.0, scorer=scorer, table=table, copies=copies,
                                            generator=torch.Generator().manual_seed(2))
    want, got = picks["torch"], picks["triton"]
    assert torch.equal(got.cand_ids, want.cand_ids) and torch.equal(got.choice, want.choice)
    torch.testing.assert_close(got.q, want.q, rtol=0, atol=1e-6)


def test_copies_need_the_transition_lattice():
    logits = torch.randn(1, 3, 10)
    copies = CopyCandidates(ids=torch.full((1, 1, 3), 4), follow=torch.zeros(1, 1, 3), reenter=torch.zeros(1, 1, 3),
                            scored=torch.ones(1, 1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="transition lattice"):
        select_tokens(logits, torch.tensor([1]), torch.zeros(1), mode="argmax", top_k=2, lam=1.0, scorer=None,
                      table=None, copies=copies)


def test_copy_candidates_off_is_the_lattice_of_before():
    """select_tokens without copies runs exactly the K-candidate lattice: top-K, pair scores, walk."""
    g = torch.Generator().manual_seed(7)
    bs, n, k, vocab = 3, 5, 4, 40
    logits, table = torch.randn(bs, n, vocab, generator=g) * 2, torch.randn(vocab, 8, generator=g)
    scorer = TransitionScorer(8)
    with torch.no_grad():
        scorer.weight.copy_(torch.randn(8, 8, generator=g))
    anchors, temperature = torch.randint(0, vocab, (bs,), generator=g), torch.tensor([0.0, 0.6, 1.3])
    sel = select_tokens(logits, anchors, temperature, mode="transition", top_k=k, lam=0.7, scorer=scorer, table=table,
                        generator=torch.Generator().manual_seed(3))
    unary, cand = candidate_topk(logits, k)
    choice, q = walk_path(unary, pair_scores(scorer, table, anchors, cand), 0.7, temperature,
                          torch.rand(bs, n, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(sel.cand_ids, cand) and torch.equal(sel.choice, choice) and torch.equal(sel.q, q)


# --------------------------------------------------------------------------------- reference engine
def _record_selections(monkeypatch) -> list:
    """Wrap the proposer's select_tokens: every call's (copies, selection) lands in the list."""
    calls = []

    def spy(*args, **kwargs):
        sel = select_tokens(*args, **kwargs)
        calls.append((kwargs.get("copies"), sel))
        return sel

    monkeypatch.setattr(proposer_module, "select_tokens", spy)
    return calls


def _copies_chosen(calls, top_k: int) -> int:
    """Proposals taken from the chains' extra columns (copy tokens the drafter's top-K lacked)."""
    return sum(int((sel.choice >= top_k).sum()) for copies, sel in calls if copies is not None)


def test_copies_off_leave_generation_unchanged(llama_target, monkeypatch):
    """Copy settings do nothing while copy_candidates is off: no history, no copies, same tokens."""
    prompts = [p + p for p in fixed_prompts(4, llama_target.config.vocab_size)]
    calls = _record_selections(monkeypatch)
    runs = [generate(llama_target, drafter_for(llama_target, **over), prompts, max_new_tokens=12, stop_token_ids=[],
                     temperature=0.8, seed=4).tokens
            for over in ({}, dict(copy_min_match=1, **constant_copy_scores(9.0, 9.0)))]
    assert runs[0] == runs[1] and calls and all(copies is None for copies, _ in calls)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_parity_with_copies_on_repeating_prompts(llama_target, monkeypatch, batch_size):
    prompts = [p + p + p[:2] for p in fixed_prompts(6, llama_target.config.vocab_size)]
    plain = generate(llama_target, None, prompts, max_new_tokens=20, stop_token_ids=[]).tokens
    calls = _record_selections(monkeypatch)
    drafter = drafter_for(llama_target, copy_candidates=True, copy_min_match=1)
    spec = generate(llama_target, drafter, prompts, max_new_tokens=20, stop_token_ids=[], batch_size=batch_size)
    assert spec.tokens == plain
    assert _copies_chosen(calls, drafter.config.selection_top_k) > 0, "no copy token was ever proposed"


def bigram_target():
    """A Llama whose attention outputs are zeroed: the next token depends on the current one only,
    so a greedy answer repeats whatever followed the same token before (an oracle for copying)."""
    target = tiny_llama(seed=4)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return target


def test_copies_raise_tau_where_the_answer_copies_its_context(monkeypatch):
    target = bigram_target()
    starts = [[40], [77], [123]]
    answers = generate(target, None, starts, max_new_tokens=29, stop_token_ids=[]).tokens
    chains = [s + a for s, a in zip(starts, answers)]
    prompts = [c[:30] + c[3:8] for c in chains]                 # the answer continues the chain from 8 on
    plain = generate(target, None, prompts, max_new_tokens=20, stop_token_ids=[]).tokens
    assert plain == [c[8:28] for c in chains]
    calls = _record_selections(monkeypatch)
    off = generate(target, drafter_for(target, block_size=8), prompts, max_new_tokens=20, stop_token_ids=[])
    on = generate(target, drafter_for(target, block_size=8, copy_candidates=True), prompts, max_new_tokens=20,
                  stop_token_ids=[])
    assert on.tokens == plain and off.tokens == plain
    assert on.stats.tau > 4.0 and on.stats.tau > 2 * off.stats.tau, (on.stats.tau, off.stats.tau)
    assert _copies_chosen(calls, 4) > 0


@pytest.mark.parametrize("mode", ["mixture", "logit"])
def test_speculative_sampling_with_copies_matches_target(mode, monkeypatch):
    """T > 0, copies on: the first three emitted tokens follow the target's exact joint distribution."""
    target = tiny_llama(vocab=6, hidden=32, layers=2, seed=3, init=0.3)
    drafter = drafter_for(target, seed=5, selection_top_k=2, block_size=4, injection_top_k=2, mask_token_id=0,
                          successor_table_size=4, copy_candidates=True, copy_min_match=1,
                          **constant_copy_scores(1.5, -0.5, mode))
    params = dict(temperature=1.0)
    calls = _record_selections(monkeypatch)
    counts = empirical(target, drafter, params, seed=21)
    assert sum(counts.values()) == DRAWS
    assert _copies_chosen(calls, 2) > 100, "copy tokens outside the top-K must be proposed"
    p = chi2_pvalue(exact_joint(target, params), counts)
    assert p > 0.01, f"speculative samples deviate from the target distribution (chi-square p={p:.2e})"
