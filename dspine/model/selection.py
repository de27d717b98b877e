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

Copy candidates (`CopyCandidates`, from `dspine.model.copy_candidates`): C copy chains, each a run
of tokens that copying the request's own context predicts for consecutive slots. A chain's token
joins its slot as an extra column (K -> K+C, `copy_lattice`) with a score from its log-odds of being
the target's next token, and the pair chain(i-1) -> chain(i) gets the extra score of staying on the
chain; the walk is the same.
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
    """Copy chains of one round and their log-odds rho of being the target's next token.

    ids [bs, C, N] int64: chain c's token of each slot (-1: none); follow [bs, C, N] fp32: rho when
    the path enters the slot from the chain's previous token (slot 0: always, its predecessor the
    anchor ends chain 0's matched suffix); reenter [bs, C, N] fp32: rho when it enters from another
    candidate; scored [bs, C, N] bool: False where the chain's token is an entry, the drafter's own
    candidate the chain was matched after, which links to the chain's next token but keeps its
    draft score; mode: how rho becomes a score (`copy_scores`)."""

    ids: Tensor
    follow: Tensor
    reenter: Tensor
    scored: Tensor
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


def copy_columns(ids: Tensor, k: int, chains: Tensor) -> Tensor:
    """ids [bs, N, K+2C] (descending, `candidate_topk`), chains [bs, C, N] (-1: none) -> cand_ids
    [bs, N, K+C], unique within a slot: the K best, then per chain c the chain's token in column
    K+c unless the lattice holds it already (among the K best or an earlier chain's), else a
    placeholder: the next-best ids that are no chain's token of the slot."""
    n_chains = chains.shape[1]
    tokens = chains.transpose(1, 2)                                             # [bs, N, C]
    pool = ids[..., k:]                                                         # [bs, N, 2C]
    free = ~(pool[..., :, None] == tokens[..., None, :]).any(-1)                # [bs, N, 2C] no chain's id
    rank = free.long().cumsum(-1)                                               # 1, 2, ... over the free ids
    pick = free[..., None] & (rank[..., None] == torch.arange(1, n_chains + 1, device=ids.device))
    cand = torch.cat([ids[..., :k], (pool[..., None] * pick).sum(-2)], -1)      # [bs, N, K+C]
    for c in range(n_chains):
        token = tokens[..., c]
        held = (cand[..., : k + c] == token[..., None]).any(-1)
        cand[..., k + c] = torch.where((token >= 0) & ~held, token, cand[..., k + c])
    return cand


def copy_lattice(values: Tensor, ids: Tensor, logits: Tensor, lse: Tensor | None,
                 copies: CopyCandidates) -> tuple[Tensor, Tensor, Tensor]:
    """A slot's top-(K+2C) candidates values/ids [bs, N, K+2C] (descending, `candidate_topk`), the
    draft logits [bs, N, V] and their logsumexp lse [bs, N] (needed by "mixture" only), C copy
    chains -> (unary [bs, N, K+C] fp32, cand_ids [bs, N, K+C], span [bs, N, K+C, K+C] fp32).

    Columns (`copy_columns`): the K best, then one per chain; a chain token already in the lattice
    shares that column. A column's unary is the highest `copy_scores` of the chains that score its
    token there (rho = follow at slot 0, reenter after), else its draft logit, and -inf for a
    placeholder (q is 0 there). span[b, i, a, c] is the extra pair score chain(i-1) -> chain(i),
    score(follow) - score(reenter) at slot i, the highest of the chains linking a to c; 0 elsewhere."""
    bs, n, _ = values.shape
    n_chains = copies.ids.shape[1]
    k = values.shape[-1] - 2 * n_chains
    cand = copy_columns(ids, k, copies.ids)                                     # [bs, N, K+C]
    member = (cand[:, None] == copies.ids[..., None]) & (copies.ids >= 0)[..., None]   # [bs, C, N, K+C]
    draft = logits.gather(-1, cand).float()                                     # [bs, N, K+C]
    in_chain = member.any(1)
    unary = torch.cat([values[..., :k].float(), torch.where(in_chain[..., k:], draft[..., k:], float("-inf"))], -1)
    logit = draft[:, None].expand(-1, n_chains, -1, -1).masked_fill(~member, 0.0).sum(-1)   # [bs, C, N]
    lse_c = None if lse is None else lse[:, None].expand(-1, n_chains, -1)
    on_chain = copy_scores(logit, lse_c, copies.follow, copies.mode)             # [bs, C, N]
    off_chain = copy_scores(logit, lse_c, copies.reenter, copies.mode)
    first = torch.arange(n, device=values.device) == 0
    score = torch.where(first, on_chain, off_chain)
    scoring = member & copies.scored[..., None]                                 # [bs, C, N, K+C]
    best = torch.where(scoring, score[..., None], float("-inf")).amax(1)        # [bs, N, K+C]
    unary = torch.where(scoring.any(1), best, unary)
    # score(follow) - score(reenter); in "logit" mode written as follow - reenter, which stays finite
    # when the draft logit is -inf ("mixture" scores are finite whenever lse is).
    step = on_chain - off_chain if copies.mode == "mixture" else copies.follow - copies.reenter
    link = member[:, :, :-1, :, None] & member[:, :, 1:, None, :]               # [bs, C, N-1, K+C, K+C]
    linked = torch.where(link, step[:, :, 1:, None, None].float(), float("-inf")).amax(1)
    span = torch.cat([torch.zeros_like(linked[:, :1]), torch.where(link.any(1), linked, 0.0)], 1)
    return unary, cand, span


def lattice_with_copies(logits: Tensor, anchor_ids: Tensor, copies: CopyCandidates, *, top_k: int, lam: float,
                        scorer: TransitionScorer, table: Tensor,
                        successors: SuccessorTable | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The K+C-candidate lattice of draft logits [bs, N, V] with C copy chains: (unary [bs, N, K+C]
    fp32, cand_ids [bs, N, K+C], pair [bs, N, K+C, K+C] fp32), to walk with λ = 1 (λ already scales
    the transition part of `pair`; the chains' span scores are not scaled). Shared by `select_tokens`
    and SGLang's draft model class."""
    values, ids = candidate_topk(logits, top_k + 2 * copies.ids.shape[1])      # [bs, N, K+2C]
    lse = torch.logsumexp(logits.float(), -1) if copies.mode == "mixture" else None
    unary, cand, span = copy_lattice(values, ids, logits, lse, copies)
    return unary, cand, lam * pair_scores(scorer, table, anchor_ids, cand, successors) + span


@dataclass
class Selection:
    """Chosen proposals of one round. tokens: [bs, N]; cand_ids: [bs, N, K] (K+C with C copy
    chains) or None; q: [bs, N, K] proposal probabilities over cand_ids (None: no proposal
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
    equals independent argmax for greedy rows. With `copies` (transition only) the lattice has K+C
    candidates a slot (`copy_lattice`), and cand_ids / q are [bs, N, K+C]."""
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
