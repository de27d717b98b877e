"""Dynamic verification: per round, verify only the prefix of each row's proposals that pays for itself.

From the drafter's per-position confidence (calibrated per position: temperature scaling, or
temperature plus bias), each
row's survival S[b, j] = P(proposals 0..j all accepted) is a cumprod. Verifying B extra tokens in
the whole batch is expected to emit tau*(B) = n_req + (sum of the B largest S) tokens, and a step
of n_req + B tokens costs what the deployment's steps-per-second (SPS) table says. The planner
takes the B with the most expected tokens per second and hands the top-B survival entries out as
per-row prefixes. Verify lengths only cap acceptance, so any plan is lossless.

The calibration JSON and both SPS table JSONs are SGLang's DSpark formats (`dspark_sts.py`,
`dspark_sps.py`), read and written here without importing SGLang. An affine calibration adds one
field, `biases`, that SGLang's STS reader ignores: give SGLang's planner temperature-only files.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from dspine.model.drafter import DSpineDrafter
from dspine.engine.proposer import DSpineProposer, Proposal, Proposer

_LOGIT_EPS = 1e-12     # confidence in [eps, 1 - eps] before inverting the sigmoid


# ------------------------------------------------------------------------------------ JSON fields
def _read_fields(data, spec: dict[str, tuple[type, bool, bool]], what: str) -> dict:
    """Check a decoded JSON object against spec {field: (element type, is_list, required)}.
    Raises ValueError naming the offending field; unknown fields are errors too."""
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object with fields {sorted(spec)}, got {type(data).__name__}")
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; the format has {sorted(spec)}")
    out = {}
    for name, (typ, is_list, required) in spec.items():
        if name not in data:
            if required:
                raise ValueError(f"{what}: missing field `{name}` (the format has {sorted(spec)})")
            continue
        value = data[name]
        items = value if is_list and isinstance(value, list) else [value]
        kind = {int: "integer", float: "number", str: "string"}[typ]
        ok_types = (int, float) if typ is float else (typ,)
        if (is_list and not isinstance(value, list)) or any(
                isinstance(v, bool) or not isinstance(v, ok_types) for v in items):
            raise ValueError(f"{what}: field `{name}` must be {'a list of ' + kind + 's' if is_list else 'a ' + kind}, "
                             f"got {value!r}")
        out[name] = tuple(typ(v) for v in value) if is_list else typ(value)
    return out


def _in_file(path: str | Path, parse):
    """parse(text of `path`), with the path added to any format error."""
    try:
        return parse(Path(path).read_text(encoding="utf-8"))
    except ValueError as err:                    # json.JSONDecodeError included
        raise ValueError(f"{err} (file {path})") from None


def _need(ok: bool, what: str, name: str, value, fix: str) -> None:
    if not ok:
        raise ValueError(f"{what}: field `{name}` = {value!r} {fix}")


def _check_probes(what: str, name: str, probes: tuple, values_name: str, values: tuple) -> None:
    _need(len(probes) > 0, what, name, probes, "must hold at least one probe")
    _need(all(a < b for a, b in zip(probes, probes[1:])), what, name, probes,
          "must be strictly increasing: sort the probes and take the median of repeated ones")
    _need(len(values) == len(probes), what, values_name, values, f"needs one value per entry of `{name}` "
          f"({len(probes)})")


# ------------------------------------------------------------------------------------ calibration
def expected_calibration_error(probs: Tensor, labels: Tensor, num_bins: int = 10) -> float:
    """ECE with `num_bins` equal-width bins on [0, 1] (as SGLang's `dspark_sts_fit`): the
    count-weighted mean over bins of |mean predicted probability - observed frequency|.
    probs, labels: same shape, labels in {0, 1}. NaN when empty."""
    probs, labels = probs.reshape(-1).double(), labels.reshape(-1).double()
    if probs.numel() == 0:
        return float("nan")
    bins = (probs * num_bins).long().clamp(0, num_bins - 1)
    count = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, torch.ones_like(probs))
    gap = (torch.zeros_like(count).index_add_(0, bins, probs) - torch.zeros_like(count).index_add_(0, bins, labels))
    return float(gap.abs().sum() / probs.numel())


def _check_outcomes(logits: Tensor, accept_len: Tensor) -> None:
    if logits.dim() != 2 or accept_len.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [n, N] and accept_len [n], got {tuple(logits.shape)} and "
                         f"{tuple(accept_len.shape)}")
    if logits.shape[0] == 0:
        raise ValueError("no recorded rounds: run generate(...) with a ConfidenceRecorder first")
    if bool((accept_len < 0).any()) or bool((accept_len > logits.shape[1]).any()):
        raise ValueError(f"accept_len must lie in 0..N={logits.shape[1]}")


@dataclass(frozen=True)
class PositionCalibration:
    """Per-position scaling of the confidence logits: p_j = sigmoid(logit_j / T_j + b_j).

    Temperature scaling (`biases` empty, every b_j = 0) keeps a head's base rate: where the head
    ranks rounds well but is biased, only the affine form (`fit(affine=True)`) moves the mean.

    JSON: SGLang's `DSparkStsCalibration` (`--speculative-dspark-confidence-sts-path`) with the same
    meaning of every field: `temperatures` [N] (> 0), `dataset`, `num_samples`, and `ece_before` /
    `ece_after` [N], the survival ECE per position (`calibration_error`) before / after fitting;
    plus `biases` [N], written only when fitted (SGLang would ignore it).
    """

    temperatures: tuple[float, ...]
    dataset: str = ""
    num_samples: int = 0
    ece_before: tuple[float, ...] = ()
    ece_after: tuple[float, ...] = ()
    biases: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        what = "STS calibration"
        _need(len(self.temperatures) > 0, what, "temperatures", self.temperatures, "needs one temperature per position")
        _need(all(0 < t < math.inf for t in self.temperatures), what, "temperatures", self.temperatures,
              "must all be finite and > 0 (1.0 leaves a position unchanged)")
        for name in ("ece_before", "ece_after", "biases"):
            value = getattr(self, name)
            _need(len(value) in (0, len(self.temperatures)), what, name, value,
                  f"must be empty or hold one value per temperature ({len(self.temperatures)})")
        _need(all(math.isfinite(b) for b in self.biases), what, "biases", self.biases, "must all be finite")

    @classmethod
    def identity(cls, num_positions: int) -> "PositionCalibration":
        return cls(temperatures=(1.0,) * num_positions)

    def probabilities(self, logits: Tensor) -> Tensor:
        """Raw confidence logits [..., N] -> calibrated acceptance probabilities [..., N] (fp64)."""
        if logits.shape[-1] != len(self.temperatures):
            raise ValueError(f"calibration has {len(self.temperatures)} temperatures but the drafter proposes "
                             f"N={logits.shape[-1]} tokens: fit it for this drafter's block_size - 1")
        temps = torch.tensor(self.temperatures, dtype=torch.float64, device=logits.device)
        biases = torch.tensor(self.biases or (0.0,) * len(self.temperatures), dtype=torch.float64, device=logits.device)
        return torch.sigmoid(logits.double() / temps + biases)

    def calibration_error(self, logits: Tensor, accept_len: Tensor, num_bins: int = 10) -> tuple[list[float], float]:
        """Survival ECE: per position j, cumprod_{i<=j} p_i against 1[accept_len > j] over all n rows;
        then the same pooled over every (row, position). logits [n, N]; accept_len [n] in 0..N.
        Returns (per-position ECE [N], overall ECE)."""
        _check_outcomes(logits, accept_len)
        survival = self.probabilities(logits).cumprod(-1)
        reached = accept_len[:, None] > torch.arange(logits.shape[1], device=logits.device)
        per_position = [expected_calibration_error(survival[:, j], reached[:, j], num_bins)
                        for j in range(logits.shape[1])]
        return per_position, expected_calibration_error(survival, reached, num_bins)

    def survival_gaps(self, logits: Tensor, accept_len: Tensor) -> list[dict]:
        """Per position j (1-based `position`): `rounds` n, `predicted` P(accept_len >= j) (the
        mean calibrated survival), `observed` rate, and their gap in points (`gap_points`, + means
        over-predicted). logits [n, N]; accept_len [n] in 0..N."""
        _check_outcomes(logits, accept_len)
        survival = self.probabilities(logits).cumprod(-1)
        rows = []
        for j in range(logits.shape[1]):
            predicted, observed = float(survival[:, j].mean()), float((accept_len > j).double().mean())
            rows.append({"position": j + 1, "rounds": int(logits.shape[0]), "predicted": predicted,
                         "observed": observed, "gap_points": 100 * (predicted - observed)})
        return rows

    @classmethod
    def fit(cls, logits: Tensor, accept_len: Tensor, *, bounds: tuple[float, float] = (0.05, 20.0),
            num_bins: int = 10, dataset: str = "", affine: bool = False) -> "PositionCalibration":
        """Fit T_j (and, with `affine`, b_j) per position from verify-all rounds.

        logits [n, N]: raw confidence logits; accept_len [n] in 0..N: proposals accepted in that
        round. Position j's samples are the rows that reached it (accept_len >= j), labelled
        accepted iff accept_len > j: the head predicts acceptance given the prefix was accepted.
        T_j minimises their binary NLL within `bounds`. The NLL is convex in s = 1/T, so a
        bisection on its derivative (vectorised over positions, in log s) finds the minimum.
        A position no row reached keeps T = 1. `affine`: (1/T_j, b_j) minimise the same NLL, a
        two-parameter logistic regression solved by Newton's method (`_fit_affine`).
        """
        _check_outcomes(logits, accept_len)
        if not 0 < bounds[0] < bounds[1] < math.inf:
            raise ValueError(f"bounds={bounds} must be (lowest, highest) temperature with 0 < lowest < highest")
        z = logits.detach().double().cpu()
        n, num_pos = z.shape
        pos = torch.arange(num_pos)
        acc = accept_len.detach().cpu()[:, None]
        mask, label = (acc >= pos).double(), (acc > pos).double()                       # [n, N]
        lo = torch.full((num_pos,), -math.log(bounds[1]), dtype=torch.float64)       # log s, s = 1/T
        hi = torch.full((num_pos,), -math.log(bounds[0]), dtype=torch.float64)
        for _ in range(60):
            mid = (lo + hi) / 2
            x = z * mid.exp()
            residual = torch.where(label > 0, -torch.sigmoid(-x), torch.sigmoid(x))   # sigmoid(x) - label, exact
            grad = (mask * residual * z).sum(0)                                       # d NLL / d s, [N]
            lo, hi = torch.where(grad < 0, mid, lo), torch.where(grad < 0, hi, mid)
        temps = torch.where(mask.sum(0) > 0, (-(lo + hi) / 2).exp(), torch.ones(num_pos, dtype=torch.float64))
        fitted = cls(temperatures=tuple(temps.tolist()))
        if affine:
            fitted = _fit_affine(z, mask, label, 1 / temps, bounds)
        return cls(temperatures=fitted.temperatures, biases=fitted.biases, dataset=dataset, num_samples=n,
                   ece_before=tuple(cls.identity(num_pos).calibration_error(z, acc[:, 0], num_bins)[0]),
                   ece_after=tuple(fitted.calibration_error(z, acc[:, 0], num_bins)[0]))

    def to_json(self) -> str:
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if not self.biases:
            del fields["biases"]  # a temperature-only file is exactly SGLang's
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> "PositionCalibration":
        spec = {"temperatures": (float, True, True), "dataset": (str, False, False),
                "num_samples": (int, False, False), "ece_before": (float, True, False),
                "ece_after": (float, True, False), "biases": (float, True, False)}
        return cls(**_read_fields(json.loads(text), spec, "STS calibration"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "PositionCalibration":
        return _in_file(path, cls.from_json)


def _fit_affine(z: Tensor, mask: Tensor, label: Tensor, scale0: Tensor, bounds: tuple[float, float],
                iterations: int = 50) -> PositionCalibration:
    """Per position j, (s_j, b_j) minimising the masked binary NLL of sigmoid(s_j·z + b_j) against
    `label`, by Newton's method from (scale0_j, 0), vectorised over positions; s_j is then clamped
    to 1/bounds and b_j refitted alone at the clamped s_j. z, mask, label: [n, N] fp64; scale0 [N].
    A position no row reached keeps (1, 0)."""
    s, b = scale0.clone(), torch.zeros_like(scale0)
    count = mask.sum(0)
    ridge = 1e-9 * count.clamp(min=1)                                  # keeps separable data finite

    def moments(s: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        p = torch.sigmoid(z * s + b)
        r, w = mask * (p - label), mask * p * (1 - p)
        return (r * z).sum(0), r.sum(0), (w * z * z).sum(0) + ridge, (w * z).sum(0), w.sum(0) + ridge

    for _ in range(iterations):
        g_s, g_b, h_ss, h_sb, h_bb = moments(s, b)
        det = h_ss * h_bb - h_sb * h_sb
        joint = det > 1e-12 * h_ss * h_bb                               # else z is (nearly) constant: b alone
        s = s - torch.where(joint, (h_bb * g_s - h_sb * g_b) / det, torch.zeros_like(s))
        b = b - torch.where(joint, (h_ss * g_b - h_sb * g_s) / det, g_b / h_bb)
    s = torch.where(s.isfinite(), s, scale0).clamp(1 / bounds[1], 1 / bounds[0])
    b = torch.where(b.isfinite(), b, torch.zeros_like(b))
    for _ in range(iterations):
        _, g_b, _, _, h_bb = moments(s, b)
        b = b - g_b / h_bb
    reached = count > 0
    s = torch.where(reached, s, torch.ones_like(s))
    b = torch.where(reached & b.isfinite(), b, torch.zeros_like(b))
    return PositionCalibration(temperatures=tuple((1 / s).tolist()), biases=tuple(b.tolist()))


# ------------------------------------------------------------------------------------ cost tables
class CostTable(Protocol):
    def step_seconds(self, num_requests: int, budgets: Tensor) -> Tensor:
        """budgets [K] int64 extra verify tokens -> predicted seconds per step [K] fp64 for a step
        verifying num_requests + budgets tokens (one anchor per request, plus the budget)."""


@dataclass(frozen=True)
class FlatCostTable:
    """No table: every step costs the same, so the planner verifies every proposal."""

    def step_seconds(self, num_requests: int, budgets: Tensor) -> Tensor:
        return torch.ones(budgets.shape, dtype=torch.float64)


@dataclass(frozen=True)
class SpsCostTable:
    """SGLang's diagonal table: steps per second at `sample_batch_tokens` (strictly increasing)
    verify tokens per step; a lookup takes the floor probe, clamped to the first and last.
    `max_batch_tokens` (>= the last probe) is SGLang's metadata and is not used by the lookup."""

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int

    def __post_init__(self) -> None:
        what = "SPS table"
        _check_probes(what, "sample_batch_tokens", self.sample_batch_tokens, "sample_steps_per_sec",
                      self.sample_steps_per_sec)
        _need(all(0 < s < math.inf for s in self.sample_steps_per_sec), what, "sample_steps_per_sec",
              self.sample_steps_per_sec, "must all be finite and > 0 (measured steps per second)")
        _need(self.max_batch_tokens >= self.sample_batch_tokens[-1], what, "max_batch_tokens", self.max_batch_tokens,
              f"must be >= the largest probe {self.sample_batch_tokens[-1]}")

    def steps_per_sec(self, batch_tokens: Tensor) -> Tensor:
        """batch_tokens [K] int64 -> steps per second [K] fp64 at the floor probe (clamped)."""
        probes = torch.tensor(self.sample_batch_tokens, dtype=torch.int64)
        idx = (torch.bucketize(batch_tokens.cpu(), probes, right=True) - 1).clamp(0, len(probes) - 1)
        return torch.tensor(self.sample_steps_per_sec, dtype=torch.float64)[idx]

    def step_seconds(self, num_requests: int, budgets: Tensor) -> Tensor:
        return 1.0 / self.steps_per_sec(num_requests + budgets)


def _interp_clamped(xs: tuple[int, ...], ys: tuple[float, ...], x: Tensor) -> Tensor:
    """Piecewise-linear y(x) through (xs, ys), constant beyond the ends. x [K] -> [K] fp64."""
    xt, yt = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    x = x.double().clamp(xt[0].item(), xt[-1].item())
    if len(xs) == 1:
        return yt[0].expand(x.shape).clone()
    hi = torch.bucketize(x, xt, right=True).clamp(1, len(xs) - 1)
    lo = hi - 1
    return yt[lo] + (x - xt[lo]) / (xt[hi] - xt[lo]) * (yt[hi] - yt[lo])


@dataclass(frozen=True)
class SpsAdditiveCostTable:
    """SGLang's additive table: T(bs, M) = bias_seconds + alpha(bs) + theta(M) seconds per step,
    bs = running requests, M = verify tokens; alpha and theta piecewise linear over their
    (strictly increasing) probes, clamped beyond the ends."""

    bias_seconds: float
    bs_probes: tuple[int, ...]
    alpha_seconds: tuple[float, ...]
    m_probes: tuple[int, ...]
    theta_seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        what = "SPS additive table"
        _check_probes(what, "bs_probes", self.bs_probes, "alpha_seconds", self.alpha_seconds)
        _check_probes(what, "m_probes", self.m_probes, "theta_seconds", self.theta_seconds)
        _need(0 < self.bias_seconds < math.inf, what, "bias_seconds", self.bias_seconds, "must be finite and > 0")

    def step_seconds(self, num_requests: int, budgets: Tensor) -> Tensor:
        alpha = _interp_clamped(self.bs_probes, self.alpha_seconds, torch.tensor([float(num_requests)]))
        return self.bias_seconds + alpha + _interp_clamped(self.m_probes, self.theta_seconds, num_requests + budgets)


_SPS_SPEC = {"sample_batch_tokens": (int, True, True), "sample_steps_per_sec": (float, True, True),
             "max_batch_tokens": (int, False, True)}
_ADDITIVE_SPEC = {"bias_seconds": (float, False, True), "bs_probes": (int, True, True),
                  "alpha_seconds": (float, True, True), "m_probes": (int, True, True),
                  "theta_seconds": (float, True, True)}


def sps_table_from_json(text: str) -> SpsCostTable | SpsAdditiveCostTable:
    """Either SGLang table format; the additive one iff the object has `bias_seconds` (as SGLang decides)."""
    data = json.loads(text)
    if isinstance(data, dict) and "bias_seconds" in data:
        return SpsAdditiveCostTable(**_read_fields(data, _ADDITIVE_SPEC, "SPS additive table"))
    return SpsCostTable(**_read_fields(data, _SPS_SPEC, "SPS table"))


def sps_table_to_json(table: SpsCostTable | SpsAdditiveCostTable) -> str:
    return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(table).items()})


