"""`dspine tune-sps`'s fits: SGLang's SPS tables from measured step rates, and the per-position
calibration and prior survival from recorded acceptance.

Rounds are `rounds.jsonl` rows `{batch_size_per_rank, batch_tokens, steps_per_sec, frac, ...}`;
acceptance records are `acceptance.jsonl` rows whose `dspine_confidence_logits [steps][N]` and
`dspine_accept_lens [steps]` come from a DSPINE server's `/generate` meta_info.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from dspine.dynamic.calibration import PositionCalibration
from dspine.dynamic.calibration import observed_survival as survival
from dspine.dynamic.cost_tables import SpsAdditiveCostTable, SpsCostTable

M_BIN = 64          # additive fit: verify-token cells binned by 64, as SGLang's profiler


class TuningError(RuntimeError):
    """The sweep cannot go on; the message says what failed and what to do."""


def fit_diagonal(rounds: list[dict], max_batch_tokens: int | None = None):
    """SpsCostTable from the frac-1 rows: the median steps/s per batch_tokens (as SGLang's `fit`)."""
    cells: dict[int, list[float]] = {}
    for row in rounds:
        if row.get("frac", 1.0) >= 1.0:
            cells.setdefault(int(row["batch_tokens"]), []).append(float(row["steps_per_sec"]))
    if not cells:
        raise TuningError("no diagonal (frac = 1) rows to fit: every level failed; check the server log")
    probes = sorted(cells)
    return SpsCostTable(sample_batch_tokens=tuple(probes),
                        sample_steps_per_sec=tuple(statistics.median(cells[p]) for p in probes),
                        max_batch_tokens=max(probes[-1], max_batch_tokens or 0))


def _hat_basis(xs: list[float], probes: list[int]):
    """[n, len(probes)] piecewise-linear interpolation weights, clamped beyond the ends."""
    x = torch.tensor(xs, dtype=torch.float64).clamp(probes[0], probes[-1])
    basis = torch.zeros(len(xs), len(probes), dtype=torch.float64)
    if len(probes) == 1:
        return basis.fill_(1.0)
    p = torch.tensor(probes, dtype=torch.float64)
    hi = torch.bucketize(x, p, right=True).clamp(1, len(probes) - 1)
    w = (x - p[hi - 1]) / (p[hi] - p[hi - 1])
    rows = torch.arange(len(xs))
    basis[rows, hi - 1] = 1 - w
    basis[rows, hi] += w
    return basis


def fit_additive(rounds: list[dict]):
    """SpsAdditiveCostTable T(bs, M) = bias + alpha(bs) + theta(M), least squares over every row
    (alpha and theta are 0 at their first probe; M binned by 64 above 64). None when the rows have
    no off-diagonal (frac < 1) cell, or the fit gives a non-positive bias."""
    if not any(row.get("frac", 1.0) < 1.0 for row in rounds):
        return None
    bs = [float(r["batch_size_per_rank"]) for r in rounds]
    m = [float(r["batch_tokens"]) for r in rounds]
    bs_probes = sorted({int(b) for b in bs})
    m_probes = sorted({int(v) if v < M_BIN else M_BIN * round(v / M_BIN) for v in m})
    design = torch.cat([torch.ones(len(rounds), 1, dtype=torch.float64),
                        _hat_basis(bs, bs_probes)[:, 1:], _hat_basis(m, m_probes)[:, 1:]], dim=1)
    seconds = torch.tensor([1.0 / r["steps_per_sec"] for r in rounds], dtype=torch.float64)
    coef = torch.linalg.lstsq(design, seconds[:, None]).solution[:, 0].tolist()
    bias, k = coef[0], len(bs_probes) - 1
    if not bias > 0:
        return None
    return SpsAdditiveCostTable(bias_seconds=bias, bs_probes=tuple(bs_probes), alpha_seconds=(0.0, *coef[1:1 + k]),
                                m_probes=tuple(m_probes), theta_seconds=(0.0, *coef[1 + k:]))


def recorded_rounds(records: list[dict]):
    """(logits [n, N] fp64, accepted drafts [n]) over the records' verify steps, or None without them."""
    logits, accept = [], []
    for rec in records:
        if "dspine_confidence_logits" in rec and "dspine_accept_lens" in rec:
            logits.extend(rec["dspine_confidence_logits"])
            accept.extend(rec["dspine_accept_lens"])
    if not logits:
        return None
    return torch.tensor(logits, dtype=torch.float64), torch.tensor(accept)


def observed_survival(records: list[dict]) -> list[float] | None:
    """[N-1]: the share of recorded verify steps that accepted at least j+1 proposals (the switch's
    prior), or None without per-step records."""
    rounds = recorded_rounds(records)
    if rounds is None:
        return None
    logits, accepted = rounds
    return survival(accepted, logits.shape[1]).tolist()


def fit_calibration(records: list[dict], dataset: str, affine: bool = False):
    """PositionCalibration (temperature-only, or `affine`) from the records' per-step logits and
    accept lengths, or None without them."""
    rounds = recorded_rounds(records)
    if rounds is None:
        return None
    return PositionCalibration.fit(*rounds, dataset=dataset, affine=affine)


def check_calibration(calibration, path: Path, records: list[dict]) -> dict:
    """`calibration` (a PositionCalibration fitted elsewhere, read from `path`) against these
    records: per position the predicted and observed P(accepted drafts >= j) and their gap in
    points; survival ECE raw (identity) and calibrated. Raises TuningError without recorded
    confidences or on a width mismatch."""
    rounds = recorded_rounds(records)
    if rounds is None:
        raise TuningError("--check-calibration: the acceptance records hold no dspine_confidence_logits (start the "
                          "DSPINE server with DSPINE_RECORD_CONFIDENCE=1)")
    try:
        gaps = calibration.survival_gaps(*rounds)
    except ValueError as err:
        raise TuningError(f"--check-calibration {path}: {err}") from None
    raw = PositionCalibration.identity(rounds[0].shape[1]).calibration_error(*rounds)[1]
    return {"calibration": str(path), "rounds": int(rounds[0].shape[0]), "ece_raw": raw,
            "ece_calibrated": calibration.calibration_error(*rounds)[1],
            "max_abs_gap_points": max(abs(g["gap_points"]) for g in gaps), "positions": gaps}
