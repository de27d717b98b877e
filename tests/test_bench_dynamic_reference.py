"""dspine/bench/dynamic_reference.py: a whole run on a tiny target (tune on the dev traces' `tune`
split, measure on held-out requests): every algorithm at every concurrency, greedy outputs
identical to AR's, a readable SPS table, the plain-step table, the held-out calibration report."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import drafter_for, tiny_llama

from dspine.model.checkpoint import save_checkpoint
from dspine.dynamic.cost_tables import load_sps_table
from dspine.bench import dynamic_reference as bench


def test_plain_step_table_interpolates_the_measured_steps():
    table = bench.plain_step_table([{"batch_size_per_rank": 1, "steps_per_sec": 10.0},
                                    {"batch_size_per_rank": 5, "steps_per_sec": 2.0}])
    seconds = [float(table.step_seconds(n, torch.zeros(1, dtype=torch.long))[0]) for n in (1, 3, 5, 9)]
    assert seconds == pytest.approx([0.1, 0.3, 0.5, 0.5])              # linear between levels, flat beyond


def test_a_run_compares_ar_static_and_dynamic_on_heldout_requests(tmp_path, monkeypatch):
    from dspine.engine.targets import load_tokenizer

    tokenizer, _ = load_tokenizer()
    target = tiny_llama(vocab=len(tokenizer))
    monkeypatch.setattr(bench, "load_target", lambda *a, **k: (target, tokenizer))
    save_checkpoint(drafter_for(target, block_size=4), tmp_path / "drafter", dtype=torch.float32)
    out = tmp_path / "dynamic.json"
    assert bench.main(["--drafter", str(tmp_path / "drafter"), "--concurrency", "1,2", "--widths", "0,1,3",
                       "--tune-requests", "4", "--heldout-requests", "5", "--max-new-tokens", "6",
                       "--cell-rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"command", "date", "device", "torch"} <= set(result)
    runs = {(r["algorithm"], r["concurrency"]): r for r in result["runs"]}
    assert set(runs) == {(a, c) for a in ("AR", "DSPINE-static", "DSPINE-dynamic") for c in (1, 2)}
    for c in (1, 2):
        assert runs["DSPINE-static", c]["identical_to_ar"] == runs["DSPINE-dynamic", c]["identical_to_ar"] == 5
        assert runs["AR", c]["mean_verify_tokens"] == 1.0 and runs["DSPINE-static", c]["mean_verify_tokens"] == 4.0
        assert 0.0 <= runs["DSPINE-dynamic", c]["plain_round_share"] <= 1.0
    assert [(cell["batch_size_per_rank"], cell["batch_tokens"]) for cell in result["cells"]] == [
        (1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 8)]
    assert [cell["batch_size_per_rank"] for cell in result["plain_cells"]] == [1, 2]
    table_file = tmp_path / "table.json"
    table_file.write_text(json.dumps(result["sps_table"]))
    load_sps_table(table_file)                                           # SGLang's format, valid
    assert result["heldout_requests"] == 5 and sum(result["heldout_sources"].values()) == 5
    assert result["heldout_calibration"]["rounds"] > 0
    assert [g["position"] for g in result["heldout_calibration"]["positions"]] == [1, 2, 3]
    assert out.with_suffix(".png").stat().st_size > 0
