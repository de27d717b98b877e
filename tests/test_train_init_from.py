"""Starting a run from a drafter checkpoint (`TrainConfig.init_from`, `dspine train --init-from`):
the first step sees exactly the checkpoint's weights (a run without it does not), the run records
where they came from, and a checkpoint of other weight shapes or another target is refused before
the run directory exists, naming what differs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_train import _config, tiny_target_dir  # noqa: F401  (the module fixture)

import dspine.train.trainer as trainer
from dspine.train.config import TrainConfigError


class _FirstStep(Exception):
    pass


def first_step_weights(cfg, monkeypatch) -> dict[str, torch.Tensor]:
    """The drafter's weights when the run's first optimisation step starts."""
    seen = {}

    def capture(objective, *args, **kwargs):
        seen.update({k: v.detach().clone() for k, v in objective.drafter.state_dict().items()})
        raise _FirstStep

    monkeypatch.setattr(trainer, "train_step", capture)
    with pytest.raises(_FirstStep):
        trainer.train(cfg, device="cpu", progress=False)
    monkeypatch.undo()
    return seen


def checkpoint_weights(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory, tiny_target_dir):  # noqa: F811
    root = tmp_path_factory.mktemp("source")
    return trainer.train(_config(root, tiny_target_dir, steps=5), device="cpu", progress=False)


def test_a_run_starts_from_the_checkpoint_weights(tmp_path, tiny_target_dir, trained_checkpoint,  # noqa: F811
                                                 monkeypatch):
    saved = checkpoint_weights(trained_checkpoint)
    (tmp_path / "scratch").mkdir()
    scratch = first_step_weights(_config(tmp_path / "scratch", tiny_target_dir, steps=3), monkeypatch)
    assert any(not torch.equal(scratch[k], saved[k].float()) for k in saved)       # a random init is not it

    (tmp_path / "init").mkdir()
    cfg = _config(tmp_path / "init", tiny_target_dir, steps=3, init_from=str(trained_checkpoint))
    started = first_step_weights(cfg, monkeypatch)
    assert started.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(started[name], tensor.float()), name
    record = json.loads((tmp_path / "init" / "run" / "init_from.json").read_text())
    assert record["checkpoint"] == str(trained_checkpoint) and record["its_training"]["step"] == 5

    shutil.rmtree(tmp_path / "init" / "run")
    export = trainer.train(cfg, device="cpu", progress=False)
    training = json.loads((export / "config.json").read_text())["dspine_training"]
    assert (training["init_from"], training["step"]) == (str(trained_checkpoint), 3)


def test_other_shapes_or_another_target_are_refused_before_the_run_dir_exists(tmp_path, tiny_target_dir,  # noqa: F811
                                                                              trained_checkpoint):
    wider = _config(tmp_path, tiny_target_dir, steps=3, init_from=str(trained_checkpoint))
    wider.drafter["intermediate_size"] = 96
    with pytest.raises(TrainConfigError, match=r"intermediate_size: checkpoint 64, this run 96.*--set drafter"):
        trainer.train(wider, device="cpu", progress=False)

    other = tmp_path / "other-target"
    shutil.copytree(trained_checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config["dspine_target"]["fingerprint"] = "0" * 16
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(TrainConfigError, match=r"init_from = .*fingerprint 0000000000000000"):
        trainer.train(_config(tmp_path, tiny_target_dir, steps=3, init_from=str(other)), device="cpu", progress=False)

    with pytest.raises(TrainConfigError, match=r"init_from = .*no config.json"):
        trainer.train(_config(tmp_path, tiny_target_dir, steps=3, init_from=str(tmp_path)), device="cpu",
                      progress=False)
    assert not (tmp_path / "run").exists()
