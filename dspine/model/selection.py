"""Token selection over the drafted block's candidate lattice, shared by every caller.

The reference engine and the trainer (`select_tokens`) and SGLang's draft model class
(`dspine.sglang.draft_model`: `compute_candidates`, `build_lattice`, `sample_path`) run these same
functions, so both pick the same tokens with the same proposal q.

The lattice: each of the N proposal slots of a block keeps its K best draft candidates
(`candidate_topk`, descending logits); candidate c of slot i after candidate a of slot i-1 scores
`unary_i(c) + λ·T(a, c)` with T the transition score (`TransitionScorer`; slot 0's predecessor is
the verified anchor). The walk (`walk_path`) is Viterbi for greedy rows (temperature <= 0) and an
inverse-CDF sample with proposal q elsewhere (`kernels.transition_select`: the PyTorch reference,
or the Triton kernel on `dispatch.use_triton` tensors).

Copy candidates (`CopyCandidates`, from `dspine.model.copy_candidates`): each slot may also hold the
token that copying the request's own context predicts there. It joins the slot as an extra column
(K -> K+1, `copy_lattice`) with a score from its log-odds of being the target's next token, and the
pair copy(i-1) -> copy(i) gets the extra score of staying on the copied span; the walk is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspine.kernels import dispatch
from dspine.kernels.transition_select import transition_path_reference
from dspine.model.transition import SuccessorTable, TransitionScorer


def candidate_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> (values [..., k] fp32, ids [..., k] int64), in descending logit order.

    Triton path: `kernels.logits_topk` (one split-V launch; an exact tie goes to the lower id,
    which torch.topk leaves open). PyTorch path: torch.topk in the logits' dtype, then the k values
    cast to fp32 (exact and monotone; no fp32 copy of [..., V])."""
    if dispatch.use_triton(logits):
        from dspine.kernels.logits_topk import logits_topk
        return logits_topk(logits, k)
    values, ids = logits.topk(k, dim=-1)
    return values.float(), ids


def predecessor_ids(anchor_ids: Tensor, candidate_ids: Tensor) -> Tensor:
    """anchor_ids [bs], candidate_ids [bs, n, K] -> the predecessors of every slot [bs, n, K]:
    slot 0's are the anchor (repeated K times), slot i's are slot i-1's candidates."""
    bs, _, k = candidate_ids.shape
    return torch.cat([anchor_ids[:, None, None].expand(bs, 1, k), candidate_ids[:, :-1]], dim=1)


def pair_scores(scorer: TransitionScorer, table: Tensor, anchor_ids: Tensor, candidate_ids: Tensor,
                successors: SuccessorTable | None = None) -> Tensor:
    """T(pred_a, cand_c) [bs, n, K, K] fp32 for candidate_ids [bs, n, K] after anchor_ids [bs];
    read from `successors` where it caches the pair (the same numbers), computed otherwise."""
    prev = predecessor_ids(anchor_ids, candidate_ids)
    if successors is not None:
        return successors.pair(scorer, table, prev, candidate_ids)
    return scorer.pair(table, prev, candidate_ids).float()


def lattice_scores(scorer: TransitionScorer, table: Tensor, candidate_ids: Tensor, unary: Tensor,
                   anchor_ids: Tensor, lam: float) -> Tensor:
    """score[b, i, a, c] = unary[b, i, c] + lam * T(pred_a, cand_c): [bs, n, K, K] fp32 from
    candidate_ids/unary [bs, n, K] and anchor_ids [bs] (SGLang's `build_lattice` contract)."""
    return unary.float()[:, :, None, :] + lam * pair_scores(scorer, table, anchor_ids, candidate_ids)


