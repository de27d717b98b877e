"""Ragged per-row slot bookkeeping shared by the target KV cache and the draft context cache.

Rows of a batch keep different numbers of tokens; both caches store them right-padded in a
[bs, S] slot layout with a validity mask. After a round, rejected slots become holes;
`compact_order` gathers each row's valid slots to the front, order preserved.
"""

from __future__ import annotations

import torch
from torch import Tensor


def compact_order(valid: Tensor) -> tuple[Tensor, Tensor]:
    """valid: [bs, S] bool -> (index [bs, S'] of the slots to keep, front first, new_valid [bs, S']).

    S' = max valid count; rows with fewer valid slots are padded with index 0 and False.
    """
    counts = valid.sum(1)
    width = int(counts.max().item()) if valid.numel() else 0
    key = (~valid).to(torch.int8)  # valid slots sort first; stable keeps their order
    order = torch.sort(key, dim=1, stable=True).indices[:, :width]
    new_valid = torch.arange(width, device=valid.device)[None] < counts[:, None]
    return torch.where(new_valid, order, torch.zeros_like(order)), new_valid


def gather_slots(x: Tensor, index: Tensor, dim: int) -> Tensor:
    """Gather x along its slot dimension `dim` with index [bs, S'] (batch is dim 0)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape
    idx = index.view(shape).expand(*[s if i != dim else index.shape[1] for i, s in enumerate(x.shape)])
    return x.gather(dim, idx)
