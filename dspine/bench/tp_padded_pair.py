"""Write function-identical copies of a target and its DSpine drafter with TP-divisible head counts.

Purpose: test SGLang's tensor parallelism with DSPINE. `--tp-size 2` shards every attention
layer by heads, so it needs the query and KV head counts divisible by 2; the default target
SmolLM2-135M-Instruct (and its drafter) has 9 query / 3 KV heads, so neither can be sharded. This
module pads both models with heads that contribute exactly nothing, so a TP=2 server runs a really
sharded target with a drafter that really accepts tokens, and its outputs stay those of the original
pair (up to floating-point rounding).

  python3 scripts/make_tp_padded_pair.py TARGET_DIR DRAFTER_DIR OUT_DIR [--tp 2] [--force]

  TARGET_DIR   a Hugging Face Llama/Qwen-style folder (config.json, *.safetensors, sharded or not,
               tokenizer files, chat template, generation_config.json), e.g. the SmolLM2 folder
               (python -c 'from dspine.engine.targets import smollm2_dir; print(smollm2_dir())');
  DRAFTER_DIR  a DSpine checkpoint for that target (e.g. dspine/checkpoints/dspine-smollm2-135m-instruct).

writes
  OUT_DIR/target   config.json with the padded num_attention_heads / num_key_value_heads and an
                   explicit head_dim, the safetensors (same file names, same index, same dtype) with
                   the padded `layers.{i}.self_attn.{q,k,v,o}_proj` tensors and every other tensor
                   byte-identical, and every other file of TARGET_DIR unchanged;
  OUT_DIR/drafter  the drafter re-saved with dspine's checkpoint writer: padded attention, both
                   config blocks (`dspine_config` and the HF-style mirror) updated, same dtype; copy
                   candidates off (they run at tensor parallel size 1).

Then serve, e.g. `python -m sglang.launch_server --model-path OUT_DIR/target --tp-size 2
--speculative-algorithm DSPINE --speculative-draft-model-path OUT_DIR/drafter ...`.

Padding rule (keeps grouped-query attention's grouping): with g = heads / kv_heads query heads per
KV head, kv_pad = ceil(kv_heads / tp) * tp and q_pad = kv_pad * g (SmolLM2, tp 2: 9/3 -> 12/4).
Query head j reads KV head j // g (HF's repeat_kv, SGLang's per-rank slicing), so appending the new
heads after the real ones keeps every real query head on its own KV head (0..8 -> 0..2) and puts the
added query heads (9..11) on the added KV head (3). The added KV heads get zero k/v weights (and
biases), the added query heads zero q weights and zero o_proj input columns: their attention output
is the mean of zero values, multiplied by zero columns, so the residual stream is unchanged. head_dim
stays (written explicitly: hidden / q_pad no longer gives it; SGLang's llama.py and dflash.py read
`config.head_dim` first). Qwen3-style q_norm/k_norm are per dimension, shared by all heads:
unchanged. When tp already divides both counts, the model is copied unchanged.

The output is built in a temporary directory beside OUT_DIR and renamed into place: a failure leaves
nothing half-written. An existing OUT_DIR is replaced only with --force.

Needs torch, safetensors and dspine (no transformers, no network).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# `...layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`, any prefix (`model.` for HF targets, none for DSpine).
ATTENTION_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)$")
# Weights in formats this module does not rewrite: never copied, so no loader can pick unpadded weights.
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
MADE_BY = "dspine.bench.tp_padded_pair"


class PadError(ValueError):
    """An input this module cannot pad; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# Head layout
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadLayout:
    """Attention heads before padding, and the tensor-parallel size to pad for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp: int

    @property
    def groups(self) -> int:
        """g: query heads per KV head (kept by the padding)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_padded(self) -> int:
        return math.ceil(self.num_kv_heads / self.tp) * self.tp

    @property
    def q_padded(self) -> int:
        return self.kv_padded * self.groups

    @property
    def needs_padding(self) -> bool:
        return self.kv_padded != self.num_kv_heads

    def describe(self) -> str:
        before = f"{self.num_heads} q / {self.num_kv_heads} kv heads (head_dim {self.head_dim})"
        if not self.needs_padding:
            return f"{before}: already divisible by tp {self.tp}, copied unchanged"
        return f"{before} -> {self.q_padded} q / {self.kv_padded} kv heads for tp {self.tp}"


