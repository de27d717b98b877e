"""The draft-or-plain rule: before each decode step, draft a block or take a plain step.

Both executors are exact, so the rule only picks the faster of two lossless steps. A drafting step
over n rows is predicted to take `seconds` and emit `tokens` (n anchors plus the expected accepted
proposals); a plain step emits n·K tokens (K = `plain_tokens` per row) in `plain_seconds`. The
drafting step's loss against plain decoding is

    loss = seconds - tokens · plain_seconds / (n · K)

While a drafting step loses, decode plainly for k = ceil(loss / (probe_share · plain_seconds))
steps (at most `max_backoff`), then draft once without asking (a probe, which refreshes the
estimate); while it wins, draft. Probes then cost about `probe_share` of the decoding time, and a
near-miss is retried sooner than a bad loss. Where the caller measures a drafting step's wall time
(`DraftEstimate.measured`), the larger of predicted and measured seconds sets the loss, so a step
that lost more than its table predicted is probed less often.

One `DraftOrPlain` holds the state for one decoder: the reference engine's `DynamicVerifier`
(`dspine.dynamic.planner`, K = 1) and the SGLang worker's `ServingSwitch` (`dspine.dynamic.switch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable


@dataclass(frozen=True)
class DraftEstimate:
    """A drafting step over `rows` rows: `seconds` (predicted, or measured when larger), expected
    `tokens` emitted (>= rows), and `plain_seconds` of one plain step of `plain_tokens` per row."""

    seconds: float
    tokens: float
    rows: int
    plain_seconds: float
    plain_tokens: int = 1

    @property
    def loss(self) -> float:
        """Seconds the drafting step loses against plain decoding of the same tokens (<= 0: it pays)."""
        return self.seconds - self.tokens * self.plain_seconds / (self.rows * self.plain_tokens)

    def measured(self, seconds: float) -> "DraftEstimate":
        """The same step after it ran in `seconds` of wall time: the larger time counts."""
        return replace(self, seconds=max(self.seconds, seconds))


@dataclass(frozen=True)
class BackoffRule:
    """probe_share in (0, 1]: the share of decoding time losing probes may cost; max_backoff >= 1:
    the most plain steps before a probe."""

    probe_share: float = 0.02
    max_backoff: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.max_backoff, bool) or not isinstance(self.max_backoff, int) or self.max_backoff < 1:
            raise ValueError(f"max_backoff={self.max_backoff!r}: must be an integer >= 1 (plain rounds before a probe)")
        if isinstance(self.probe_share, bool) or not isinstance(self.probe_share, (int, float)) \
                or not 0 < self.probe_share <= 1:
            raise ValueError(f"probe_share={self.probe_share!r}: must lie in (0, 1] (the share of decoding time "
                             "probes may cost)")

    def plain_steps(self, estimate: DraftEstimate) -> int:
        """Plain steps to take instead of `estimate`'s drafting step: 0 when it does not lose, else
        ceil(loss / (probe_share · plain_seconds)) capped at max_backoff."""
        loss = estimate.loss
        if loss <= 0:
            return 0
        return min(math.ceil(loss / (self.probe_share * estimate.plain_seconds)), self.max_backoff)


class DraftOrPlain:
    """The rule's state for one decoder. `decide(estimate)` before each step -> True to draft,
    False for a plain step; `estimate()` is called only when the rule needs it (not during a
    backoff nor for a probe) and may return None (nothing known yet: draft).

    State: `skip` plain steps still owed, `probe_due` (the step after a backoff drafts).
    Counters: `drafts`, `plains`."""

    def __init__(self, rule: BackoffRule):
        self.rule = rule
        self.skip, self.probe_due = 0, False
        self.drafts = self.plains = 0

    def decide(self, estimate: Callable[[], DraftEstimate | None]) -> bool:
        if self.skip > 0:
            self.skip -= 1
            self.plains += 1
            return False
        if not self.probe_due:
            step = estimate()
            k = 0 if step is None else self.rule.plain_steps(step)
            if k > 0:
                self.skip, self.probe_due = k - 1, True
                self.plains += 1
                return False
        self.probe_due = False
        self.drafts += 1
        return True
