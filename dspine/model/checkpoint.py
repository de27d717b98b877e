"""DSpine checkpoints: a Hugging Face-style directory, validated strictly.

Layout: `config.json` (`architectures: ["DSpineDraftModel"]`, Qwen3-style top-level shape keys so
transformers and SGLang parse it, and a `dspine_config` block holding every `DSpineConfig` field)
plus `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json` when larger than `max_shard_bytes` (huggingface_hub's writer), a
model card `README.md` with hub front matter, and optionally the target's identity
(`dspine_target`). A checkpoint resolves from a local directory or a hub id
(`huggingface_hub.snapshot_download`, local cache first).

Saving writes into a temporary sibling directory and renames it into place, so an interrupted
save leaves nothing half-written. Loading checks the config, the target's compatibility, then the
weight files from their headers alone (`check_weights`, also what `dspine info` runs): each file
readable and exactly as long as its header says, every tensor name, dtype and shape as the config
implies; it raises a `CheckpointError` subclass naming the file or field and the fix.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import SafetensorError, safe_open

from dspine import env
from dspine.model.card import model_card
from dspine.model.config import ConfigError, DSpineConfig, text_config
from dspine.model.drafter import DSpineDrafter

ARCHITECTURE = "DSpineDraftModel"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class CheckpointError(ValueError):
    """A drafter checkpoint cannot be used; the message names the problem and the fix."""


class MissingTensorsError(CheckpointError):
    pass


class UnexpectedTensorsError(CheckpointError):
    pass


class TensorMismatchError(CheckpointError):
    """A tensor's dtype or shape differs from what the config implies."""


class IncompatibleTargetError(CheckpointError):
    """The drafter was built for a different target (vocab, hidden size, layers, mask id)."""


def save_checkpoint(model: DSpineDrafter, path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                    max_shard_bytes: int | str = "5GB", extra_config: dict | None = None,
                    target: dict | None = None, card: dict | None = None) -> Path:
    """Write `model` to directory `path` (replaced atomically if it exists). Returns the path.

    Shards through huggingface_hub's writer (`max_shard_bytes`, default 5 GB per file). `target`:
    the target's identity (`dspine.engine.targets.target_identity`), stored as `dspine_target` and
    checked at load time; `card`: the model card's training record (`dspine.model.card.CARD_FIELDS`)."""
    path = Path(path)
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    config = hf_config(model.config, dtype_name, extra_config)
    if target is not None:
        config["dspine_target"] = dict(target)
    readme = model_card(path.name, model.config, target=target, card=card)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(readme)
        save_torch_state_dict(state, tmp, max_shard_size=max_shard_bytes)
        install_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def install_dir(tmp: Path, path: Path) -> None:
    """Move the finished directory `tmp` to `path` (a sibling), replacing what is there: renames
    only, so `path` never holds a half-written tree."""
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


def hf_config(cfg: DSpineConfig, dtype_name: str, extra: dict | None = None) -> dict:
    """config.json contents: Qwen3-style shape keys, dtype and draft window (for transformers and
    SGLang), the `dflash_config` mirror SGLang reads, and `dspine_config` (the source of truth)."""
    data = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,  # the name transformers < 4.56 and older readers use
        "num_target_layers": cfg.num_target_layers,
        # Every layer full attention over what the draft cache holds and bidirectional within the
        # block (SGLang's DFlash: ENCODER_ONLY). The context window is not a layer type: SGLang
        # applies it with its compact draft cache (--speculative-draft-window-size, which DSPINE
        # sets from dspine_config.sliding_window); `sliding_window` records it for other readers.
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": False,
        "is_causal": False,
        "block_size": cfg.block_size,
        "dflash_config": dflash_config_for(cfg),
        "dspine_config": cfg.to_dict(),
    }
    data.update(extra or {})
    return data


def dflash_config_for(cfg: DSpineConfig) -> dict:
    """The `dflash_config` mirror SGLang's DFlash machinery reads (target-layer capture, `fc` width,
    mask id, block size); `dspine_config` stays the source of truth."""
    return {"block_size": cfg.block_size, "target_layer_ids": list(cfg.target_layer_ids),
            "num_target_layers": cfg.num_target_layers, "mask_token_id": cfg.mask_token_id}


DEFAULT_DRAFTER_NAME = "dspine-smollm2-135m-instruct"


