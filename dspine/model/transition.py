"""Transition scores between neighbouring draft candidates, and their cache.

Transition score between neighbouring candidates a -> b: T(a, b) = (U[a] W_T) · U[b], in the
shared transfer space U ([V, r]). The `SuccessorTable` caches, per token, its top-M successors and
their exact scores ([V, M]); rows are filled lazily the first time a token appears as a
predecessor, or all at once (`fill_all`) at load time on a GPU. Pair scores are read from the table
where the successor is cached and computed on the fly otherwise: both give the same number.

The selection that walks these scores over each slot's top-K candidates is `dspine.model.selection`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dspine.kernels.adjacent_injection import table_rows


class TransitionScorer(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rank, rank))  # W_T; zero init = no transition bias

    def left(self, table: Tensor, ids: Tensor) -> Tensor:
        """U[ids] W_T: [..., r]."""
        return table_rows(table, ids).to(self.weight.dtype) @ self.weight

    def full_row(self, table: Tensor, prev_ids: Tensor) -> Tensor:
        """T(prev, ·) over the whole vocabulary: prev_ids [...] -> [..., V]."""
        return self.left(table, prev_ids) @ table.to(self.weight.dtype).T

    def pair(self, table: Tensor, prev_ids: Tensor, cur_ids: Tensor) -> Tensor:
        """prev_ids [..., Kp], cur_ids [..., K] -> T [..., Kp, K] computed on the fly."""
        return self.left(table, prev_ids) @ table_rows(table, cur_ids).to(self.weight.dtype).transpose(-1, -2)


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
