"""`TrainConfig`: a training run as typed data, validated before anything heavy loads.

Every field is checked against its annotation when the config is built: ints, floats (YAML reads
`6e-4` as a string; a numeric string is taken as its float), bools, strings, lists of those, and
`drafter`, the `DSpineConfig` overrides (each key a `DSpineConfig` field, each value of that
field's type; shapes come from the target). Unknown keys raise `TrainConfigError` naming the key
and the valid ones. Packaged configs (`dspine/train/configs/*.yaml`) are found by name
(`smollm2-dspine`) through `importlib.resources`; anything else is a path. Overrides are
`section.field=value` strings whose value is read as YAML (`lr=3e-4`, `drafter.injection_top_k=16`).
Defaults are the values the packaged configs ship with.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dspine.model.config import DSpineConfig


class TrainConfigError(ValueError):
    """A training config (file, field or override) is invalid; the message names it and the fix."""


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def coerce(value, hint, where: str):
    """`value` checked against type `hint` (float accepts ints and numeric strings); the checked
    value, or TrainConfigError naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], where)
    elif origin is list:
        if not isinstance(value, list):
            raise TrainConfigError(f"{where} = {value!r}: expected a list of {_type_name(args[0])}")
        return [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint in (bool, str, dict):
        if isinstance(value, hint):
            return value
    else:
        raise TypeError(f"{where}: no check for annotation {hint!r}")
    raise TrainConfigError(f"{where} = {value!r}: expected {_type_name(hint)}")


def _check_fields(cls, values: dict, where: str) -> dict:
    """`values` with every key a field of dataclass `cls` and every value coerced to its type."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise TrainConfigError(f"{where + ': ' if where else ''}unknown key(s) {unknown}; valid keys: {', '.join(names)}")
    return {k: coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in values.items()}


@dataclass
class TrainConfig:
    """A training run. `drafter` holds DSpineConfig overrides (shapes come from the target)."""

    data: str
    run_dir: str
    target: str | None = None
    drafter: dict = field(default_factory=dict)
    # A drafter checkpoint folder (or hub id) whose weights start the run instead of a random init
    # (`dspine.train.init_from`): same target, same weight shapes; fresh optimizer and schedule.
    init_from: str | None = None
    seed: int = 0
    steps: int = 2000
    batch_size: int = 32
    blocks_per_seq: int = 16
    max_len: int = 768
    lr: float = 6e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 60
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    position_decay: float = 7.0
    confidence_weight: float = 0.1
    # Weight of a distillation term on the final logits: KL from the target's whole next-token
    # distribution (its lm_head on its last states, so the target runs all its layers), beside the CE
    # on its one token. 0: off.
    distill_weight: float = 0.0
    heldout_sequences: int = 64
    eval_every: int = 500
    save_every: int = 250
    log_every: int = 10
    export_shard_bytes: int = 15 << 20
    # Throughput (docs/training.md): micro-batches of batch_size sequences per optimisation step,
    # torch.compile of the draft layers and of the chunked vocabulary loss, and whether attention
    # may use cuDNN's kernels (each call costs milliseconds of host time; off: flash/efficient).
    grad_accum_steps: int = 1
    compile: bool = False
    # torch.compile of the frozen target's decoder layers (forward only, dynamic shapes) on CUDA.
    compile_target: bool = False
    cudnn_attention: bool = False
    # The draft layers' attention as block-sparse FlexAttention (compiled on CUDA): only the key tiles
    # a query tile's windows and own slots meet are computed, and no dense mask is built. Slower than
    # the dense mask at SmolLM2's shape on an H100, but 5 GiB lighter (docs/training.md): off.
    flex_attention: bool = False
    # The layer-wise losses (5 of the 7 vocabulary-sized ones) on this fraction of each micro-batch's
    # blocks, drawn at random and reweighted: the same expected loss for less work.
    layer_loss_fraction: float = 1.0
    # Sequences drawn in runs of length_group_batches × batch_size, each run sorted by length, so a
    # batch pads to a length near its own (0: no grouping). Pays where lengths spread widely.
    length_group_batches: int = 0

    def __post_init__(self) -> None:
        checked = _check_fields(type(self), dataclasses.asdict(self), "")
        checked["drafter"] = _check_fields(DSpineConfig, checked["drafter"], "drafter")
        for name, value in checked.items():
            setattr(self, name, value)
        for name in ("steps", "batch_size", "blocks_per_seq", "max_len", "eval_every", "save_every", "log_every",
                     "export_shard_bytes", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"{name} = {getattr(self, name)}: must be >= 1")
        for name in ("heldout_sequences", "warmup_steps", "weight_decay", "confidence_weight", "length_group_batches",
                     "distill_weight"):
            if getattr(self, name) < 0:
                raise TrainConfigError(f"{name} = {getattr(self, name)}: must be >= 0")
        for name, example in (("lr", "6e-4"), ("grad_clip", "1.0"), ("position_decay", "7.0")):
            if getattr(self, name) <= 0:
                raise TrainConfigError(f"{name} = {getattr(self, name)}: must be > 0 (e.g. {example})")
        if not 0 < self.layer_loss_fraction <= 1:
            raise TrainConfigError(f"layer_loss_fraction = {self.layer_loss_fraction}: must be in (0, 1] (e.g. 0.25)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TrainConfigError(f"min_lr_ratio = {self.min_lr_ratio}: must be in [0, 1] (e.g. 0.05)")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] = (), **fields) -> "TrainConfig":
        """The config in YAML file `path` (or packaged config name), then `fields` (None = keep the
        file's), then `section.field=value` `overrides`."""
        path = config_path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError) as exc:
            raise TrainConfigError(f"{path}: cannot be read as a UTF-8 YAML file ({exc})") from None
        except yaml.YAMLError as exc:
            raise TrainConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise TrainConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
        data.update({k: v for k, v in fields.items() if v is not None})
        for item in overrides:
            apply_override(data, item)
        try:
            return cls(**_check_fields(cls, data, ""))
        except TrainConfigError as exc:
            raise TrainConfigError(f"{path}: {exc}") from None
        except TypeError as exc:  # a required key (data, run_dir) is missing
            raise TrainConfigError(f"{path}: {exc}; give it in the file or on the command line") from None


def apply_override(data: dict, item: str) -> None:
    """Apply one `key=value` or `section.key=value` override (value read as YAML) to `data`."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise TrainConfigError(f"override {item!r}: expected KEY=VALUE or SECTION.KEY=VALUE, e.g. lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or exc
        raise TrainConfigError(f"override {item!r}: the value is not valid YAML ({problem}); give a YAML value, "
                               f"e.g. lr=3e-4 or drafter.selection=argmax") from None
    section, dot, name = key.partition(".")
    if not dot:
        data[key] = value
        return
    if section != "drafter":
        raise TrainConfigError(f"override {item!r}: the only section is `drafter` (e.g. drafter.injection_top_k=16)")
    data["drafter"] = {**(data.get("drafter") or {}), name: value}


def packaged_configs() -> list[str]:
    """Names of the training configs inside the package (`smollm2-dspine`, ...)."""
    folder = importlib.resources.files("dspine.train") / "configs"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def config_path(spec: str | os.PathLike) -> Path:
    """A config file: `spec` as a path when one exists, else the packaged config of that name."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    name = str(spec).removesuffix(".yaml")
    if name in packaged_configs():
        return Path(str(importlib.resources.files("dspine.train") / "configs" / f"{name}.yaml"))
    raise TrainConfigError(f"training config {str(spec)!r} is neither a file nor a packaged config; "
                           f"give a YAML path or one of {', '.join(packaged_configs())}")
