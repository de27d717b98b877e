"""Copy candidates through SGLang >= 0.5.20's DFlash selector seam, on CPU against SGLang's own code.

With a `SlotTokenHistory` attached, `DSpineDraftModel.compute_candidates` returns K+C candidates a
slot (the top-K draft candidates and one column per copy chain of `selection.lattice_with_copies`),
`candidate_selector.top_k` says K+C (SGLang sizes its sampler's buffers with it) and
`build_lattice` returns that lattice's scores. Checked here through SGLang 0.5.22's own
`_SelectorDraftSampler` (the draft-graph hook) and its eager twin (`_selector_lattice` +
`sample_path`, what `_propose_selector_block` runs):

- greedy rows propose `_propose_with_copies`'s Viterbi tokens (0.5.17's path) and the reference
  `select_tokens` with copy candidates built here from the rows' token lists (several seeds;
  rows with and without a match);
- sampled rows return the proposal q of the K+C lattice for the uniforms the sampler drew, against
  the PyTorch reference walk over a lattice built independently, and that q survives SGLang's
  dense scatter over the candidate ids;
- without a history, the seam is the plain K-candidate lattice it was before.
"""

from __future__ import annotations

import importlib.metadata

import pytest

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

import torch  # noqa: E402

from dspine.sglang import compat  # noqa: E402

if not compat.has_selector_seam():
    pytest.skip("SGLang < 0.5.20 has no DFlash selector seam (copy candidates run through `propose`)",
                allow_module_level=True)

from sglang.srt.speculative.dflash_worker_v2 import _selector_lattice, _SelectorDraftSampler  # noqa: E402

from dspine.kernels.transition_select import transition_path_reference  # noqa: E402
from dspine.model.copy_candidates import CopyTables, copy_candidates  # noqa: E402
from dspine.model.selection import lattice_scores, lattice_with_copies, select_tokens  # noqa: E402
from dspine.sglang.token_history import SlotTokenHistory  # noqa: E402
from test_sglang_draft_model import (H, K, N, V, attached, ckpt, reference_tokens,  # noqa: E402,F401  (fixtures)
                                     sglang_env, target_weights)

MAX_BS, WINDOW = 6, 32
SEEDS = [0, 1, 2]
C = 2                     # copy chains: the drafter's config keeps copy_rematch at its default


def request_rows(g: torch.Generator) -> list[list[int]]:
    """Four requests' tokens, each ending with its anchor: a span then its first tokens again (a
    match mid-span), no repeat at all (no match), a span twice (a match at its start), a short
    repeat (a match of 3 tokens)."""
    span = torch.randint(16, V, (12,), generator=g).tolist()
    fresh = torch.randperm(V - 16, generator=g)[:15].add(16).tolist()  # distinct ids: no suffix repeats
    short = torch.randint(16, V, (9,), generator=g).tolist()
    return [span + [7, 9] + span[:5], fresh, span * 2, short + [5, 6] + short[-3:]]


def attach_history(model, rows: list[list[int]]) -> SlotTokenHistory:
    """A SlotTokenHistory attached to `model` holding `rows` in pool slots 1.., pointed at them as
    the worker does before a draft (the last token of each row is the block's anchor)."""
    history = SlotTokenHistory(pool_rows=8, max_context_len=64, block_size=N, window=WINDOW, max_bs=MAX_BS,
                               device="cpu")
    model.attach_token_history(history)
    slots = torch.arange(1, len(rows) + 1)
    history.write_prefill(slots, [r[:-1] for r in rows], torch.tensor([r[-1] for r in rows]))
    history.prepare_draft(slots, torch.tensor([len(r) - 1 for r in rows]))
    return history


