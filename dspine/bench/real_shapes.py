"""Serving folders for the published shapes without their checkpoints: configs SGLang builds with
dummy weights (`--load-format dummy --speculative-draft-load-format dummy`), so a Qwen3-8B or a
Qwen3.8-27B server, with a DSpine or a DFlash drafter of the published drafter shape, starts on a
host that has no hub access.

  python scripts/make_real_shape_dirs.py TOKENIZER_DIR OUT_DIR [--shapes qwen3-8b,qwen3.8-27b]

writes, per shape (`dspine.engine.targets.RANDOM_SHAPES`):
  OUT_DIR/<shape>/target   config.json of the target (Qwen3ForCausalLM; Qwen3.8-27B as its text model,
                           Qwen3_5ForCausalLM: the hybrid Gated-DeltaNet layout) and the tokenizer
                           files of TOKENIZER_DIR (any tokenizer whose ids fit the target's vocabulary,
                           e.g. a Qwen2.5 folder; the answers of dummy weights are noise anyway);
  OUT_DIR/<shape>/dspine   config.json of the published DSpine drafter: the packaged training
                           config's drafter block for that target (`DSpineConfig.for_target`, as
                           `dspine train` builds it; 5 layers, block 16), no weights;
  OUT_DIR/<shape>/dflash   config.json of SGLang's own DFlash drafter of the same shapes (same layers,
                           captured target layers, window and block), for DSPINE-vs-DFLASH rounds.

Every config is checked before anything is written: the drafter against the target
(`checkpoint.check_target_compatible`), the tokenizer against the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from dspine.engine.targets import RANDOM_MASK_TOKENS, RANDOM_SHAPES, random_target_config
from dspine.model.checkpoint import check_target_compatible, hf_config
from dspine.model.config import DSpineConfig
from dspine.train.config import TrainConfig
from dspine.utils.atomic import write_json_atomic

TRAIN_CONFIGS = {"qwen3-8b": "qwen3-8b-dspine", "qwen3.8-27b": "qwen3.8-27b-dspine"}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")


class ShapeError(ValueError):
    """A folder cannot be written as asked; the message names the input and the fix."""


def target_config(shape: str) -> dict:
    """config.json of the target of `shape`: the known shape's fields and its architecture."""
    config = random_target_config(f"random:{shape}").to_dict()
    config["architectures"] = [ARCHITECTURES[config["model_type"]]]
    if "layer_types" in config and "linear_attention" in config["layer_types"]:
        # SGLang 0.5.17's Qwen3.5 layout reads the interleave as `full_attention_interval`, not `layer_types`
        config["full_attention_interval"] = config["layer_types"].index("full_attention") + 1
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    return config


def drafter_config(shape: str) -> DSpineConfig:
    """The published DSpine drafter of `shape`: the packaged training config's drafter block."""
    train = TrainConfig.from_yaml(TRAIN_CONFIGS[shape])
    return DSpineConfig.for_target(random_target_config(f"random:{shape}"), mask_token_id=RANDOM_MASK_TOKENS[shape],
                                   **train.drafter)


def dflash_config(cfg: DSpineConfig) -> dict:
    """config.json of SGLang's `DFlashDraftModel` with `cfg`'s shapes (DSpine's own fields dropped)."""
    config = hf_config(cfg, "bfloat16")
    config.pop("dspine_config")
    config["architectures"] = ["DFlashDraftModel"]
    return config


def tokenizer_files(tokenizer_dir: Path, vocab_size: int) -> list[Path]:
    """TOKENIZER_DIR's tokenizer files; ShapeError when it has none or its ids overflow `vocab_size`."""
    files = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not any(f.name == "tokenizer.json" for f in files):
        raise ShapeError(f"{tokenizer_dir} has no tokenizer.json. Fix: pass a Hugging Face model folder "
                         "(e.g. a Qwen2.5 checkpoint's) as TOKENIZER_DIR")
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = list(tokenizer.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in tokenizer.get("added_tokens", [])]
    if ids and max(ids) >= vocab_size:
        raise ShapeError(f"{tokenizer_dir}'s tokenizer has ids up to {max(ids)}, past the target's vocabulary "
                         f"{vocab_size}. Fix: use a tokenizer of at most {vocab_size} ids")
    return files


def write_shape(shape: str, tokenizer_dir: Path, out_dir: Path) -> Path:
    """OUT_DIR/<shape>/{target,dspine,dflash} (see the module docstring); returns OUT_DIR/<shape>."""
    if shape not in TRAIN_CONFIGS:
        raise ShapeError(f"unknown shape {shape!r}: one of {', '.join(TRAIN_CONFIGS)}")
    target = target_config(shape)
    cfg = drafter_config(shape)
    check_target_compatible(cfg, random_target_config(f"random:{shape}"))
    files = tokenizer_files(tokenizer_dir, target["vocab_size"])
    root = out_dir / shape
    for name in ("target", "dspine", "dflash"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, root / "target" / f.name)
    write_json_atomic(root / "target" / "config.json", target, indent=1)
    write_json_atomic(root / "dspine" / "config.json", hf_config(cfg, "bfloat16"), indent=1)
    write_json_atomic(root / "dflash" / "config.json", dflash_config(cfg), indent=1)
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Write dummy-weight serving folders (target, DSpine drafter, DFlash drafter) of the "
                    "published shapes.",
        epilog="Then, e.g.: sglang serve --model-path OUT/qwen3-8b/target --load-format dummy "
               "--speculative-algorithm DSPINE --speculative-draft-model-path OUT/qwen3-8b/dspine "
               "--speculative-draft-load-format dummy --speculative-num-draft-tokens 16")
    p.add_argument("tokenizer_dir", type=Path, help="a model folder whose tokenizer files the targets get")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shapes", type=lambda s: s.split(","), default=list(TRAIN_CONFIGS),
                   help="comma-separated subset of " + ",".join(TRAIN_CONFIGS))
    args = p.parse_args(argv)
    try:
        for shape in args.shapes:
            root = write_shape(shape, args.tokenizer_dir, args.out_dir)
            print(f"{shape}: {root}/target, {root}/dspine, {root}/dflash")
    except ShapeError as exc:
        print(f"make_real_shape_dirs: {exc}", file=sys.stderr)
        return 2
    return 0