def walk_path(unary: Tensor, pair: Tensor, lam: float, temperature: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """The lattice walk: unary [bs, n, K], pair [bs, n, K, K], temperature [bs] (<= 0: Viterbi),
    uniforms [bs, n] -> (choice [bs, n] int64 index into the candidates, q [bs, n, K] fp32)."""
    if dispatch.use_triton(unary):
        from dspine.kernels.transition_select import transition_path
        return transition_path(unary, pair, lam, temperature, uniforms)
    return transition_path_reference(unary, pair, lam, temperature, uniforms)


def walk_lattice(candidate_ids: Tensor, scores: Tensor, temperature: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """`walk_path` over combined `lattice_scores` (the unary part is already inside `scores`, so
    unary 0 and λ 1: the same numbers). Returns (tokens [bs, n] int64, q [bs, n, K] fp32)."""
    zeros = torch.zeros_like(scores[..., 0, :])
    choice, q = walk_path(zeros, scores, 1.0, temperature.float(), uniforms.float())
    return candidate_ids.gather(-1, choice[..., None]).squeeze(-1), q


@dataclass
class CopyCandidates:
    """Copy tokens of one round and their log-odds rho of being the target's next token.

    ids [bs, N] int64: the copy token of each slot (-1: none); follow [bs, N] fp32: rho when the path
    enters the slot from the previous slot's copy token (slot 0: always, its predecessor the anchor
    ends the matched suffix); reenter [bs, N] fp32: rho when it enters from another candidate;
    mode: how rho becomes a score (`copy_scores`)."""

    ids: Tensor
    follow: Tensor
    reenter: Tensor
    mode: str = "mixture"


def copy_scores(logit: Tensor, lse: Tensor | None, rho: Tensor, mode: str) -> Tensor:
    """The unary score [bs, N] of a copy token with draft logit `logit` [bs, N] and log-odds `rho`
    [bs, N]; lse [bs, N]: logsumexp of the slot's draft logits (needed by "mixture" only).

    "mixture": log(exp(logit) + exp(lse + rho)). Against another candidate x (score logit_x) the copy
    token then weighs p + (1-p)*pi : (1-p)*pi_x, with p = sigmoid(rho) and pi the draft probabilities:
    the target copies with probability p and otherwise follows the drafter. Never below the draft
    logit, so a weak match cannot push down a token the drafter likes, and finite when the drafter
    gives the token no mass. "logit": logit + rho (rho added to the draft logit as is)."""
    if mode == "mixture":
        return torch.logaddexp(logit, lse + rho)
    return logit + rho


def copy_lattice(values: Tensor, ids: Tensor, copy_logit: Tensor, lse: Tensor | None,
                 copies: CopyCandidates) -> tuple[Tensor, Tensor, Tensor]:
    """A slot's top-(K+1) candidates values/ids [bs, N, K+1] (descending, `candidate_topk`), the copy
    tokens' draft logits copy_logit [bs, N] and lse [bs, N] (see `copy_scores`) ->
    (unary [bs, N, K+1] fp32, cand_ids [bs, N, K+1], span [bs, N, K+1, K+1] fp32).

    Columns 0..K-1 are the K best candidates; column K is the copy token when it is not among them,
    else (no copy token, or it is a candidate already, which then carries the copy score) the
    (K+1)-th best id with unary -inf, so ids stay unique within a slot and q is 0 there. The copy
    token's unary is its `copy_scores` with rho = follow at slot 0 and reenter after; span[b, i, a, c]
    is the extra pair score copy(i-1) -> copy(i), score(follow) - score(reenter), 0 elsewhere."""
    bs, n, k1 = values.shape
    k = k1 - 1
    has = copies.ids >= 0                                                       # [bs, N]
    in_top = (ids[..., :k] == copies.ids[..., None]) & has[..., None]           # [bs, N, K]
    extra = has & ~in_top.any(-1)                                               # [bs, N]
    is_copy = torch.cat([in_top, extra[..., None]], -1)                         # [bs, N, K+1]
    cand = torch.cat([ids[..., :k], torch.where(extra, copies.ids, ids[..., k])[..., None]], -1)
    logit = copy_logit.float()
    on_span = copy_scores(logit, lse, copies.follow, copies.mode)               # [bs, N]
    off_span = copy_scores(logit, lse, copies.reenter, copies.mode)
    first = torch.arange(n, device=values.device) == 0
    score = torch.where(first, on_span, off_span)
    unary = torch.cat([values[..., :k].float(), torch.full_like(values[..., k:], float("-inf"))], -1)
    unary = torch.where(is_copy, score[..., None], unary)
    # score(follow) - score(reenter); in "logit" mode written as follow - reenter, which stays finite
    # when the draft logit is -inf ("mixture" scores are finite whenever lse is).
    step = on_span - off_span if copies.mode == "mixture" else copies.follow - copies.reenter
    link = is_copy[:, :-1, :, None] & is_copy[:, 1:, None, :]                   # [bs, N-1, K+1, K+1]
    span = torch.cat([torch.zeros(bs, 1, k1, k1, device=values.device),
                      torch.where(link, step[:, 1:, None, None].float(), 0.0)], 1)
    return unary, cand, span


def lattice_with_copies(logits: Tensor, anchor_ids: Tensor, copies: CopyCandidates, *, top_k: int, lam: float,
                        scorer: TransitionScorer, table: Tensor,
                        successors: SuccessorTable | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The K+1-candidate lattice of draft logits [bs, N, V] with `copies`: (unary [bs, N, K+1] fp32,
    cand_ids [bs, N, K+1], pair [bs, N, K+1, K+1] fp32), to walk with λ = 1 (λ already scales the
    transition part of `pair`; the copy span's score is not scaled). Shared by `select_tokens` and
    SGLang's draft model class."""
    values, ids = candidate_topk(logits, top_k + 1)                             # [bs, N, K+1]
    copy_logit = logits.gather(-1, copies.ids.clamp(min=0)[..., None]).squeeze(-1)
    lse = torch.logsumexp(logits.float(), -1) if copies.mode == "mixture" else None
    unary, cand, span = copy_lattice(values, ids, copy_logit, lse, copies)
    return unary, cand, lam * pair_scores(scorer, table, anchor_ids, cand, successors) + span


@dataclass
class Selection:
    """Chosen proposals of one round. tokens: [bs, N]; cand_ids: [bs, N, K] (K+1 with copy
    candidates) or None; q: [bs, N, K] proposal probabilities over cand_ids (None: no proposal
    distribution, the argmax ablation or greedy rows only); choice: [bs, N] index of each token in
    cand_ids."""

    tokens: Tensor
    cand_ids: Tensor | None = None
    q: Tensor | None = None
    choice: Tensor | None = None


def select_tokens(logits: Tensor, anchor_ids: Tensor, temperature: Tensor, *, mode: str, top_k: int,
                  lam: float, scorer: TransitionScorer | None, table: Tensor | None,
                  successors: SuccessorTable | None = None, generator: torch.Generator | None = None,
                  copies: CopyCandidates | None = None) -> Selection:
    """logits: [bs, N, V] draft logits of the N proposal slots; anchor_ids: [bs]; temperature: [bs].

    `mode="argmax"`: independent argmax per slot (q is None: verification then matches the
    target's own sample). `mode="transition"`: the lattice walk over `candidate_topk`; at λ=0 it
    equals independent argmax for greedy rows. With `copies` (transition only) the lattice has K+1
    candidates a slot (`copy_lattice`), and cand_ids / q are [bs, N, K+1]."""
    if mode == "argmax":
        if copies is not None:
            raise ValueError("copy candidates need the transition lattice: selection mode 'argmax' has none")
        return Selection(tokens=logits.argmax(-1))
    bs, n, _ = logits.shape
    if copies is None:
        unary, cand = candidate_topk(logits, top_k)                             # [bs, N, K]
        pair = pair_scores(scorer, table, anchor_ids, cand, successors)         # [bs, N, K, K]
    else:
        unary, cand, pair = lattice_with_copies(logits, anchor_ids, copies, top_k=top_k, lam=lam, scorer=scorer,
                                                table=table, successors=successors)
        lam = 1.0
    uniforms = torch.rand(bs, n, generator=generator, device=logits.device)
    choice, q = walk_path(unary, pair, lam, temperature, uniforms)
    tokens = cand.gather(-1, choice[..., None]).squeeze(-1)
    return Selection(tokens=tokens, cand_ids=cand, q=q, choice=choice)
