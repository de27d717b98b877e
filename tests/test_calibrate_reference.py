"""scripts/calibrate_reference.py: the per-position report's arithmetic, and a whole run on a tiny
target with the repository's dev traces (fit on `tune`, report on `heldout`, STS file readable)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import drafter_for, load_script, tiny_llama

from dspine.checkpoint import save_checkpoint
from dspine.dynamic_verification import PositionCalibration

calibrate = load_script("calibrate_reference")


def test_position_report_compares_mean_survival_with_the_observed_rate():
    logits = torch.tensor([[10.0, 0.0], [10.0, -10.0]], dtype=torch.float64)  # p ≈ (1, .5) and (1, 0)
    accept = torch.tensor([2, 0])
    rows = calibrate.position_report(PositionCalibration.identity(2), logits, accept)
    assert rows[0]["predicted"] == pytest.approx(1.0, abs=1e-4) and rows[0]["observed"] == 0.5
    assert rows[1]["predicted"] == pytest.approx(0.25, abs=1e-4) and rows[1]["observed"] == 0.5
    assert rows[1]["gap_points"] == pytest.approx(-25.0, abs=1e-2)


def test_a_run_fits_on_tune_and_reports_on_heldout(tmp_path, monkeypatch):
    from dspine.targets import load_tokenizer

    tokenizer, _ = load_tokenizer()
    target = tiny_llama(vocab=len(tokenizer))
    monkeypatch.setattr(calibrate, "load_target", lambda *a, **k: (target, tokenizer))
    save_checkpoint(drafter_for(target, block_size=4), tmp_path / "drafter", dtype=torch.float32)
    out, sts, affine = tmp_path / "report.json", tmp_path / "sts.json", tmp_path / "affine.json"
    assert calibrate.main(["--traces", "benchmarks/traces/sharegpt_dev.jsonl", "--drafter", str(tmp_path / "drafter"),
                           "--max-new-tokens", "4", "--device", "cpu", "--out", str(out), "--sts-out", str(sts),
                           "--affine-out", str(affine)]) == 0
    report = json.loads(out.read_text())
    assert (report["tune_requests"], report["heldout_requests"]) == (32, 8)
    assert [r["position"] for r in report["positions"]] == [1, 2, 3]
    assert report["heldout_rounds"] >= 8 and all(0 <= r["observed"] <= 1 for r in report["positions"])
    assert len(PositionCalibration.from_json(sts.read_text()).temperatures) == 3
    assert "biases" not in json.loads(sts.read_text())                 # SGLang's STS file, unchanged
    fit = PositionCalibration.from_json(affine.read_text())
    assert len(fit.biases) == 3                                         # an affine fit, not a temperature-only one
    assert list(fit.temperatures) == report["affine"]["temperatures"] and list(fit.biases) == report["affine"]["biases"]
    assert [r["position"] for r in report["affine"]["positions"]] == [1, 2, 3]
    assert report["affine"]["largest_gap_points"] == max(abs(r["gap_points"]) for r in report["affine"]["positions"])
