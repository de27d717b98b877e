"""Resuming a training run (`dspine.train.resume` in `trainer.train`): an interrupted run resumed
from its state ends with exactly the weights of an uninterrupted one; a state of another run
(config, data) is refused before anything is written, naming what differs; `--warm-start` continues
from its weights with a fresh optimizer and schedule."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import _config, tiny_target_dir  # noqa: F401  (the module fixture)

import dspine.train.trainer as trainer
from dspine.train.config import TrainConfig, TrainConfigError


def final_state(run_dir):
    return torch.load(run_dir / "state.pt", weights_only=False)


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, tiny_target_dir, monkeypatch):  # noqa: F811
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = _config(tmp_path / "a", tiny_target_dir, steps=10)
    trainer.train(straight, device="cpu", progress=False)
    interrupted = _config(tmp_path / "b", tiny_target_dir, steps=10)
    real_step, calls = trainer.train_step, []

    def crash_at_step_7(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt               # after the state saved at step 5
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", crash_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(interrupted, device="cpu", progress=False)
    monkeypatch.setattr(trainer, "train_step", real_step)
    assert final_state(tmp_path / "b" / "run")["step"] == 5
    trainer.train(interrupted, device="cpu", progress=False)
    a, b = final_state(tmp_path / "a" / "run"), final_state(tmp_path / "b" / "run")
    assert a["step"] == b["step"] == 10
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert [e["final"] for e in a["log"]] == [e["final"] for e in b["log"]]


def test_another_runs_state_is_refused_or_warm_started(tmp_path, tiny_target_dir):  # noqa: F811
    cfg = _config(tmp_path, tiny_target_dir, steps=5)
    trainer.train(cfg, device="cpu", progress=False)
    run = tmp_path / "run"
    saved = final_state(run)
    config_before = (run / "train_config.json").read_text()

    changed = TrainConfig(**{**cfg.__dict__, "lr": 3e-3})
    with pytest.raises(TrainConfigError, match=r"config lr: saved 0.01, now 0.003.*--warm-start"):
        trainer.train(changed, device="cpu", progress=False)
    assert (run / "train_config.json").read_text() == config_before            # nothing written
    with open(cfg.data, "a") as f:                                               # one more sequence
        f.write(json.dumps({"ids": [1, 2, 3] + [50, 60, 70] * 8, "answer_start": 3}) + "\n")
    with pytest.raises(TrainConfigError, match=r"data: saved \w+ \(12 sequences\), now \w+ \(13 sequences\)"):
        trainer.train(cfg, device="cpu", progress=False)

    longer = TrainConfig(**{**changed.__dict__, "steps": 7})
    captured = {}
    real_step = trainer.train_step

    def first_weights(objective, *args, **kwargs):
        captured.setdefault("weights", {k: v.clone() for k, v in trainer.distributed.unwrap(objective).drafter
                                        .state_dict().items()})
        return real_step(objective, *args, **kwargs)

    trainer.train_step = first_weights
    try:
        trainer.train(longer, device="cpu", progress=False, warm_start=True)
    finally:
        trainer.train_step = real_step
    for name, tensor in saved["model"].items():                                  # started from the saved weights
        assert torch.equal(captured["weights"][name], tensor), name
    note = json.loads((run / "warm_start.json").read_text())
    assert note["from_step"] == 5 and any(d.startswith("config lr") for d in note["differences"])
    assert any(d.startswith("data:") for d in note["differences"])
    assert final_state(run)["step"] == 7 and final_state(run)["log"][0]["step"] == 5   # a new log from step 0


def test_a_travel_state_resumes_the_same_run_with_fresh_moments(tmp_path, tiny_target_dir, capsys):  # noqa: F811
    """A run stopped at step 5 and carried as a travel state continues at step 5 with its log, RNG and
    data position; only AdamW's moments restart, so its steps from there follow a fresh optimizer."""
    from dspine.train import resume
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trainer.train(_config(tmp_path / "a", tiny_target_dir, steps=5), device="cpu", progress=False)
    full = tmp_path / "a" / "run" / "state.pt"
    lean = tmp_path / "b" / "state.pt"
    assert resume.main(["travel", str(full), str(lean)]) == 0
    carried = torch.load(lean, weights_only=False)
    assert "optimizer" not in carried and carried["step"] == 5
    assert lean.stat().st_size < full.stat().st_size
    run = tmp_path / "b" / "run"
    run.mkdir()
    lean.rename(run / "state.pt")
    (run / "run_key.json").write_text((tmp_path / "a" / "run" / "run_key.json").read_text())
    cfg = _config(tmp_path / "b", tiny_target_dir, steps=10)
    trainer.train(cfg, device="cpu", progress=False)
    assert "AdamW's moments restart at step 5" in capsys.readouterr().out
    state = final_state(run)
    assert state["step"] == 10
    assert state["log"][: len(carried["log"])] == carried["log"]              # the same run's log, continued
    assert state["optimizer"]["state"][0]["step"] == 5                         # moments counted from the restart
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_travel_refuses_what_is_not_a_training_state(tmp_path):
    from dspine.train import resume
    torch.save({"weights": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(SystemExit):
        resume.main(["travel", str(tmp_path / "x.pt"), str(tmp_path / "out.pt")])
    assert not (tmp_path / "out.pt").exists()


def test_a_grown_data_file_goes_on_with_new_data_only(tmp_path, tiny_target_dir):  # noqa: F811
    """The data file grew (records appended): refused without a flag, naming --new-data; with it the
    run goes on at its step with its optimizer and log, the change recorded. A config change with new
    data is still refused under --new-data."""
    cfg = _config(tmp_path, tiny_target_dir, steps=5)
    trainer.train(cfg, device="cpu", progress=False)
    run = tmp_path / "run"
    saved = final_state(run)
    with open(cfg.data, "a") as f:
        for k in range(3):
            f.write(json.dumps({"id": f"more-{k}", "ids": [1, 2, 3] + [50, 60 + k, 70] * 8, "answer_start": 3}) + "\n")
    with pytest.raises(TrainConfigError, match="--new-data"):
        trainer.train(TrainConfig(**{**cfg.__dict__, "steps": 8}), device="cpu", progress=False)
    with pytest.raises(TrainConfigError, match="config lr"):
        trainer.train(TrainConfig(**{**cfg.__dict__, "steps": 8, "lr": 3e-3}), device="cpu", progress=False,
                      new_data=True)
    trainer.train(TrainConfig(**{**cfg.__dict__, "steps": 8}), device="cpu", progress=False, new_data=True)
    state = final_state(run)
    assert state["step"] == 8 and state["log"][: len(saved["log"])] == saved["log"]      # the same run, continued
    assert state["optimizer"]["state"][0]["step"] == 8                                   # its moments kept
    assert state["key"]["records"] == saved["key"]["records"] + 3
    change, = json.loads((run / "data_changes.json").read_text())
    assert change["step"] == 5 and change["to"]["records"] == change["from"]["records"] + 3


def test_the_held_out_split_never_takes_a_training_record_when_the_file_grows():
    recs = [{"id": f"c{k}", "ids": [k], "answer_start": 0} for k in range(200)]
    held, rest = trainer.split_heldout(recs, 16)
    assert len(held) == 16 and len(rest) == 184 and {r["id"] for r in held}.isdisjoint(r["id"] for r in rest)
    assert [r["id"] for r in rest] == [r["id"] for r in recs if r not in held]          # file order kept
    grown = recs + [{"id": f"n{k}", "ids": [k], "answer_start": 0} for k in range(300)]
    held2, _ = trainer.split_heldout(grown, 16)
    assert not {r["id"] for r in held2} & {r["id"] for r in rest}                        # never a trained-on one
    assert {r["id"] for r in held2} != {r["id"] for r in held}                           # new records can enter
    assert trainer.split_heldout(list(reversed(recs)), 16)[0] == held                    # by content, not position


def test_a_saved_state_exports_the_checkpoint_its_run_exported(tmp_path, tiny_target_dir):  # noqa: F811
    """`python -m dspine.train.resume export` on a travel state writes the weights, config and target
    identity the run's own export wrote at that step; a target of another fingerprint is refused."""
    from safetensors.torch import load_file

    from dspine.train import resume
    from dspine.train.export import export_state

    cfg = _config(tmp_path, tiny_target_dir, steps=5)
    trainer.train(cfg, device="cpu", progress=False)
    run = tmp_path / "run"
    assert resume.main(["travel", str(run / "state.pt"), str(tmp_path / "travel.pt")]) == 0
    out = tmp_path / "exported"
    assert resume.main(["export", str(tmp_path / "travel.pt"), str(out), "--target", str(tiny_target_dir),
                        "--trained-on", "CPU"]) == 0

    def weights(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    ours, theirs = weights(out), weights(run / "checkpoint")
    assert ours.keys() == theirs.keys() and ours
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    ours_cfg, theirs_cfg = (json.loads((d / "config.json").read_text()) for d in (out, run / "checkpoint"))
    assert ours_cfg["dspine_config"] == theirs_cfg["dspine_config"]
    assert ours_cfg["dspine_target"]["fingerprint"] == theirs_cfg["dspine_target"]["fingerprint"]
    assert {k: v for k, v in ours_cfg["dspine_training"].items() if k != "data"} \
        == {k: v for k, v in theirs_cfg["dspine_training"].items() if k != "data"}

    state = torch.load(tmp_path / "travel.pt", weights_only=False)
    state["key"] = {**state["key"], "target": "0" * 16}
    with pytest.raises(TrainConfigError, match="fingerprint 0000000000000000.*Fix: pass the folder"):
        export_state(state, tmp_path / "refused", str(tiny_target_dir), "CPU")
    assert not (tmp_path / "refused").exists()