def head_layout(num_heads: int, num_kv_heads: int | None, head_dim: int | None, hidden_size: int | None,
                tp: int, where: str) -> HeadLayout:
    """Validated layout. num_kv_heads None: multi-head attention (= num_heads); head_dim None: derived
    as hidden_size / num_heads, which must divide evenly."""
    if tp < 1:
        raise PadError(f"--tp {tp}: the tensor-parallel size must be a positive integer")
    num_kv_heads = num_kv_heads or num_heads
    if num_heads <= 0 or num_kv_heads <= 0:
        raise PadError(f"{where}: num_attention_heads = {num_heads}, num_key_value_heads = {num_kv_heads}: "
                       "both must be positive")
    if num_heads % num_kv_heads:
        raise PadError(f"{where}: num_attention_heads = {num_heads} is not a multiple of num_key_value_heads = "
                       f"{num_kv_heads}, so query heads have no fixed KV head to keep (not grouped-query "
                       "attention). make_tp_padded_pair cannot pad such a model; fix the config if it is wrong.")
    if head_dim is None:
        if not hidden_size or hidden_size % num_heads:
            raise PadError(f"{where}: no head_dim in the config and hidden_size = {hidden_size} is not a multiple "
                           f"of num_attention_heads = {num_heads}, so the head size cannot be derived. Add the "
                           "model's true \"head_dim\" to its config.json.")
        head_dim = hidden_size // num_heads
    return HeadLayout(num_heads, num_kv_heads, int(head_dim), tp)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

def append_zero_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[R, ...] -> [R + rows, ...], the new rows zero, same dtype."""
    return torch.cat([t, t.new_zeros((rows, *t.shape[1:]))], dim=0)


def append_zero_columns(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[R, C] -> [R, C + cols], the new columns zero, same dtype."""
    return torch.cat([t, t.new_zeros((t.shape[0], cols))], dim=1)


def attention_layers(names) -> dict[str, set[int]]:
    """Layer indices holding each of q/k/v/o_proj.weight among tensor `names`."""
    found: dict[str, set[int]] = {p: set() for p in "qkvo"}
    for name in names:
        m = ATTENTION_TENSOR.search(name)
        if m and m.group(3) == "weight":
            found[m.group(2)].add(int(m.group(1)))
    return found


def check_attention_coverage(names, num_layers: int, where: str) -> None:
    """Raise unless every layer 0..num_layers-1 has q/k/v/o_proj weights (fused qkv or renamed
    projections would otherwise be left unpadded)."""
    found = attention_layers(names)
    want = set(range(num_layers))
    bad = {f"{p}_proj": sorted(want - found[p])[:8] for p in "qkvo" if found[p] != want}
    if bad:
        raise PadError(f"{where}: expected `layers.{{i}}.self_attn.{{q,k,v,o}}_proj.weight` for all {num_layers} "
                       f"layers; missing or extra for {bad}. Fused (qkv_proj) or renamed attention weights are not "
                       "supported: convert the checkpoint to separate q/k/v/o projections first.")


