"""Loading a DSpine checkpoint into `DSpineDraftModel`: config checks and strict weight mapping.

SGLang builds the draft model from `config.json` and feeds it `(name, tensor)` pairs; this module
checks that the two config blocks agree (`dspine_config_of`, `check_dflash_mirror`), maps every
checkpoint name onto SGLang's fused parameters (`map_weight_name`: q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`) and loads strictly (`load_strict`): it raises naming every unexpected
tensor and every parameter left unloaded (DFlash silently ignores unknown names).
"""

from __future__ import annotations

from typing import Iterable, Optional

from sglang.srt.model_loader.weight_utils import default_weight_loader
from torch import Tensor, nn

from dspine.model.checkpoint import MissingTensorsError, TensorMismatchError, UnexpectedTensorsError, dflash_config_for
from dspine.model.config import ConfigError, DSpineConfig
from dspine.sglang import compat

DFLASH_MIRRORED_KEYS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id")

# (SGLang parameter, checkpoint projection, shard id): SGLang fuses q/k/v and gate/up.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


# ------------------------------------------------------------------------------- config checks
def dspine_config_of(hf_config) -> DSpineConfig:
    """The `dspine_config` block of a draft `config.json` (as SGLang's HF config object)."""
    data = getattr(hf_config, "dspine_config", None)
    if not isinstance(data, dict):
        raise ConfigError("the draft config.json has no `dspine_config` block: "
                          "--speculative-draft-model-path must point at a DSpine checkpoint (re-save it with dspine)")
    return DSpineConfig.from_dict(dict(data))


