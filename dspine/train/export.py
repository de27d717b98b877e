"""A drafter checkpoint from training: the trainer's export at the end of a run (or at its time
limit) and `export_state`, the checkpoint of a saved state (`python -m dspine.train.resume export`),
written by one function, `export_drafter`: bf16 shards, the target's identity, the model card's
training record (`training_card`) and `dspine_training` in config.json."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dspine import __version__
from dspine.engine.targets import load_target, mask_token_candidate, target_identity
from dspine.model.checkpoint import save_checkpoint
from dspine.model.config import DSpineConfig
from dspine.model.drafter import DSpineDrafter
from dspine.train.config import TrainConfig, TrainConfigError


def device_name(device: str) -> str:
    """The GPU's name for "cuda..." devices, else "CPU"."""
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"


def training_card(log: list[dict], key: dict, step: int, devices: str) -> dict:
    """The model card's training record: the data file's hash and size, the code version, and the
    budget as of the last log entry (steps, label tokens seen, device-minutes on `devices`, e.g.
    "1 x NVIDIA H200"; a warm-started run counts from its own start, `warm_start.json` says from what)."""
    last = log[-1] if log else {}
    return {"data_hash": f"{key['data']} ({key['records']} sequences)", "code_version": f"dspine {__version__}",
            "budget": {"steps": step, "label tokens seen": last.get("labels_seen", 0),
                       "device-minutes": round(last.get("device_seconds", 0.0) / 60, 1), "devices": devices}}


def export_drafter(model: DSpineDrafter, path: Path, cfg: TrainConfig, *, log: list[dict], key: dict, step: int,
                   identity: dict, world: int, trained_on: str, data: str) -> Path:
    """`model` as a drafter checkpoint folder at `path` (bf16 shards of `cfg.export_shard_bytes`, the
    target's `identity`, the card's training record on `world` x `trained_on` devices,
    `dspine_training`: the data it read, steps, step, batch shape, seed), left in train mode. The
    trainer's export and `export_state` both write it."""
    model.eval()
    save_checkpoint(model, path, dtype=torch.bfloat16, max_shard_bytes=cfg.export_shard_bytes, target=identity,
                    card=training_card(log, key, step, f"{world} x {trained_on}"),
                    extra_config={"dspine_training": {
                        "data": data, "steps": cfg.steps, "step": step, "batch_size": cfg.batch_size,
                        "grad_accum_steps": cfg.grad_accum_steps, "world_size": world,
                        "blocks_per_seq": cfg.blocks_per_seq, "seed": cfg.seed, "init_from": cfg.init_from}})
    model.train()
    return path


def export_state(state: dict, out: Path, target: str | None, trained_on: str, steps: int | None = None) -> Path:
    """A training state (full or travel) as the drafter checkpoint its run would export at its step
    (`trainer.export_drafter`), against `target` (a folder or hub id; None: the packaged default),
    whose fingerprint must be the one the run trained against (TrainConfigError naming both).
    `steps`: the run's schedule length for the checkpoint's config (a state keeps its step, not its
    schedule; default: that step, a finished run)."""
    key = state["key"]
    model, tokenizer = load_target(target)
    identity = target_identity(model.config, target)
    if identity["fingerprint"] != key["target"]:
        raise TrainConfigError(f"the state trained against target fingerprint {key['target']}; --target "
                               f"{target or 'default'} has {identity['fingerprint']}. Fix: pass the folder (or hub id) "
                               "of the target the run trained against")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(data="", run_dir="", steps=steps or state["step"],
                      **{k: v for k, v in key["config"].items() if k in fields})
    drafter = DSpineDrafter(DSpineConfig.for_target(model.config, mask_token_id=mask_token_candidate(tokenizer),
                                                    **cfg.drafter))
    drafter.load_state_dict(state["model"])
    drafter.attach_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return export_drafter(drafter, out, cfg, log=state.get("log", []), key=key, step=state["step"], identity=identity,
                          world=1, trained_on=trained_on, data=f"{key['data']} ({key['records']} sequences)")
