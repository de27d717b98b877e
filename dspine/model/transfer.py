"""The shared transfer space U = E_out·P and the per-layer gated adjacent injection.

U ([V, r]) is built from the target's frozen output embeddings (`lm_head.weight`, [V, H]) and a
learned projection P ([H, r]); it is the common language in which a block position states
"my token is ..." cheaply. While training, U is rebuilt on every call (P learns); in eval mode it
is cached until the weights change (`invalidate`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dspine.kernels import dispatch
from dspine.kernels.adjacent_injection import (
    adjacent_injection_reference,
    inject_on_candidates_reference,
)


class TransferSpace(nn.Module):
    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, rank, bias=False)  # P, stored as [r, H]
        self._cached: Tensor | None = None

    def table(self, output_embeddings: Tensor) -> Tensor:
        """output_embeddings: [V, H] (frozen) -> U [V, r]."""
        if self.training or torch.is_grad_enabled():
            self._cached = None
            return self.proj(output_embeddings.to(self.proj.weight.dtype))
        if self._cached is None or self._cached.device != output_embeddings.device:
            self._cached = self.proj(output_embeddings.to(self.proj.weight.dtype))
        return self._cached

    def invalidate(self) -> None:
        self._cached = None


class AdjacentInjection(nn.Module):
    """One layer's injection: scores -> top-k -> softmax -> gather U -> weighted sum -> gate -> add."""

    def __init__(self, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.score_proj = nn.Linear(hidden_size, rank, bias=False)   # W_s
        self.gate = nn.Linear(hidden_size + rank, hidden_size)        # G
        self.out_proj = nn.Linear(rank, hidden_size, bias=False)      # W_o

    def forward(self, h: Tensor, table: Tensor, anchor_ids: Tensor, need_scores: bool) -> tuple[Tensor, Tensor | None]:
        """h: [n, B, H] (n blocks); table: [V, r]; anchor_ids: [n].

        Returns (h with injection [n, B, H], transfer-space scores [n, B, V] or None). Scores
        are needed by layer-wise supervision; without them the fused kernel may run.
        """
        if self._fused(h, table, need_scores):
            from dspine.kernels.adjacent_injection import adjacent_injection
            return adjacent_injection(h, self.score_proj.weight, table, anchor_ids, self.gate.weight,
                                      self.gate.bias, self.out_proj.weight, self.top_k), None
        if need_scores:
            return adjacent_injection_reference(h, self.score_proj.weight, table, anchor_ids, self.gate.weight,
                                                self.gate.bias, self.out_proj.weight, self.top_k)
        return self._on_own_top_k(h, table, anchor_ids)[0], None

    def _fused(self, h: Tensor, table: Tensor, need_scores: bool) -> bool:
        """Whether the fused kernels run: they return no scores and have no backward, so only where
        `dispatch.use_triton` picks them and autograd records nothing (inference runs under no_grad;
        a training step takes the PyTorch path, whose no-grad vocabulary scan may still be fused)."""
        if need_scores or not dispatch.use_triton(h):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in (h, table, *self.parameters())))

    def _on_own_top_k(self, h: Tensor, table: Tensor, anchor_ids: Tensor) -> tuple[Tensor, Tensor]:
        """`adjacent_injection_reference` without its scores, in PyTorch: the top-k ids [n, B-1, k] of
        positions 0..B-2 from a vocabulary scan without autograd (`scan_top_k`), then the injection
        on them (`inject_on_candidates_reference`: their k scores recomputed in fp32). The same
        function and gradient (a top-k's gradient reaches only the k scores it kept), without the
        [n, B, V] scores in the autograd graph or their dense gradient: what training runs.
        Returns (h_out, ids)."""
        found = self.scan_top_k(h, table, anchor_ids)
        out = inject_on_candidates_reference(h, self.score_proj.weight, table, anchor_ids, found, self.gate.weight,
                                             self.gate.bias, self.out_proj.weight)
        return out, found

    @torch.no_grad()
    def scan_top_k(self, h: Tensor, table: Tensor, anchor_ids: Tensor) -> Tensor:
        """The top-k ids [n, B-1, k] of each position 0..B-2's transfer-space scores (h W_sᵀ) Uᵀ over
        the whole vocabulary, no autograd. Row 0 (the anchor's) is not read by the injection. On CUDA
        the split-V Triton scan (`transfer_features`) finds them without writing the [n, B-1, V]
        scores (for a training batch of 8,192 blocks over SmolLM2's vocabulary, 12 GB in bf16); its
        ids come in no particular order. Under autocast its inputs take the autocast dtype, as the
        PyTorch scan's GEMMs do."""
        if not dispatch.use_triton(h, casts_inputs=True):
            return ((h[:, :-1] @ self.score_proj.weight.T) @ table.T).topk(self.top_k, dim=-1).indices
        from dspine.kernels.adjacent_injection import transfer_features

        on = h.device.type
        dtype = torch.get_autocast_dtype(on) if torch.is_autocast_enabled(on) else h.dtype
        n, blocks = h.shape[:2]
        found = torch.empty(n, blocks - 1, self.top_k, dtype=torch.int64, device=h.device)
        transfer_features(h.to(dtype), self.score_proj.weight.to(dtype), table.to(dtype).contiguous(), anchor_ids,
                          self.top_k, candidates_out=found)
        return found

    def forward_with_candidates(self, h: Tensor, table: Tensor, anchor_ids: Tensor, need_scores: bool,
                                candidates: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
        """`injection_candidates = "first_layer"`. Layer 1 (`candidates=None`) scans the vocabulary as
        `forward` does and also returns its top-k ids [n, B-1, k] (position 0: the anchor's, unused);
        later layers re-weight those candidates with their own scores (`transfer_features_on_candidates`)
        instead of scanning again, fused with the gate in two launches (`inject_on_candidates`).
        Returns (h_out [n, B, H], scores [n, B, V] or None, candidates)."""
        fused = self._fused(h, table, need_scores)
        if candidates is None:
            if fused:
                from dspine.kernels.adjacent_injection import adjacent_injection

                n, blocks = h.shape[:2]
                found = torch.empty(n, blocks - 1, self.top_k, dtype=torch.int64, device=h.device)
                out = adjacent_injection(h, self.score_proj.weight, table, anchor_ids, self.gate.weight,
                                         self.gate.bias, self.out_proj.weight, self.top_k, candidates_out=found)
                return out, None, found
            if need_scores:
                out, scores = adjacent_injection_reference(h, self.score_proj.weight, table, anchor_ids,
                                                           self.gate.weight, self.gate.bias, self.out_proj.weight,
                                                           self.top_k)
                return out, scores, scores[:, :-1].topk(self.top_k, dim=-1).indices
            out, found = self._on_own_top_k(h, table, anchor_ids)
            return out, None, found
        args = (h, self.score_proj.weight, table, anchor_ids, candidates, self.gate.weight, self.gate.bias,
                self.out_proj.weight)
        if fused:
            from dspine.kernels.adjacent_injection import inject_on_candidates

            out = inject_on_candidates(*args)
        else:
            out = inject_on_candidates_reference(*args)
        scores = (h @ self.score_proj.weight.T) @ table.T if need_scores else None
        return out, scores, candidates