def load_sps_table(path: str | Path) -> SpsCostTable | SpsAdditiveCostTable:
    """Read a `--speculative-dspark-sps-table-path` file (either format)."""
    return _in_file(path, sps_table_from_json)


# ------------------------------------------------------------------------------------ planner
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


def confidence_logits(confidence: Tensor) -> Tensor:
    """Invert `Proposal.confidence` (sigmoid of the head) back to raw logits, fp64, saturated
    probabilities clamped to +-27.6."""
    return torch.logit(confidence.double(), eps=_LOGIT_EPS)


def backoff_rounds(loss: float, t_plain: float, probe_share: float, max_backoff: int) -> int:
    """Plain rounds to decode after a drafting round predicted to lose `loss` seconds against plain
    decoding (steps of `t_plain` seconds): 0 when it does not lose, else
    ceil(loss / (probe_share x t_plain)) capped at `max_backoff`, so that losing probes cost about
    `probe_share` of the decoding time and a near-miss is retried sooner than a bad loss."""
    if loss <= 0:
        return 0
    return min(math.ceil(loss / (probe_share * t_plain)), max_backoff)


class DynamicVerifier:
    """The reference engine's dynamic verification: a `verify_budget` (calibrated survival of every
    row -> the planner's verify lengths) and, given the cost of a plain decoding step, a
    `SpeculationSwitch` that stops drafting while drafting does not pay.

    Even a plan that verifies nothing pays for the draft, so under heavy load (or with a drafter
    too slow for its target) the best plan can be slower than plain decoding. With `plain_table`
    (step_seconds(n, 0) = T_plain(n), one plain step of n rows), every planned round is compared
    with plain decoding: the round's predicted time minus the time plain decoding needs for the
    same expected tokens is its loss, loss = T_round - tau* x T_plain(n) / n. A round that loses
    is a probe, and the next k rounds decode plainly, k = ceil(loss / (probe_share x T_plain(n)))
    (at most `max_backoff`): probes then cost about `probe_share` of the decoding time, and a
    probe that nearly wins comes back sooner than one that loses badly. A winning plan drafts
    again at once. With `prior_survival` ([N], the mean survival per position observed when the
    calibration was fitted) the first round is decided the same way before any draft, so a batch
    that cannot win does not pay for a first probe. The switch only picks between two lossless
    steps, so outputs never change.

    The engine then reports the drafting round's wall time (`drafted`), which includes what the
    table cannot know: the drafter's catch-up over the plain steps before the round, and the table's
    own error on this machine. The loss recomputed with that time (same expected tokens) sets the
    backoff when it is the larger, so a round that lost more than predicted is probed less often.

    Attributes after a run: `plans` planned rounds, `plain_rounds` rounds decoded plainly.
    """

    def __init__(self, planner: VerifyPlanner, calibration: PositionCalibration | None = None,
                 plain_table: CostTable | None = None, *, probe_share: float = 0.02, max_backoff: int = 1024,
                 prior_survival: Tensor | None = None):
        if max_backoff < 1:
            raise ValueError(f"max_backoff={max_backoff}: must be >= 1 (plain rounds before a probe)")
        if not 0 < probe_share <= 1:
            raise ValueError(f"probe_share={probe_share}: must lie in (0, 1] (the share of decoding time probes "
                             "may cost)")
        if prior_survival is not None and (prior_survival.dim() != 1 or plain_table is None):
            raise ValueError("prior_survival must be [N] (mean survival per position) and needs a plain_table")
        self.planner, self.calibration, self.plain_table = planner, calibration, plain_table
        self.probe_share, self.max_backoff, self.prior_survival = probe_share, max_backoff, prior_survival
        self.skip, self.started = 0, False
        self.plans = self.plain_rounds = 0
        self._last: tuple[VerifyPlan, int] | None = None   # the latest drafting round's plan and rows

    def __call__(self, prop: Proposal) -> Tensor:
        if prop.confidence is None:
            raise ValueError("dynamic verification needs the drafter's confidence head: use a drafter built "
                             "with confidence_head=True, or pass verify_budget=None to verify everything")
        probs = prop.confidence.double() if self.calibration is None else self.calibration.probabilities(
            confidence_logits(prop.confidence))
        plan = self.planner.plan(probs.cumprod(-1))
        self.plans += 1
        self.skip = self.plain_rounds_after(plan, prop.tokens.shape[0])
        self._last = (plan, prop.tokens.shape[0])
        return plan.verify_lens.to(prop.tokens.device)

    def plain_rounds_after(self, plan: VerifyPlan, rows: int, seconds: float | None = None) -> int:
        """How many rounds to decode plainly after `plan` (0: keep drafting; see the class docstring),
        with the round taking `seconds` (default: the table's prediction, `plan.step_seconds`)."""
        if self.plain_table is None:
            return 0
        t_plain = float(self.plain_table.step_seconds(rows, torch.zeros(1, dtype=torch.long))[0])
        loss = (plan.step_seconds if seconds is None else seconds) - plan.expected_tokens * t_plain / rows
        return backoff_rounds(loss, t_plain, self.probe_share, self.max_backoff)

    def drafted(self, seconds: float) -> None:
        """The wall time of the drafting round just planned: back off by its measured loss when that
        is the larger (see the class docstring)."""
        if self._last is not None:
            self.skip = max(self.skip, self.plain_rounds_after(*self._last, seconds=seconds))
            self._last = None

    def speculate(self, rows: int) -> bool:
        if not self.started:
            self.started = True
            if self.prior_survival is not None:
                self.skip = self.plain_rounds_after(self.planner.plan(self.prior_survival.double().expand(rows, -1)),
                                                    rows)
        if self.skip > 0:
            self.skip -= 1
            self.plain_rounds += 1
            return False
        return True


def make_verify_budget(planner: VerifyPlanner, calibration: PositionCalibration | None = None,
                       plain_table: CostTable | None = None, **switch) -> DynamicVerifier:
    """A `verify_budget` for `dspine.generate` (see `DynamicVerifier`, which takes `switch`'s
    probe_share / max_backoff / prior_survival; without `plain_table` every round drafts)."""
    return DynamicVerifier(planner, calibration, plain_table, **switch)


# ------------------------------------------------------------------------------------ recording
def observed_survival(accept_len: Tensor, num_positions: int) -> Tensor:
    """[num_positions] fp64: the share of rounds (accept_len [rounds], proposals accepted) that
    accepted at least j+1 proposals."""
    return (accept_len[:, None] > torch.arange(num_positions)).double().mean(0)


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