def draft_step(g: torch.Generator, rows: list[list[int]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft hook's inputs for a graph batch of n blocks whose first len(rows) are real:
    hidden [n*N, H] and block ids [n*N] with each real block's anchor its row's last token."""
    hidden = torch.randn(n * N, H, generator=g)
    input_ids = torch.randint(0, V, (n * N,), generator=g)
    input_ids.view(n, N)[: len(rows), 0] = torch.tensor([r[-1] for r in rows])
    return hidden, input_ids


def independent_lattice(ref, model, rows, hidden, anchors):
    """(copies, unary, ids, pair) of the real blocks from the reference drafter's logits and copy
    candidates found in the python token lists (not through the history or the model)."""
    cfg = model.dspine_config
    recent = [r[-WINDOW:] for r in rows]
    tokens = torch.tensor([r + [0] * (WINDOW - len(r)) for r in recent])
    logits = ref.logits(hidden.view(-1, N, H)[: len(rows), 1:])
    copies = copy_candidates(tokens, torch.tensor([len(r) for r in recent]), cfg, CopyTables.from_config(cfg), N - 1,
                             logits[:, 0].argmax(-1))
    unary, ids, pair = lattice_with_copies(logits, anchors, copies, top_k=cfg.selection_top_k,
                                           lam=cfg.transition_lambda, scorer=ref.transition, table=ref.transfer_table())
    return copies, logits, unary, ids, pair


def check_copies_matter(copies, ids):
    """The rows are what the tests claim: rows 0, 2, 3 have copy tokens, row 1 has none, and some
    copy token is a (K+1)-th column no top-K candidate holds (else dropping it could go unseen)."""
    has = (copies.ids[:, 0] >= 0).any(-1)
    assert has.tolist() == [True, False, True, True]
    assert ((ids[..., K] == copies.ids[:, 0]) & (copies.ids[:, 0] >= 0)).any()


# ------------------------------------------------------------------------------- greedy rows
@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_seam_proposes_the_copy_lattice_viterbi_path(attached, seed):
    """SGLang's in-graph sampler (sampling off: greedy) and its eager path propose, for every real
    row, the tokens of `_propose_with_copies` (0.5.17's path) and of the reference `select_tokens`
    with the same copy candidates; the buffers hold K+C candidates a slot."""
    model, ref = attached
    g = torch.Generator().manual_seed(seed)
    rows = request_rows(g)
    attach_history(model, rows)
    n, real = 5, len(rows)                                   # graph batch: 4 real rows and a padded one
    hidden, input_ids = draft_step(g, rows, n)
    anchors = input_ids.view(n, N)[:real, 0]
    blocks = hidden.view(n, N, H)

    selector = model.candidate_selector
    assert model.dspine_config.copy_chains == C and selector.top_k == K + C
    sampler = _SelectorDraftSampler(draft_model=model, block_size=N, max_bs=MAX_BS, device="cpu",
                                    sampling_enabled=False)
    assert sampler.candidate_out.shape == sampler.q_out.shape == (MAX_BS, N - 1, K + C)
    sampler.stage_sampling_params(bs=n, sampling_info=None)
    sampler(hidden, input_ids)
    graph_tokens = sampler.out[: n * (N - 1)].view(n, N - 1)[:real]

    ids, scores = _selector_lattice(model, blocks[:real, 1:], anchors)   # the eager path
    assert scores.shape == (real, N - 1, K + C, K + C) and scores.dtype == torch.float32
    eager_tokens, eager_q = selector.sample_path(candidate_ids=ids, scores=scores, uniforms=torch.rand(real, N - 1),
                                                 temperatures=torch.ones(real),
                                                 greedy_mask=torch.ones(real, dtype=torch.bool))

    tokens, want_ids, q = model._propose_with_copies(blocks[:real, 1:], anchors, torch.zeros(real),
                                                     torch.zeros(real, N - 1))
    assert torch.equal(graph_tokens, tokens) and torch.equal(eager_tokens, tokens)
    assert torch.equal(sampler.candidate_out[:real], want_ids) and torch.equal(ids, want_ids)
    assert torch.equal(eager_q, q) and torch.equal(sampler.q_out[:real], q)      # one-hot at the path

    copies, logits, _, ref_ids, _ = independent_lattice(ref, model, rows, hidden, anchors)
    check_copies_matter(copies, ref_ids)
    cfg = model.dspine_config
    want = select_tokens(logits, anchors, torch.zeros(real), mode="transition", top_k=cfg.selection_top_k,
                         lam=cfg.transition_lambda, scorer=ref.transition, table=ref.transfer_table(), copies=copies)
    assert torch.equal(tokens, want.tokens) and torch.equal(want_ids, want.cand_ids)


def test_copies_change_the_greedy_proposals(attached):
    """Over the seeds, the copy lattice's Viterbi path differs from the K-candidate one somewhere
    (so the parity above is not parity of two plain lattices)."""
    model, ref = attached
    changed = False
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        rows = request_rows(g)
        attach_history(model, rows)
        hidden, input_ids = draft_step(g, rows, len(rows))
        sampler = _SelectorDraftSampler(draft_model=model, block_size=N, max_bs=MAX_BS, device="cpu",
                                        sampling_enabled=False)
        sampler.stage_sampling_params(bs=len(rows), sampling_info=None)
        sampler(hidden, input_ids)
        plain = reference_tokens(ref, hidden.view(-1, N, H), input_ids.view(-1, N)[:, 0], torch.zeros(len(rows)))
        changed |= not torch.equal(sampler.out[: len(rows) * (N - 1)].view(len(rows), N - 1), plain.tokens)
    assert changed


def test_build_lattice_takes_only_the_candidates_just_computed(attached):
    """The pair scores wait in a static buffer for the build_lattice call that follows
    compute_candidates: a call without one, or with other rows, fails instead of reading stale ones."""
    model, _ = attached
    g = torch.Generator().manual_seed(4)
    rows = request_rows(g)
    attach_history(model, rows)
    hidden = torch.randn(len(rows), N - 1, H, generator=g)
    anchors = torch.tensor([r[-1] for r in rows])
    selector = model.candidate_selector
    ids, unary = model.compute_candidates(hidden.reshape(-1, H))
    ids, unary = ids.view(len(rows), N - 1, -1), unary.view(len(rows), N - 1, -1)
    with pytest.raises(RuntimeError, match="compute_candidates call just before"):
        selector.build_lattice(candidate_ids=ids[:2], unary_logits=unary[:2], hidden_states=hidden[:2],
                               anchor_token_ids=anchors[:2])
    fresh = model.compute_candidates(hidden.reshape(-1, H))
    with pytest.raises(RuntimeError, match="compute_candidates call just before"):
        selector.build_lattice(candidate_ids=fresh[0].clone().view(ids.shape), unary_logits=unary,
                               hidden_states=hidden, anchor_token_ids=anchors)
    ids, unary = (t.view(len(rows), N - 1, -1) for t in model.compute_candidates(hidden.reshape(-1, H)))
    scores = selector.build_lattice(candidate_ids=ids, unary_logits=unary, hidden_states=hidden,
                                    anchor_token_ids=anchors)
    unary_want, ids_want, pair_want = model.copy_candidate_lattice(hidden.reshape(-1, H), anchors)
    assert torch.equal(ids, ids_want) and torch.equal(scores, unary_want[:, :, None, :] + pair_want)
    with pytest.raises(RuntimeError, match="compute_candidates call just before"):  # used up
        selector.build_lattice(candidate_ids=ids, unary_logits=unary, hidden_states=hidden, anchor_token_ids=anchors)


# ------------------------------------------------------------------------------ sampled rows
@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_seam_returns_the_copy_lattice_proposal_q(attached, seed):
    """Sampling on, greedy and sampled rows mixed: SGLang's in-graph sampler walks the K+C lattice
    with the uniforms it drew, and its q rows are the reference walk's over a lattice built
    independently (reference drafter logits, copies from the token lists); the eager path gives the
    same for the same uniforms; SGLang's dense scatter of q over the candidate ids loses nothing."""
    model, ref = attached
    g = torch.Generator().manual_seed(seed)
    rows = request_rows(g)
    attach_history(model, rows)
    n, real = 5, len(rows)
    hidden, input_ids = draft_step(g, rows, n)
    anchors = input_ids.view(n, N)[:real, 0]
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.4, 1.0])     # row 2 greedy
    sampler = _SelectorDraftSampler(draft_model=model, block_size=N, max_bs=MAX_BS, device="cpu",
                                    sampling_enabled=True)
    sampler.temperatures[:n] = temperature.clamp_min(1e-5)
    sampler.greedy_mask[:n] = temperature <= 0
    torch.manual_seed(100 + seed)                              # the sampler's in-graph draw
    sampler(hidden, input_ids)
    uniforms = sampler.uniforms[:real].clone()
    tokens = sampler.out[: n * (N - 1)].view(n, N - 1)[:real]
    cand, q = sampler.candidate_out[:real], sampler.q_out[:real]

    copies, _, unary, ids, pair = independent_lattice(ref, model, rows, hidden, anchors)
    check_copies_matter(copies, ids)
    choice, want_q = transition_path_reference(unary, pair, 1.0, temperature[:real], uniforms)
    assert torch.equal(cand, ids)
    assert torch.equal(tokens, ids.gather(-1, choice[..., None]).squeeze(-1))
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    sampled = temperature[:real] > 0
    assert (q[sampled][..., K] > 0).any(), "some sampled slot should give its copy column mass"
    torch.testing.assert_close(q.sum(-1), torch.ones(real, N - 1))
    assert (q[unary == float("-inf")] == 0).all()                 # an -inf column never gets mass

    scatter = torch.zeros(real, N - 1, V).scatter_(-1, cand, q)    # `_selector_sampling_accept`'s dense q
    assert torch.equal(scatter.gather(-1, cand), q)

    eager_ids, scores = _selector_lattice(model, hidden.view(n, N, H)[:real, 1:], anchors)
    eager_tokens, eager_q = model.candidate_selector.sample_path(
        candidate_ids=eager_ids, scores=scores, uniforms=uniforms, temperatures=sampler.temperatures[:real],
        greedy_mask=sampler.greedy_mask[:real])
    assert torch.equal(eager_ids, cand) and torch.equal(eager_tokens, tokens) and torch.equal(eager_q, q)


# ------------------------------------------------------------------------------- no history
def test_without_a_history_the_seam_is_the_plain_lattice(attached):
    """No history attached: K candidates a slot from SGLang's own top-k, `lattice_scores` for the
    lattice, and SGLang's sampler equals the reference `select_tokens` without copies."""
    model, ref = attached
    g = torch.Generator().manual_seed(5)
    n = 3
    hidden = torch.randn(n * N, H, generator=g)
    input_ids = torch.randint(0, V, (n * N,), generator=g)
    anchors = input_ids.view(n, N)[:, 0]
    pred = hidden.view(n, N, H)[:, 1:]
    selector = model.candidate_selector
    assert selector.top_k == K and model._copy_pair is None

    ids, unary = model.compute_candidates(pred.reshape(-1, H))
    want_ids, want_vals, _ = compat.sglang_candidate_topk()(pred.reshape(-1, H), model.target_head, K)
    assert torch.equal(ids, want_ids.long()) and torch.equal(unary, want_vals.float())
    ids, unary = ids.view(n, N - 1, K), unary.view(n, N - 1, K)
    scores = selector.build_lattice(candidate_ids=ids, unary_logits=unary, hidden_states=pred, anchor_token_ids=anchors)
    assert torch.equal(scores, lattice_scores(model.transition, model.transfer_table(), ids, unary, anchors,
                                              model.dspine_config.transition_lambda))

    sampler = _SelectorDraftSampler(draft_model=model, block_size=N, max_bs=MAX_BS, device="cpu",
                                    sampling_enabled=True)
    assert sampler.candidate_out.shape == (MAX_BS, N - 1, K)
    sampler.stage_sampling_params(bs=n, sampling_info=None)
    sampler(hidden, input_ids)
    want = reference_tokens(ref, hidden.view(n, N, H), anchors, torch.zeros(n))
    assert torch.equal(sampler.out[: n * (N - 1)].view(n, N - 1), want.tokens)
    assert torch.equal(sampler.candidate_out[:n], want.cand_ids)
