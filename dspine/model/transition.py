"""Transition cache and token selection over the drafted block.

Transition score between neighbouring candidates a -> b: T(a, b) = (U[a] W_T) · U[b], in the
shared transfer space U ([V, r]). The `SuccessorTable` caches, per token, its top-M successors and
their exact scores ([V, M]); rows are filled lazily the first time a token appears as a
predecessor, or all at once (`fill_all`) at load time on a GPU. Pair scores are read from the table
where the successor is cached and computed on the fly otherwise: both give the same number.

Selection (`select_tokens`) walks the lattice of each slot's top-K draft candidates:
`mode="transition"` uses the pair scores (Viterbi at T=0, sampled path with proposal q at T>0);
`mode="argmax"` is the independent-argmax ablation (q is None: verification then matches the
target's own sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dspine.kernels import dispatch
from dspine.kernels.transition_select import transition_path_reference


class TransitionScorer(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rank, rank))  # W_T; zero init = no transition bias

    def left(self, table: Tensor, ids: Tensor) -> Tensor:
        """U[ids] W_T: [..., r]."""
        return table[ids].to(self.weight.dtype) @ self.weight

    def full_row(self, table: Tensor, prev_ids: Tensor) -> Tensor:
        """T(prev, ·) over the whole vocabulary: prev_ids [...] -> [..., V]."""
        return self.left(table, prev_ids) @ table.to(self.weight.dtype).T

    def pair(self, table: Tensor, prev_ids: Tensor, cur_ids: Tensor) -> Tensor:
        """prev_ids [..., Kp], cur_ids [..., K] -> T [..., Kp, K] computed on the fly."""
        return self.left(table, prev_ids) @ table[cur_ids].to(self.weight.dtype).transpose(-1, -2)


class SuccessorTable:
    """Per-token top-M successors and exact transition scores, filled lazily.

    ids: [V, M] int64, scores: [V, M] fp32, filled: [V] bool. Invariant: for a filled row a,
    scores[a, j] == T(a, ids[a, j]) and ids[a] are the M highest-scoring successors of a.
    """

    def __init__(self, vocab_size: int, size: int, device: torch.device | str = "cpu"):
        self.size = size
        self.ids = torch.zeros(vocab_size, size, dtype=torch.long, device=device)
        self.scores = torch.zeros(vocab_size, size, dtype=torch.float32, device=device)
        self.filled = torch.zeros(vocab_size, dtype=torch.bool, device=device)

    def fill(self, scorer: TransitionScorer, table: Tensor, tokens: Tensor, chunk: int = 4096) -> None:
        """Fill the rows of `tokens` (any shape) that are not filled yet."""
        todo = tokens.reshape(-1).unique()
        todo = todo[~self.filled[todo]]
        for start in range(0, todo.numel(), chunk):
            rows = todo[start:start + chunk]
            val, idx = scorer.full_row(table, rows).float().topk(self.size, dim=-1)
            self.ids[rows], self.scores[rows], self.filled[rows] = idx, val, True

    def fill_all(self, scorer: TransitionScorer, table: Tensor, chunk: int = 4096) -> None:
        self.fill(scorer, table, torch.arange(self.ids.shape[0], device=self.ids.device), chunk)

    def pair(self, scorer: TransitionScorer, table: Tensor, prev_ids: Tensor, cur_ids: Tensor) -> Tensor:
        """Same contract as `TransitionScorer.pair`, reading cached scores where they exist."""
        self.fill(scorer, table, prev_ids)
        row_ids = self.ids[prev_ids]                                    # [..., Kp, M]
        hit = row_ids[..., None, :] == cur_ids[..., None, :, None]       # [..., Kp, K, M]
        cached = (hit * self.scores[prev_ids][..., None, :]).sum(-1)     # [..., Kp, K]
        missed = ~hit.any(-1)
        if not missed.any():
            return cached
        return torch.where(missed, scorer.pair(table, prev_ids, cur_ids).float(), cached)


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

    `mode="argmax"`: independent argmax per slot. `mode="transition"`: lattice walk; at λ=0 it
    equals independent argmax for greedy rows. The K candidates of a slot come in descending logit
    order; on the Triton path (`dispatch.use_triton`) from `kernels.logits_topk`, which breaks an
    exact tie by the lower token id (torch.topk leaves that order open).
    """
    if mode == "argmax":
        return Selection(tokens=logits.argmax(-1))
    bs, n, _ = logits.shape
    triton = dispatch.use_triton(logits)
    if triton:  # one split-V launch, values already fp32 and sorted; exact ties to the lower index
        from dspine.kernels.logits_topk import logits_topk
        unary, cand = logits_topk(logits, top_k)                               # [bs, N, K]
    else:
        unary, cand = logits.topk(top_k, dim=-1)                               # [bs, N, K]
        unary = unary.float()  # after the top-k: no fp32 copy of [bs, N, V] (the cast is exact and monotone)
    prev = torch.cat([anchor_ids[:, None, None].expand(bs, 1, top_k), cand[:, :-1]], dim=1)
    pair_fn = successors.pair if successors is not None else _on_the_fly
    pair = pair_fn(scorer, table, prev, cand)                                   # [bs, N, K, K]
    uniforms = torch.rand(bs, n, generator=generator, device=logits.device)
    if triton:
        from dspine.kernels.transition_select import transition_path
        choice, q = transition_path(unary, pair, lam, temperature, uniforms)
    else:
        choice, q = transition_path_reference(unary, pair, lam, temperature, uniforms)
    tokens = cand.gather(-1, choice[..., None]).squeeze(-1)
    return Selection(tokens=tokens, cand_ids=cand, q=q, choice=choice)


def _on_the_fly(scorer: TransitionScorer, table: Tensor, prev: Tensor, cur: Tensor) -> Tensor:
    return scorer.pair(table, prev, cur).float()
