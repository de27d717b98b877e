"""The verify-budget planner and the reference engine's dynamic verifier.

Per round, verify only the prefix of each row's proposals that pays for itself. From the
calibrated per-position confidence (`dspine.dynamic.calibration`), each row's survival
S[b, j] = P(proposals 0..j all accepted) is a cumprod. Verifying B extra tokens in the whole batch
is expected to emit tau*(B) = n_req + (sum of the B largest S) tokens, and a step of n_req + B
tokens costs what the deployment's cost table says (`dspine.dynamic.cost_tables`). The planner
takes the B with the most expected tokens per second and hands the top-B survival entries out as
per-row prefixes. Verify lengths only cap acceptance, so any plan is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspine.dynamic.backoff import BackoffRule, DraftEstimate, DraftOrPlain
from dspine.dynamic.calibration import PositionCalibration, confidence_logits
from dspine.dynamic.cost_tables import CostTable, FlatCostTable
from dspine.engine.proposer import Proposal


@dataclass(frozen=True)
class VerifyPlan:
    """budget B: proposals verified in the whole batch; verify_lens [bs] int64 in 0..N, summing to
    B; expected_tokens tau*(B); step_seconds: the table's predicted time of that step."""

    budget: int
    verify_lens: Tensor
    expected_tokens: float
    step_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.step_seconds


VERIFY_LAYOUTS = ("ragged", "padded")


@dataclass(frozen=True)
class VerifyPlanner:
    """Choose the verify plan with the most expected tokens per second.

    `layout` is how the executor lays the verify tokens out, which decides what a plan costs:

    - "ragged" (SGLang's compact verify): a step costs its total verify tokens. Choose B
      maximising tau*(B) / step_seconds(n_req, B), i.e. tau*·SPS(n_req + B) with the diagonal
      table and tau*/T(n_req, n_req + B) with the additive one (SGLang's
      `compute_verify_token_budget`), then give out the B largest survival entries as per-row
      prefixes (`ScheduleVerifyLensTopk`: ties go to the earlier position, then the earlier row).
      Entries below `survival_eps` are never verified.
    - "padded" (one width for the whole batch: the reference engine's `[bs, 1 + w]` forward, a
      static verify graph): a step costs bs·(1 + w) tokens whatever each row would have taken, so
      the plan is one width w for every row, maximising (n_req + sum over rows of S[b, :w]) /
      step_seconds(n_req, bs·w); survival entries below `survival_eps` add nothing.

    Ties between plans go to the smallest budget.
    """

    table: CostTable = FlatCostTable()
    survival_eps: float = 1e-6
    layout: str = "ragged"

    def __post_init__(self) -> None:
        if self.layout not in VERIFY_LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: use 'ragged' (per-row verify lengths, SGLang's compact "
                             f"verify) or 'padded' (one width per batch, e.g. the reference engine)")

    def plan(self, survival: Tensor, num_requests: int | None = None) -> VerifyPlan:
        """survival [bs, N] in [0, 1], non-increasing along N (a cumprod of acceptance
        probabilities); num_requests: running requests in the step (default bs; rows beyond
        the survival ones count one token each and verify nothing extra)."""
        bs, n = survival.shape
        num_requests = bs if num_requests is None else num_requests
        if num_requests < bs:
            raise ValueError(f"num_requests={num_requests} is below the {bs} rows of survival estimates")
        s = survival.detach().double().cpu()
        if bool(((s < 0) | (s > 1) | s.isnan()).any()) or bool((s[:, 1:] > s[:, :-1]).any()):
            raise ValueError("survival must lie in [0, 1] and be non-increasing along positions: "
                             "pass the cumprod of per-position acceptance probabilities")
        if self.layout == "padded":
            return self._plan_padded(s, num_requests, survival.device)
        flat = s.T.reshape(-1)                          # position-major: index j*bs + b
        valid = flat >= self.survival_eps
        order = torch.argsort(torch.where(valid, -flat, torch.inf), stable=True)
        top = flat[order[: int(valid.sum())]]
        tau = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), top.cumsum(0)])   # tau*(B), [K+1]
        seconds = self.table.step_seconds(num_requests, torch.arange(len(tau)))
        budget = int(torch.argmax(tau / seconds))
        verify_lens = torch.bincount(order[:budget] % bs, minlength=bs)
        return VerifyPlan(budget=budget, verify_lens=verify_lens.to(survival.device),
                          expected_tokens=float(tau[budget]), step_seconds=float(seconds[budget]))

    def _plan_padded(self, s: Tensor, num_requests: int, device) -> VerifyPlan:
        """One width w in 0..N for every row: expected tokens n_req + sum_b sum_{j<w} S[b, j]."""
        bs, n = s.shape
        gain = torch.where(s >= self.survival_eps, s, torch.zeros_like(s)).sum(0)          # [N]
        tau = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), gain.cumsum(0)])   # [N+1]
        seconds = self.table.step_seconds(num_requests, bs * torch.arange(n + 1))
        width = int(torch.argmax(tau / seconds))
        return VerifyPlan(budget=bs * width, verify_lens=torch.full((bs,), width, dtype=torch.int64, device=device),
                          expected_tokens=float(tau[width]), step_seconds=float(seconds[width]))