def default_drafter_dir() -> Path:
    """The drafter for the default target: `$DSPINE_DEFAULT_DRAFTER`, else the one inside the package
    (`dspine/checkpoints/dspine-smollm2-135m-instruct`, installed with the wheel). Raises
    `CheckpointError` naming the fix when neither holds a config: never falls back to random weights."""
    override = env.DSPINE_DEFAULT_DRAFTER.get()
    path = override or Path(str(importlib.resources.files("dspine") / "checkpoints" / DEFAULT_DRAFTER_NAME))
    if not (path / "config.json").is_file():
        where = "DSPINE_DEFAULT_DRAFTER" if override else "the installed package"
        raise CheckpointError(f"the default drafter is missing: {path} (from {where}) has no config.json. Fix: "
                              "reinstall dspine from a wheel or checkout that ships dspine/checkpoints/, point "
                              "DSPINE_DEFAULT_DRAFTER at a checkpoint folder, or pass --drafter PATH "
                              "(`--drafter random` for a random drafter).")
    return path


def resolve_checkpoint_dir(path_or_id: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub id fetched through huggingface_hub."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file: pass the checkpoint directory that holds config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), allow_patterns=["*.json", "*.safetensors", "*.md"]))
    except Exception as exc:  # offline, unknown repo, no access: all end here
        raise CheckpointError(f"drafter checkpoint {str(path_or_id)!r} is neither a local directory nor a reachable "
                              f"hub repo ({type(exc).__name__}: {exc}). Pass a local checkpoint directory (`dspine info` "
                              f"shows where the packaged default drafter lies).") from exc


def read_config(ckpt_dir: Path) -> DSpineConfig:
    cfg_file = ckpt_dir / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{ckpt_dir} has no config.json: not a DSpine checkpoint directory")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON (line {exc.lineno}): {exc.msg}") from exc
    arch = data.get("architectures") or []
    if ARCHITECTURE not in arch:
        raise CheckpointError(f"{cfg_file}: architectures = {arch}, expected [\"{ARCHITECTURE}\"]. This is not a "
                              f"DSpine drafter (a DFlash/EAGLE checkpoint needs its own loader).")
    if "dspine_config" not in data:
        raise CheckpointError(f"{cfg_file} has no `dspine_config` block: re-save the drafter with dspine")
    try:
        return DSpineConfig.from_dict(data["dspine_config"])
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{cfg_file}: {exc}") from exc


class CorruptWeightsError(CheckpointError):
    """A weight file or the shard index is missing, truncated or unreadable."""


def _refetch(what: str) -> str:
    return (f"{what}; re-download the checkpoint, or re-export it (`dspine train` writes RUN_DIR/checkpoint; "
            f"`dspine.model.checkpoint.save_checkpoint` from a model)")


def _open_weights(file: Path):
    """`safe_open(file)`: reads the header only, and checks the data it describes covers the file
    exactly (a truncated or padded file fails here); CorruptWeightsError naming `file` otherwise."""
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CorruptWeightsError(_refetch(f"{file}: not a readable safetensors file ({exc}): it is truncated "
                                           f"or corrupt")) from None