def check_dflash_mirror(hf_config, cfg: DSpineConfig) -> None:
    """Raise unless `dflash_config` mirrors `dspine_config` (SGLang sizes `fc`, picks the target
    layers to capture and builds the mask block from `dflash_config`, never from `dspine_config`)."""
    mirror = getattr(hf_config, "dflash_config", None)
    want = dflash_config_for(cfg)
    fix = (f"add to config.json: \"dflash_config\": {want} (re-save the checkpoint with a dspine whose "
           f"checkpoint.hf_config writes it)")
    if not isinstance(mirror, dict):
        raise ConfigError(f"the draft config.json has no `dflash_config` block, so SGLang would capture other target "
                          f"layers and resolve the mask token through the tokenizer. Fix: {fix}")
    got = {k: mirror.get(k) for k in DFLASH_MIRRORED_KEYS}
    if got["target_layer_ids"] is not None:
        got["target_layer_ids"] = [int(i) for i in got["target_layer_ids"]]
    bad = {k: got[k] for k in DFLASH_MIRRORED_KEYS if got[k] != want[k]}
    if bad:
        raise ConfigError(f"dflash_config {bad} differs from dspine_config {({k: want[k] for k in bad})}. Fix: {fix}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "head_dim"):
        top = getattr(hf_config, key, None)
        if top is not None and int(top) != int(getattr(cfg, key)):
            raise ConfigError(f"config.json {key} = {top} but dspine_config.{key} = {getattr(cfg, key)}: "
                              f"the checkpoint's two config blocks disagree; re-save it with dspine")


# ----------------------------------------------------------------------------- weight mapping
def map_weight_name(name: str) -> tuple[str, Optional[object]]:
    """Checkpoint tensor name -> (SGLang parameter name, shard id or None).

    `layers.0.self_attn.k_proj.weight` -> (`layers.0.self_attn.qkv_proj.weight`, "k");
    `layers.0.mlp.up_proj.weight` -> (`layers.0.mlp.gate_up_proj.weight`, 1); everything else
    keeps its name (a leading `model.` is dropped)."""
    name = name[len("model."):] if name.startswith("model.") else name
    for param, weight, shard in STACKED_PARAMS:
        if f".{weight}." in name:
            return name.replace(f".{weight}.", f".{param}."), shard
    return name, None


def expected_shards(param_name: str) -> tuple:
    """The shard ids that together fill one SGLang parameter."""
    shards = tuple(s for p, _, s in STACKED_PARAMS if f".{p}." in f".{param_name}")
    return shards or (None,)


def checkpoint_names_of(param_name: str, shard) -> str:
    """The checkpoint tensor name that fills (param, shard): the inverse of `map_weight_name`."""
    for param, weight, s in STACKED_PARAMS:
        if s == shard and f".{param}." in param_name:
            return param_name.replace(f".{param}.", f".{weight}.")
    return param_name


def check_weight_coverage(parameter_names: Iterable[str], loaded: Iterable[tuple[str, object]],
                          unexpected: Iterable[str], where: str = "") -> None:
    """Strict coverage: raise `UnexpectedTensorsError` naming every checkpoint tensor no parameter
    takes, then `MissingTensorsError` naming the checkpoint tensor of every (parameter, shard) that
    was never loaded. `loaded` holds (parameter name, shard id) pairs."""
    where = f"{where}: " if where else ""
    unexpected = sorted(set(unexpected))
    if unexpected:
        raise UnexpectedTensorsError(
            f"{where}the DSpine draft checkpoint has tensors this model does not take: {unexpected}. The weights "
            f"belong to a different drafter layout than its dspine_config describes (e.g. injection or "
            f"confidence_head switched); fix the config or re-save the checkpoint")
    done = set(loaded)
    missing = sorted(checkpoint_names_of(p, s) for p in parameter_names for s in expected_shards(p)
                     if (p, s) not in done)
    if missing:
        raise MissingTensorsError(
            f"{where}the DSpine draft checkpoint lacks tensors: {missing}. The checkpoint does not match its own "
            f"dspine_config (or is truncated): fix the config or re-save the checkpoint")


def full_tensor_fits(tensor_shape, param_shape, tp_size: int) -> bool:
    """Whether a checkpoint tensor (always the full, unsharded weight) fits a parameter: same shape,
    or, under TP, the parameter holds 1/tp_size of it along exactly one dimension (a row- or
    column-parallel layer, whose own `weight_loader` then narrows to its rank's slice)."""
    tensor_shape, param_shape = tuple(tensor_shape), tuple(param_shape)
    if tensor_shape == param_shape:
        return True
    if tp_size <= 1 or len(tensor_shape) != len(param_shape):
        return False
    differing = [(t, p) for t, p in zip(tensor_shape, param_shape) if t != p]
    return len(differing) == 1 and differing[0][0] == differing[0][1] * tp_size


def _loading_tp_size() -> int:
    """The TP degree the draft model's parallel layers were built for; 1 where no TP group exists
    (a model built outside an SGLang worker, e.g. in the CPU tests)."""
    try:
        return int(compat.tp_group().world_size)
    except (ImportError, AttributeError, AssertionError, ValueError):
        return 1


# ------------------------------------------------------------------------------ strict loading
def load_strict(model: nn.Module, weights: Iterable[tuple[str, Tensor]], *, first_load: bool) -> set[str]:
    """Load every checkpoint tensor into `model`'s parameters, strictly (names in `map_weight_name`).

    With `first_load` every parameter (and every q/k/v, gate/up shard) must be filled; any call
    rejects tensors no parameter takes (later calls, weight updates, may carry a subset). Raises
    `UnexpectedTensorsError` / `MissingTensorsError` / `TensorMismatchError` naming the tensors.
    Returns the names of the parameters loaded."""
    params = dict(model.named_parameters())
    for name in [n for n in params if n.startswith("lm_head.")]:
        params.pop(name)  # the target's head, attached by reference on 0.5.22
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    where = str(getattr(model.config, "_name_or_path", "") or "")
    tp_size = _loading_tp_size()
    for name, tensor in weights:
        param_name, shard = map_weight_name(name)
        param = params.get(param_name)
        if param is None or shard not in expected_shards(param_name):
            unexpected.append(name)
            continue
        if (param_name, shard) in loaded:
            raise UnexpectedTensorsError(f"{where}: tensor {name} appears twice in the DSpine draft checkpoint")
        if shard is None and not full_tensor_fits(tensor.shape, param.shape, tp_size):
            raise TensorMismatchError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                                      f"{tuple(param.shape)}{f' per TP rank of {tp_size}' if tp_size > 1 else ''} "
                                      f"(dspine_config does not match the weights)")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
        except (AssertionError, RuntimeError, ValueError) as e:
            raise TensorMismatchError(f"{where}: tensor {name} does not fit {param_name}: {e}") from e
        loaded.add((param_name, shard))
    check_weight_coverage(params if first_load else [], loaded, unexpected, where)
    return {p for p, _ in loaded}