def pad_attention_weights(state: dict[str, torch.Tensor], layout: HeadLayout,
                          where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """A new dict: every `layers.{i}.self_attn.{q,k,v,o}_proj` tensor padded, every other tensor the
    same object.

    With d = head_dim, H = hidden size, nq/nkv before and Q/KV after padding:
      q_proj.weight [nq*d, H] -> [Q*d, H]     q_proj.bias [nq*d] -> [Q*d]    (zero rows appended)
      k/v_proj.weight [nkv*d, H] -> [KV*d, H] k/v_proj.bias [nkv*d] -> [KV*d] (zero rows appended)
      o_proj.weight [H, nq*d] -> [H, Q*d]     (zero input columns appended; o_proj.bias unchanged)
    Appending keeps query head j on KV head j // g for the real heads (see the module docstring).
    Raises PadError when a tensor's shape does not match the layout (e.g. a gated q_proj).
    """
    d = layout.head_dim
    sizes = {"q": (layout.num_heads * d, layout.q_padded * d), "k": (layout.num_kv_heads * d, layout.kv_padded * d),
             "v": (layout.num_kv_heads * d, layout.kv_padded * d), "o": (layout.num_heads * d, layout.q_padded * d)}
    out = dict(state)
    for name, t in state.items():
        m = ATTENTION_TENSOR.search(name)
        if m is None or (m.group(2) == "o" and m.group(3) == "bias"):
            continue
        before, after = sizes[m.group(2)]
        axis = 1 if m.group(2) == "o" else 0
        if t.dim() <= axis or t.shape[axis] != before:
            raise PadError(f"{where}: tensor {name} has shape {tuple(t.shape)}, but {layout.num_heads} q / "
                           f"{layout.num_kv_heads} kv heads of size {d} imply {before} along dim {axis}. The config's "
                           "head counts or head_dim do not describe these weights (or q_proj also holds a gate, as "
                           "in Qwen3-Next): not supported.")
        out[name] = append_zero_columns(t, after - before) if axis else append_zero_rows(t, after - before)
    return out


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def safetensors_files(model_dir: Path) -> list[str]:
    """Names of the weight files: the index's shards, else every top-level *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [n for n in names if not (model_dir / n).is_file()]
        if absent:
            raise PadError(f"{model_dir}: shards {absent} listed in {INDEX_FILE} are missing; re-download the model")
        return names
    names = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not names:
        raise PadError(f"{model_dir} has no *.safetensors weights (only safetensors are rewritten): convert the "
                       "checkpoint first, e.g. load it with transformers and save_pretrained(safe_serialization=True)")
    return names


def copy_other_files(src: Path, dst: Path, skip: set[str]) -> tuple[list[str], list[str]]:
    """Copy the top-level files of src not in `skip` into dst. Returns (copied, left out): other
    weight formats and subdirectories are left out, so no unpadded weights travel along."""
    copied, left_out = [], []
    for p in sorted(src.iterdir()):
        if p.name in skip:
            continue
        if p.is_dir() or p.suffix in OTHER_WEIGHT_SUFFIXES or p.name.endswith(".safetensors"):
            left_out.append(p.name + ("/" if p.is_dir() else ""))
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied, left_out


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise PadError(f"{path.parent} has no {path.name}: not a model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PadError(f"{path} is not valid JSON (line {exc.lineno}): {exc.msg}") from exc


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------

def target_layout(config: dict, tp: int, where: str) -> HeadLayout:
    """The head layout of a Hugging Face config.json (top-level keys; nested text_config is not read)."""
    if "num_attention_heads" not in config:
        raise PadError(f"{where}: config.json has no top-level num_attention_heads (a multimodal config with a "
                       "nested text_config?): pass a plain Llama/Qwen-style causal LM folder")
    return head_layout(int(config["num_attention_heads"]), config.get("num_key_value_heads"),
                       config.get("head_dim"), config.get("hidden_size"), tp, where)


def padded_target_config(config: dict, layout: HeadLayout) -> dict:
    """config.json with the padded head counts, an explicit head_dim and a provenance note."""
    out = dict(config)
    out.update(num_attention_heads=layout.q_padded, num_key_value_heads=layout.kv_padded, head_dim=layout.head_dim)
    out["dspine_tp_padding"] = {"tp": layout.tp, "num_attention_heads": layout.num_heads,
                                "num_key_value_heads": layout.num_kv_heads, "made_by": MADE_BY}
    return out


def pad_target_dir(src: Path, dst: Path, tp: int = 2) -> dict:
    """Write the padded copy of the HF model folder `src` to the new directory `dst`.

    Weight files keep their names (and the index its weight_map; total_size is recomputed); inside
    them only the attention projections change. Returns a summary for printing.
    """
    src, dst = Path(src), Path(dst)
    config = read_json(src / CONFIG_FILE)
    layout = target_layout(config, tp, str(src))
    summary = {"dir": str(dst), "layout": layout, "architecture": (config.get("architectures") or ["?"])[0]}
    if not layout.needs_padding:
        shutil.copytree(src, dst)
        return summary | {"padded_tensors": 0, "copied": sorted(p.name for p in src.iterdir()), "left_out": []}
    files = safetensors_files(src)
    names = []
    for name in files:
        with safe_open(str(src / name), framework="pt") as f:
            names += list(f.keys())
    check_attention_coverage(names, int(config["num_hidden_layers"]), str(src))
    dst.mkdir(parents=True)
    padded, total_bytes = 0, 0
    for name in files:
        with safe_open(str(src / name), framework="pt") as f:
            metadata, keys = f.metadata(), f.keys()
            tensors = {k: f.get_tensor(k) for k in keys}
        new = pad_attention_weights(tensors, layout, where=f"{src / name}")
        padded += sum(new[k] is not tensors[k] for k in tensors)
        total_bytes += sum(t.numel() * t.element_size() for t in new.values())
        save_file(new, str(dst / name), metadata=metadata)
    if (src / INDEX_FILE).is_file():
        index = json.loads((src / INDEX_FILE).read_text())
        index["metadata"] = dict(index.get("metadata") or {}, total_size=total_bytes)
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (dst / CONFIG_FILE).write_text(json.dumps(padded_target_config(config, layout), indent=2) + "\n")
    copied, left_out = copy_other_files(src, dst, {CONFIG_FILE, INDEX_FILE, *files})
    return summary | {"padded_tensors": padded, "copied": copied, "left_out": left_out}


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------

def without_copy_candidates(config_file: Path) -> None:
    """Turn a copied drafter's copy candidates off: they run at tensor parallel size 1 only (the copy
    path scores the whole vocabulary through the unsharded head); the written config says so rather
    than leaving the worker to drop them at `--tp-size` > 1."""
    raw = read_json(config_file)
    if raw.get("dspine_config", {}).get("copy_candidates"):
        raw["dspine_config"]["copy_candidates"] = False
        config_file.write_text(json.dumps(raw, indent=2) + "\n")


def pad_drafter_dir(src: Path, dst: Path, tp: int = 2) -> dict:
    """Write the padded copy of the DSpine checkpoint `src` to the new directory `dst`.

    Loads it with `load_checkpoint` (strict: names, shapes, dtype), builds a `DSpineDrafter` with
    the padded config, loads the padded weights strictly and saves with `save_checkpoint` in the
    source dtype, with the source's shard size and extra config keys (e.g. `dspine_training`).
    Returns a summary for printing.
    """
    from dspine.model.checkpoint import (
        hf_config,
        load_checkpoint,
        read_config,
        save_checkpoint,
    )
    from dspine.model.drafter import DSpineDrafter

    src, dst = Path(src), Path(dst)
    cfg = read_config(src)
    layout = head_layout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, tp,
                         str(src))
    summary = {"dir": str(dst), "layout": layout, "architecture": "DSpineDraftModel"}
    if not layout.needs_padding:
        shutil.copytree(src, dst)
        without_copy_candidates(dst / CONFIG_FILE)
        return summary | {"padded_tensors": 0, "copied": sorted(p.name for p in src.iterdir()), "left_out": []}
    raw = read_json(src / CONFIG_FILE)
    model = load_checkpoint(src)  # in the checkpoint's own dtype
    dtype = next(model.parameters()).dtype
    state = model.state_dict()
    check_attention_coverage(state, cfg.num_hidden_layers, str(src))
    new_state = pad_attention_weights(state, layout, where=str(src))
    new_cfg = cfg.replace(num_attention_heads=layout.q_padded, num_key_value_heads=layout.kv_padded,
                          head_dim=layout.head_dim, copy_candidates=False)   # see without_copy_candidates
    new_model = DSpineDrafter(new_cfg)
    new_model.load_state_dict(new_state, strict=True)
    files = safetensors_files(src)
    extra = {k: v for k, v in raw.items() if k not in hf_config(cfg, "float32")}
    extra["dspine_tp_padding"] = {"tp": tp, "num_attention_heads": layout.num_heads,
                                  "num_key_value_heads": layout.num_kv_heads, "made_by": MADE_BY}
    shard_bytes = max((src / f).stat().st_size for f in files) if len(files) > 1 else 2 << 30
    save_checkpoint(new_model, dst, dtype=dtype, max_shard_bytes=shard_bytes, extra_config=extra)
    copied, left_out = copy_other_files(src, dst, {CONFIG_FILE, INDEX_FILE, *files})
    padded = sum(new_state[k] is not state[k] for k in state)
    return summary | {"padded_tensors": padded, "copied": copied, "left_out": left_out}


# ---------------------------------------------------------------------------------------------
# The pair
# ---------------------------------------------------------------------------------------------

def check_pair(target_dir: Path, drafter_dir: Path) -> None:
    """Raise PadError unless the drafter was built for this target (vocab, hidden size, layers)."""
    from dspine.model.checkpoint import CheckpointError, check_target_compatible, read_config

    config = read_json(target_dir / CONFIG_FILE)
    try:
        check_target_compatible(read_config(drafter_dir), SimpleNamespace(**config))
    except (CheckpointError, AttributeError) as exc:
        raise PadError(f"{drafter_dir} does not fit the target {target_dir}: {exc}") from exc


def check_out_dir(out: Path, inputs: list[Path], force: bool) -> None:
    """Refuse an existing OUT_DIR without --force, and an OUT_DIR that is or holds an input."""
    out_r = out.resolve()
    for p in inputs:
        p_r = p.resolve()
        if p_r == out_r or out_r in p_r.parents:
            raise PadError(f"OUT_DIR {out} is or contains the input {p}: pick a new directory")
    if out.exists() and not force:
        raise PadError(f"OUT_DIR {out} exists: pass --force to replace it, or pick a new directory")


def make_pair(target_dir: Path, drafter_dir: Path, out: Path, tp: int = 2, force: bool = False) -> dict:
    """Write OUT/target and OUT/drafter atomically (temp dir beside OUT, then rename). Returns the
    two summaries, keyed "target" and "drafter"."""
    target_dir, drafter_dir, out = Path(target_dir), Path(drafter_dir), Path(out)
    for p, what in ((target_dir, "TARGET_DIR"), (drafter_dir, "DRAFTER_DIR")):
        if not p.is_dir():
            raise PadError(f"{what} {p} is not a directory")
    check_out_dir(out, [target_dir, drafter_dir], force)
    check_pair(target_dir, drafter_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        summaries = {"target": pad_target_dir(target_dir, tmp / "target", tp),
                     "drafter": pad_drafter_dir(drafter_dir, tmp / "drafter", tp)}
        from dspine.model.checkpoint import install_dir

        install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for s in summaries.values():
        s["dir"] = s["dir"].replace(str(tmp), str(out), 1)
    return summaries


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target_dir", type=Path, help="HF Llama/Qwen-style model folder (safetensors)")
    p.add_argument("drafter_dir", type=Path, help="DSpine drafter checkpoint for that target")
    p.add_argument("out_dir", type=Path, help="writes OUT_DIR/target and OUT_DIR/drafter")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size the head counts must divide (default 2)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from dspine.model.checkpoint import CheckpointError
    from dspine.model.config import ConfigError

    args = parse_args(argv)
    try:
        summaries = make_pair(args.target_dir, args.drafter_dir, args.out_dir, args.tp, args.force)
    except (PadError, CheckpointError, ConfigError) as e:
        print(f"make_tp_padded_pair: {e}", file=sys.stderr)
        return 2
    for role, s in summaries.items():
        print(f"{role}: {s['dir']} ({s['architecture']}): {s['layout'].describe()}; "
              f"{s['padded_tensors']} attention tensors padded")
        print(f"  copied: {', '.join(s['copied']) or '-'}")
        if s["left_out"]:
            print(f"  left out (not rewritten, would hold unpadded weights): {', '.join(s['left_out'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
