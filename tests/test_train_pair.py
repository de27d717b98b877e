"""dspine/train/pair.py: a DSpine variant differs from the pair's run only in the fields it sets,
and keeps its own run directory and name."""

from __future__ import annotations

import argparse

import pytest

from dspine.train import pair


def _args(**kw):
    base = {"data": "d.jsonl", "work": "/w", "variant": None, "drafter_set": [], "set": []}
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_variant_changes_only_what_it_sets():
    name, plain = pair.build_config("dspine", _args(), 100)
    vname, variant = pair.build_config("dspine", _args(variant="heavy", drafter_set=[
        "layer_loss_weights=[0.5,0.4,0.3,0.2,0.1]", 'selection="argmax"']), 100)
    assert (name, plain.run_dir) == ("dspine", "/w/dspine")
    assert (vname, variant.run_dir) == ("dspine-heavy", "/w/dspine-heavy")
    assert variant.drafter["layer_loss_weights"] == [0.5, 0.4, 0.3, 0.2, 0.1]
    assert variant.drafter["selection"] == "argmax"
    changed = {k for k in plain.drafter.keys() | variant.drafter.keys()
               if plain.drafter.get(k) != variant.drafter.get(k)}
    assert changed == {"layer_loss_weights", "selection"}
    assert {k: v for k, v in vars(plain).items() if k not in ("run_dir", "drafter")} == \
        {k: v for k, v in vars(variant).items() if k not in ("run_dir", "drafter")}


@pytest.mark.parametrize("bad, message", [("noequals", "KEY=JSON"), ("selection=argmax", "not JSON")])
def test_malformed_settings_are_named(bad, message):
    with pytest.raises(SystemExit, match=message):
        pair.drafter_settings([bad])


def test_settings_without_a_variant_or_on_the_ablation_are_refused(capsys):
    common = ["--data", "d", "--work", "w", "--out-dir", "o", "--steps", "5"]
    with pytest.raises(SystemExit):
        pair.main(["train-dspine", *common, "--drafter-set", "injection_top_k=16"])
    assert "needs --variant" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pair.main(["train-ablation", *common, "--variant", "x"])
    assert "belong to train-dspine" in capsys.readouterr().err


def test_campaign_settings_reach_both_runs_alike_and_only_top_level_ones_are_taken(capsys):
    settings = ["max_len=8192", "blocks_per_seq=64"]
    (_, dspine), (_, ablation) = (pair.build_config(n, _args(set=settings), 100) for n in ("dspine", "ablation"))
    assert (dspine.max_len, dspine.blocks_per_seq) == (ablation.max_len, ablation.blocks_per_seq) == (8192, 64)
    assert dspine.steps == ablation.steps == 100
    common = ["--data", "d", "--work", "w", "--out-dir", "o", "--steps", "5"]
    for bad, message in [("drafter.injection=false", "--drafter-set"), ("steps=9", "as --steps")]:
        with pytest.raises(SystemExit):
            pair.main(["train-ablation", *common, "--set", bad])
        assert message in capsys.readouterr().err


def test_a_leg_passes_its_time_limit_and_resume_modes_and_copies_the_weights_so_far(tmp_path, monkeypatch):
    """A campaign leg: --time-limit, --warm-start and --new-data reach the trainer; a run its time limit stopped
    (train returns None) still leaves its weights so far as ckpt_<run> in --out-dir."""
    seen = {}

    def fake_train(cfg, *, device, time_limit_s, progress, warm_start, new_data):
        seen.update(time_limit_s=time_limit_s, warm_start=warm_start, new_data=new_data, run_dir=cfg.run_dir)
        ckpt = tmp_path / "w" / "ablation" / "checkpoint"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text("{}")
        (tmp_path / "w" / "ablation" / "log.json").write_text("[]")
        return None

    monkeypatch.setattr(pair, "train", fake_train)
    monkeypatch.setattr(pair.torch.cuda, "get_device_name", lambda: "test device")
    assert pair.main(["train-ablation", "--data", "d", "--work", str(tmp_path / "w"), "--out-dir",
                      str(tmp_path / "o"), "--steps", "5", "--time-limit", "30", "--warm-start", "--new-data"]) == 0
    assert seen == {"time_limit_s": 30.0, "warm_start": True, "new_data": True,
                    "run_dir": str(tmp_path / "w" / "ablation")}
    assert (tmp_path / "o" / "ckpt_ablation" / "config.json").is_file()
    assert (tmp_path / "o" / "train_log_ablation.json").is_file()
