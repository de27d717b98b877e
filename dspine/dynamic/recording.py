"""Recording the drafter's confidence and the acceptance it predicts, to fit a calibration."""

from __future__ import annotations

import torch
from torch import Tensor

from dspine.dynamic.calibration import PositionCalibration, confidence_logits, observed_survival
from dspine.engine.proposer import DSpineProposer, Proposal, Proposer
from dspine.model.drafter import DSpineDrafter


class ConfidenceRecorder:
    """A `Proposer` that wraps a drafter and records, for every verified row-round, the raw
    confidence logits [N] and the number of proposals accepted (from the committed `keep`).

    Use as `generate(target, ConfidenceRecorder(drafter), prompts)` with `verify_budget=None`:
    outcomes past a shortened verify length would be unknown. Then `recorder.fit()`.
    """

    def __init__(self, drafter: DSpineDrafter | Proposer):
        self.inner = DSpineProposer(drafter) if isinstance(drafter, DSpineDrafter) else drafter
        self.block_size, self.layer_ids = self.inner.block_size, self.inner.layer_ids
        self._pending: Tensor | None = None
        self._logits: list[Tensor] = []
        self._accept: list[Tensor] = []

    def start(self, tokens: Tensor, hidden: Tensor, lengths: Tensor) -> None:
        self.inner.start(tokens, hidden, lengths)

    def select(self, rows: Tensor) -> None:
        self.inner.select(rows)

    def propose(self, anchor_ids: Tensor, temperature: Tensor, generator: torch.Generator | None) -> Proposal:
        prop = self.inner.propose(anchor_ids, temperature, generator)
        if prop.confidence is None:
            raise ValueError("the drafter has no confidence head (confidence_head=False): nothing to record")
        self._pending = confidence_logits(prop.confidence).cpu()
        return prop

    def extend(self, tokens: Tensor, hidden: Tensor, keep: Tensor) -> None:
        if self._pending is not None:
            if tokens.shape[1] - 1 != self._pending.shape[1]:
                raise ValueError("record with verify_budget=None: a shortened verify round hides acceptance "
                                 "outcomes past its verify length")
            self._logits.append(self._pending)
            self._accept.append((keep - 1).cpu())
            self._pending = None
        self.inner.extend(tokens, hidden, keep)

    @property
    def logits(self) -> Tensor:
        """[rounds·rows, N] raw confidence logits, fp64."""
        return torch.cat(self._logits) if self._logits else torch.zeros(0, 0, dtype=torch.float64)

    @property
    def accept_len(self) -> Tensor:
        """[rounds·rows] proposals accepted, in 0..N."""
        return torch.cat(self._accept) if self._accept else torch.zeros(0, dtype=torch.long)

    @property
    def observed_survival(self) -> Tensor:
        """[N] fp64: the share of recorded rounds that accepted at least j+1 proposals (a
        `DynamicVerifier`'s `prior_survival`)."""
        return observed_survival(self.accept_len, self.logits.shape[1])

    def fit(self, **kwargs) -> PositionCalibration:
        """`PositionCalibration.fit` on everything recorded so far."""
        return PositionCalibration.fit(self.logits, self.accept_len, **kwargs)
