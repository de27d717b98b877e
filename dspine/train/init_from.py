"""A run that starts from a drafter checkpoint's weights (`TrainConfig.init_from`, `dspine train
--init-from DIR`): fine-tuning the shipped drafter, or any exported one, on new data.

The checkpoint must be a drafter of this run's target (same fingerprint) whose weights have the
shapes this run's drafter config implies; only its weights are taken: the optimizer, schedule and
log start fresh, as with `--warm-start` from a run state. Only a new run starts from it: a run
directory that already holds a state resumes (or warm-starts) from that state. `check` runs
before the run writes anything; `load` after the drafter is built. `init_from.json` in the run
directory and `dspine_training.init_from` in the exported config say where the weights came from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dspine.model.checkpoint import (CheckpointError, check_target_compatible, expected_shapes, load_checkpoint,
                                     read_config, resolve_checkpoint_dir)
from dspine.model.config import DSpineConfig
from dspine.model.drafter import DSpineDrafter
from dspine.train.config import TrainConfig, TrainConfigError


def check(cfg: TrainConfig, target_config) -> Path:
    """The checkpoint folder of `cfg.init_from`, after checking from its config.json alone that it is
    a drafter of `target_config`'s target with the weight shapes of `cfg.drafter` (the weight files
    themselves are checked by `load`); TrainConfigError naming what differs and the fix otherwise."""
    where = f"init_from = {cfg.init_from}"
    try:
        ckpt_dir = resolve_checkpoint_dir(cfg.init_from)
        saved = read_config(ckpt_dir)
        saved_target = json.loads((ckpt_dir / "config.json").read_text()).get("dspine_target")
        check_target_compatible(saved, target_config, saved_target=saved_target)
    except CheckpointError as exc:
        raise TrainConfigError(f"{where}: {exc}") from None
    ours = DSpineConfig.for_target(target_config, mask_token_id=saved.mask_token_id, **cfg.drafter)
    if expected_shapes(saved) != expected_shapes(ours):
        differ = [f"{f.name}: checkpoint {getattr(saved, f.name)!r}, this run {getattr(ours, f.name)!r}"
                  for f in dataclasses.fields(DSpineConfig) if getattr(saved, f.name) != getattr(ours, f.name)]
        raise TrainConfigError(f"{where}: its drafter's weights have other shapes than this run's drafter config "
                               f"implies ({'; '.join(differ)}). Fix: set the shape fields to the checkpoint's "
                               f"(--set drafter.FIELD=VALUE) or train from scratch without init_from")
    return ckpt_dir


def load(model: DSpineDrafter, ckpt_dir: Path) -> dict:
    """Copy the checkpoint's weights into `model` (in place, into its own dtype and device); returns
    the record `init_from.json` keeps: the folder and the checkpoint's own `dspine_training`."""
    try:
        weights = load_checkpoint(ckpt_dir).state_dict()
    except CheckpointError as exc:
        raise TrainConfigError(f"init_from = {ckpt_dir}: {exc}") from None
    model.load_state_dict(weights, strict=True)
    trained = json.loads((ckpt_dir / "config.json").read_text()).get("dspine_training")
    return {"checkpoint": str(ckpt_dir), "its_training": trained}
