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
class Selection:
    """Chosen proposals of one round. tokens: [bs, N]; cand_ids: [bs, N, K] or None;
    q: [bs, N, K] proposal probabilities over cand_ids (None: no proposal distribution, the
    argmax ablation or greedy rows only); choice: [bs, N] index of each token in cand_ids."""

    tokens: Tensor
    cand_ids: Tensor | None = None
    q: Tensor | None = None
    choice: Tensor | None = None


def select_tokens(logits: Tensor, anchor_ids: Tensor, temperature: Tensor, *, mode: str, top_k: int,
                  lam: float, scorer: TransitionScorer | None, table: Tensor | None,
                  successors: SuccessorTable | None = None, generator: torch.Generator | None = None) -> Selection:
    """logits: [bs, N, V] draft logits of the N proposal slots; anchor_ids: [bs]; temperature: [bs].

    `mode="argmax"`: independent argmax per slot (q is None: verification then matches the
    target's own sample). `mode="transition"`: the lattice walk over `candidate_topk`; at λ=0 it
    equals independent argmax for greedy rows."""
    if mode == "argmax":
        return Selection(tokens=logits.argmax(-1))
    bs, n, _ = logits.shape
    unary, cand = candidate_topk(logits, top_k)                                 # [bs, N, K]
    pair = pair_scores(scorer, table, anchor_ids, cand, successors)             # [bs, N, K, K]
    uniforms = torch.rand(bs, n, generator=generator, device=logits.device)
    choice, q = walk_path(unary, pair, lam, temperature, uniforms)
    tokens = cand.gather(-1, choice[..., None]).squeeze(-1)
    return Selection(tokens=tokens, cand_ids=cand, q=q, choice=choice)
