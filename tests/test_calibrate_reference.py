"""dspine/bench/calibrate_reference.py: a whole run on a tiny target with the repository's dev traces
(fit on `tune`, report on `heldout`, STS file readable)."""

from __future__ import annotations

import json

import torch
from conftest import drafter_for, tiny_llama

from dspine.model.checkpoint import save_checkpoint
from dspine.dynamic.calibration import PositionCalibration
from dspine.bench import calibrate_reference as calibrate


def test_a_run_fits_on_tune_and_reports_on_heldout(tmp_path, monkeypatch):
    from dspine.engine.targets import load_tokenizer

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
