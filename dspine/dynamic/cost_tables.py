"""Step-cost tables: the predicted seconds of a decode step from its batch and verify tokens.

`SpsCostTable` (diagonal steps-per-second lookup) and `SpsAdditiveCostTable` (bias + alpha(bs) +
theta(M)) are SGLang's DSpark SPS formats (`dspark_sps.py`), read and written here without
importing SGLang; `FlatCostTable` (every step costs the same) is the absence of a table.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from dspine.dynamic.json_fields import check_probes, in_file, need, read_fields


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
        check_probes(what, "sample_batch_tokens", self.sample_batch_tokens, "sample_steps_per_sec",
                      self.sample_steps_per_sec)
        need(all(0 < s < math.inf for s in self.sample_steps_per_sec), what, "sample_steps_per_sec",
              self.sample_steps_per_sec, "must all be finite and > 0 (measured steps per second)")
        need(self.max_batch_tokens >= self.sample_batch_tokens[-1], what, "max_batch_tokens", self.max_batch_tokens,
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
        check_probes(what, "bs_probes", self.bs_probes, "alpha_seconds", self.alpha_seconds)
        check_probes(what, "m_probes", self.m_probes, "theta_seconds", self.theta_seconds)
        need(0 < self.bias_seconds < math.inf, what, "bias_seconds", self.bias_seconds, "must be finite and > 0")

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
        return SpsAdditiveCostTable(**read_fields(data, _ADDITIVE_SPEC, "SPS additive table"))
    return SpsCostTable(**read_fields(data, _SPS_SPEC, "SPS table"))


def sps_table_to_json(table: SpsCostTable | SpsAdditiveCostTable) -> str:
    return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(table).items()})


def load_sps_table(path: str | Path) -> SpsCostTable | SpsAdditiveCostTable:
    """Read an SPS table file in either SGLang format (what its DSpark planner reads; DSPINE reads
    tables through a switch file, `dspine.dynamic.switch`)."""
    return in_file(path, sps_table_from_json)
