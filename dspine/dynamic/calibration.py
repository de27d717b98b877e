"""Per-position calibration of the drafter's confidence head: p_j = sigmoid(logit_j / T_j + b_j).

From the calibrated probabilities, a row's survival S[b, j] = P(proposals 0..j all accepted) is
their cumprod over positions. The JSON is SGLang's DSpark STS format (`dspark_sts.py`), read and
written without importing SGLang; an affine calibration adds one field, `biases`, that SGLang's
reader ignores (give SGLang's planner temperature-only files).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from dspine.dynamic.json_fields import in_file, need, read_fields
from dspine.utils.atomic import write_text_atomic

_LOGIT_EPS = 1e-12     # confidence in [eps, 1 - eps] before inverting the sigmoid


def confidence_logits(confidence: Tensor) -> Tensor:
    """Invert `Proposal.confidence` (sigmoid of the head) back to raw logits, fp64, saturated
    probabilities clamped to +-27.6."""
    return torch.logit(confidence.double(), eps=_LOGIT_EPS)


def observed_survival(accept_len: Tensor, num_positions: int) -> Tensor:
    """[num_positions] fp64: the share of rounds (accept_len [rounds], proposals accepted) that
    accepted at least j+1 proposals."""
    return (accept_len[:, None] > torch.arange(num_positions)).double().mean(0)


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
        need(len(self.temperatures) > 0, what, "temperatures", self.temperatures, "needs one temperature per position")
        need(all(0 < t < math.inf for t in self.temperatures), what, "temperatures", self.temperatures,
              "must all be finite and > 0 (1.0 leaves a position unchanged)")
        for name in ("ece_before", "ece_after", "biases"):
            value = getattr(self, name)
            need(len(value) in (0, len(self.temperatures)), what, name, value,
                  f"must be empty or hold one value per temperature ({len(self.temperatures)})")
        need(all(math.isfinite(b) for b in self.biases), what, "biases", self.biases, "must all be finite")

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
        return cls(**read_fields(json.loads(text), spec, "STS calibration"))

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "PositionCalibration":
        return in_file(path, cls.from_json)


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