def _tensor_files(ckpt_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it (the index's `weight_map`, or every tensor of the single file)."""
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: ckpt_dir / f for name, f in weight_map.items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptWeightsError(_refetch(f"{index}: no readable `weight_map` ({type(exc).__name__}: "
                                               f"{exc})")) from None
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise CorruptWeightsError(_refetch(f"shard(s) {absent} listed in {index} are missing"))
        return files
    single = ckpt_dir / SINGLE_FILE
    if not single.is_file():
        raise CorruptWeightsError(_refetch(f"{ckpt_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}"))
    with _open_weights(single) as f:
        return dict.fromkeys(f.keys(), single)


def _saved_dtype(ckpt_dir: Path) -> tuple[str, torch.dtype]:
    """`(config.json key, dtype)` the checkpoint says its tensors are stored in (float32 when unnamed)."""
    data = json.loads((ckpt_dir / "config.json").read_text())
    key = "dtype" if "dtype" in data else "torch_dtype"
    return key, DTYPES.get(data.get(key, "float32"), torch.float32)


def expected_shapes(cfg: DSpineConfig) -> dict[str, tuple[int, ...]]:
    """tensor name -> shape of a `DSpineDrafter(cfg)` state dict (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in DSpineDrafter(cfg).state_dict().items()}


def check_weights(ckpt_dir: Path, cfg: DSpineConfig) -> dict[str, Path]:
    """Check the weight files of `ckpt_dir` against `cfg` from their headers (no tensor data is
    read): every file readable and exactly as long as its header says, every tensor the index lists
    present in its shard, every tensor `cfg` implies present with its shape and the config.json
    dtype, none other. Returns tensor name -> file; raises CheckpointError subclasses."""
    files = _tensor_files(ckpt_dir)
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(files))
    if missing:
        raise MissingTensorsError(f"{ckpt_dir}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}. "
                                  f"The checkpoint does not match its own dspine_config (e.g. saved with "
                                  f"injection=False but config says True): fix the config or re-save.")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise UnexpectedTensorsError(f"{ckpt_dir}: unexpected tensors {unexpected[:8]}"
                                     f"{' ...' if len(unexpected) > 8 else ''}: the weights belong to a different "
                                     f"drafter layout than its dspine_config describes")
    dtype_key, saved_dtype = _saved_dtype(ckpt_dir)
    for file in sorted(set(files.values())):
        with _open_weights(file) as f:
            held = set(f.keys())
            for name in sorted(n for n, where in files.items() if where == file):
                if name not in held:
                    raise CorruptWeightsError(_refetch(f"{ckpt_dir / INDEX_FILE} puts tensor {name} in {file}, "
                                                       f"which does not hold it"))
                tensor = f.get_slice(name)
                shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
                if shape != expected[name]:
                    raise TensorMismatchError(f"{ckpt_dir}: tensor {name} has shape {shape}, the config implies "
                                              f"{expected[name]}")
                if dtype != SAFETENSORS_DTYPES[saved_dtype]:
                    raise TensorMismatchError(f"{ckpt_dir}: tensor {name} is {dtype} in {file.name}, config.json "
                                              f"{dtype_key} says {saved_dtype}: re-save the checkpoint in one dtype")
    return files


def load_checkpoint(path_or_id: str | os.PathLike, *, target=None, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> DSpineDrafter:
    """Load a drafter; with `target` (a transformers causal LM) validate and attach it.

    dtype: compute dtype (default: the checkpoint's). Raises `CheckpointError` subclasses.
    """
    ckpt_dir = resolve_checkpoint_dir(path_or_id)
    cfg = read_config(ckpt_dir)
    if target is not None:
        saved_target = json.loads((ckpt_dir / "config.json").read_text()).get("dspine_target")
        check_target_compatible(cfg, target.config, saved_target=saved_target)
    files = check_weights(ckpt_dir, cfg)
    state = {}
    for file in sorted(set(files.values())):
        try:
            with _open_weights(file) as f:
                for name in (n for n, where in files.items() if where == file):
                    state[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CorruptWeightsError(_refetch(f"{file}: reading its tensors failed ({exc})")) from None
    model = DSpineDrafter(cfg)
    model.load_state_dict(state, strict=True)
    model.to(device=device, dtype=dtype or _saved_dtype(ckpt_dir)[1]).eval()
    if target is not None:
        model.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return model


def check_target_compatible(cfg: DSpineConfig, target_config, saved_target: dict | None = None) -> None:
    """Raise `IncompatibleTargetError` naming the first field that does not match the target; with
    `saved_target` (the checkpoint's `dspine_target`), also when its fingerprint differs from the
    target's (`dspine.engine.targets.target_identity`)."""
    tc = text_config(target_config)
    if saved_target and saved_target.get("fingerprint"):
        from dspine.engine.targets import IDENTITY_FIELDS, target_identity

        found = target_identity(tc)
        if found["fingerprint"] != saved_target["fingerprint"]:
            differ = {k: (saved_target.get(k), found.get(k)) for k in IDENTITY_FIELDS
                      if saved_target.get(k) != found.get(k)}
            raise IncompatibleTargetError(
                f"this drafter was trained for target {saved_target.get('name')!r} (fingerprint "
                f"{saved_target['fingerprint']}), the target given has fingerprint {found['fingerprint']} "
                f"(trained vs given: {differ}): load the target it was trained for, or train a drafter for "
                f"this one (`dspine train --target ...`)")
    checks = [
        ("vocab_size", cfg.vocab_size, tc.vocab_size),
        ("hidden_size", cfg.hidden_size, tc.hidden_size),
        ("num_target_layers", cfg.num_target_layers, tc.num_hidden_layers),
    ]
    for name, ours, theirs in checks:
        if ours != theirs:
            raise IncompatibleTargetError(f"dspine_config.{name} = {ours} but the target has {theirs}: this drafter "
                                          f"was trained for another target; train one for this target "
                                          f"(`dspine train`) or load the matching target")
    bad = [i for i in cfg.target_layer_ids if i >= tc.num_hidden_layers]
    if bad:
        raise IncompatibleTargetError(f"dspine_config.target_layer_ids {bad} exceed the target's "
                                      f"{tc.num_hidden_layers} layers")
    if cfg.mask_token_id >= tc.vocab_size:
        raise IncompatibleTargetError(f"dspine_config.mask_token_id = {cfg.mask_token_id} is outside the target "
                                      f"vocabulary ({tc.vocab_size})")
