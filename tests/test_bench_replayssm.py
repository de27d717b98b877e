"""dspine/bench/replayssm.py --cpu-smoke: the whole benchmark at tiny shapes in Triton's interpreter
(memory, timing, kernel error against the PyTorch references), and its refusal to run the kernels
compiled on a CPU."""

from __future__ import annotations

import json

from dspine.bench import replayssm


def test_cpu_smoke_measures_and_checks_the_kernels(tmp_path, capsys):
    out = tmp_path / "replayssm.json"
    assert replayssm.main(["--cpu-smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "correctness (bs 2)" in printed and "-> ok" in printed
    result = json.loads(out.read_text())
    assert {"command", "device", "date"} <= set(result) and result["device"] == "cpu"
    assert [t["batch_size"] for t in result["commit_and_verify_time"]] == [1, 2]
    assert result["correctness"]["ok"] and result["correctness"]["replay_max_abs_err"] <= 1e-4
    memory = result["memory_per_request"]
    assert memory["allocated"]["snapshot_bytes"] > memory["allocated"]["replayssm_bytes"] > 0
    assert memory["analytic"]["ratio"] > 1


def test_cpu_smoke_needs_the_triton_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert replayssm.main(["--cpu-smoke"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
