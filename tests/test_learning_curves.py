"""dspine.bench.learning_curves: points from both log formats, the label estimate of older logs, the
recent slope against an exactly log-linear curve, and errors that name the file."""

import json
import math

import pytest

from dspine.bench import learning_curves as lc

CONFIG = {"batch_size": 4, "blocks_per_seq": 8, "grad_accum_steps": 2, "drafter": {"block_size": 16}}


def tau_at(labels: float) -> float:
    return 1.0 + 0.5 * math.log10(labels / 1e6)          # exactly 0.5 a decade


def test_points_slope_and_results_file(tmp_path):
    counted = [{"step": s, "loss": 1.0} for s in range(10, 101, 10)]
    for entry in counted:
        if entry["step"] % 20 == 0:
            entry.update(labels_seen=entry["step"] * 10**5, heldout_tau=tau_at(entry["step"] * 10**5))
    (tmp_path / "log.json").write_text(json.dumps(counted))
    older = [{"step": s, "heldout_tau": 1.5 + s / 1000} for s in (300, 100, 200)]   # out of order, no labels_seen
    (tmp_path / "train_log_old.json").write_text(json.dumps({"device": "NVIDIA H200", "config": CONFIG, "log": older}))

    assert lc.main(["--run", f"new={tmp_path / 'log.json'}", "--run", f"old={tmp_path / 'train_log_old.json'}",
                    "--out-dir", str(tmp_path), "--name", "curves"]) == 0
    results = json.loads((tmp_path / "curves.json").read_text())
    assert results["device"] == "NVIDIA H200" and results["command"] and results["date"]
    new, old = results["runs"]
    assert [p["step"] for p in new["points"]] == [20, 40, 60, 80, 100] and not new["labels_estimated"]
    assert new["per_decade"] == pytest.approx(0.5, abs=1e-4)
    assert new["tau_at_10x"] == pytest.approx(tau_at(100 * 10**5) + 0.5, abs=1e-4)
    assert old["labels_estimated"] and new["device"] is None
    assert [p["labels_seen"] for p in old["points"]] == [s * 4 * 2 * 8 * 15 for s in (100, 200, 300)]


def test_a_run_of_one_point_has_no_slope():
    points, _ = lc.curve_points([{"step": 5, "labels_seen": 100, "heldout_tau": 1.2}], None, "x")
    assert lc.recent_slope(points) is None


def test_errors_name_the_file_and_the_fix(tmp_path, capsys):
    none = tmp_path / "none.json"
    none.write_text(json.dumps([{"step": 1, "loss": 2.0}]))
    assert lc.main(["--run", f"a={none}", "--out-dir", str(tmp_path)]) == 2
    assert f"{none}: no entry has `heldout_tau`" in capsys.readouterr().out
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps([{"step": 1, "heldout_tau": 1.1}]))
    with pytest.raises(lc.CurveError, match="no config to estimate them"):
        lc.curve("a", raw)
    with pytest.raises(SystemExit):
        lc.parse_args(["--run", "no-equals-sign"])