class DynamicVerifier:
    """The reference engine's dynamic verification: a `verify_budget` (calibrated survival of every
    row -> the planner's verify lengths) and, given the cost of a plain decoding step, a
    `SpeculationSwitch` that stops drafting while drafting does not pay.

    Even a plan that verifies nothing pays for the draft, so under heavy load (or with a drafter
    too slow for its target) the best plan can be slower than plain decoding. With `plain_table`
    (step_seconds(n, 0) = T_plain(n), one plain step of n rows, one token each), every planned
    round is a `DraftEstimate` (its predicted time, tau* expected tokens) and the draft-or-plain
    rule (`dspine.dynamic.backoff`) decides the rounds after it: while the round loses against
    plain decoding, back off for k plain rounds and then probe; a winning plan drafts again at once.
    With `prior_survival` ([N], the mean survival per position observed when the calibration was
    fitted) the first round is decided the same way before any draft, so a batch that cannot win
    does not pay for a first probe.

    The engine reports each drafting round's wall time (`drafted`), which includes what the table
    cannot know: the drafter's catch-up over the plain steps before the round, and the table's
    own error on this machine. The rule takes the larger of predicted and measured time.

    Attributes after a run: `plans` planned rounds, `plain_rounds` rounds decoded plainly.
    """

    def __init__(self, planner: VerifyPlanner, calibration: PositionCalibration | None = None,
                 plain_table: CostTable | None = None, *, probe_share: float = 0.02, max_backoff: int = 1024,
                 prior_survival: Tensor | None = None):
        rule = BackoffRule(probe_share, max_backoff)
        if prior_survival is not None and (prior_survival.dim() != 1 or plain_table is None):
            raise ValueError("prior_survival must be [N] (mean survival per position) and needs a plain_table")
        self.planner, self.calibration, self.plain_table = planner, calibration, plain_table
        self.prior_survival = prior_survival
        self.state = DraftOrPlain(rule)
        self.plans = 0
        self._last: DraftEstimate | None = None   # the latest drafting round, measured once it ran

    @property
    def plain_rounds(self) -> int:
        return self.state.plains

    def __call__(self, prop: Proposal) -> Tensor:
        if prop.confidence is None:
            raise ValueError("dynamic verification needs the drafter's confidence head: use a drafter built "
                             "with confidence_head=True, or pass verify_budget=None to verify everything")
        probs = prop.confidence.double() if self.calibration is None else self.calibration.probabilities(
            confidence_logits(prop.confidence))
        plan = self.planner.plan(probs.cumprod(-1))
        self.plans += 1
        self._last = self.estimate(plan, prop.tokens.shape[0])
        return plan.verify_lens.to(prop.tokens.device)

    def estimate(self, plan: VerifyPlan, rows: int) -> DraftEstimate | None:
        """`plan` over `rows` rows as a drafting step against one-token plain steps; None without
        a plain_table (drafting always)."""
        if self.plain_table is None:
            return None
        t_plain = float(self.plain_table.step_seconds(rows, torch.zeros(1, dtype=torch.long))[0])
        return DraftEstimate(plan.step_seconds, plan.expected_tokens, rows, t_plain)

    def plain_rounds_after(self, plan: VerifyPlan, rows: int, seconds: float | None = None) -> int:
        """How many rounds to decode plainly after `plan` (0: keep drafting), with the round taking
        `seconds` (default: the table's prediction, `plan.step_seconds`)."""
        estimate = self.estimate(plan, rows)
        if estimate is None:
            return 0
        return self.state.rule.plain_steps(estimate if seconds is None else estimate.measured(seconds))

    def drafted(self, seconds: float) -> None:
        """The wall time of the drafting round just planned."""
        if self._last is not None:
            self._last = self._last.measured(seconds)

    def speculate(self, rows: int) -> bool:
        return self.state.decide(lambda: self._last if self._last is not None else self._prior(rows))

    def _prior(self, rows: int) -> DraftEstimate | None:
        """Before any draft: the round `prior_survival` predicts for `rows` rows (None without one)."""
        if self.prior_survival is None:
            return None
        return self.estimate(self.planner.plan(self.prior_survival.double().expand(rows, -1)), rows)


def make_verify_budget(planner: VerifyPlanner, calibration: PositionCalibration | None = None,
                       plain_table: CostTable | None = None, **switch) -> DynamicVerifier:
    """A `verify_budget` for `dspine.generate` (see `DynamicVerifier`, which takes `switch`'s
    probe_share / max_backoff / prior_survival; without `plain_table` every round drafts)."""
    return DynamicVerifier(planner, calibration, plain_table, **switch)
