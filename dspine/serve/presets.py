"""`dspine serve` presets: loading and validation, before anything starts.

A preset (`dspine/serve/presets/NAME.yaml`) is a mapping:

    model: Qwen/Qwen3-8B                  # -> --model-path
    draft_model: <path/to/checkpoint>     # -> --speculative-draft-model-path (<...> = placeholder)
    flags: {--speculative-algorithm: DSPINE, --enable-linear-replayssm-spec: true, ...}
    env: {SGLANG_RAGGED_VERIFY_MODE: static}

`load_preset` reads one (errors name the file and line); `validate_flags` checks a merged flag set
with the same rules the plugin applies inside SGLang (`dspine.serve.flags`), the server's switch
file (`DSPINE_DYNAMIC`) included. `dspine.serve.launch` merges the user's flags, prints and execs
the command. No SGLang import here: this runs on machines without SGLang too.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dspine import env
from dspine.serve.flags import (
    ALGORITHM,
    RAGGED_VERIFY_ENV,
    FlagError,
    check_draft_window,
    check_parallelism,
    check_plain_tokens,
    check_replayssm,
    check_single_chain,
    check_switch_target,
    read_draft_block_size,
    resolve_num_draft_tokens,
    resolve_step_switch,
)

DEFAULT_PRESET = "smollm2-135m"
MODEL_FLAG = "--model-path"
DRAFT_FLAG = "--speculative-draft-model-path"
_PRESET_KEYS = ("model", "draft_model", "flags", "env")
# Other spellings SGLang accepts (some only in 0.5.17) for flags a preset may set: a user flag in
# either spelling replaces the preset's.
_ALIASES = {
    "--model": MODEL_FLAG,
    "--pipeline-parallel-size": "--pp-size",
    "--tensor-parallel-size": "--tp-size",
    "--mamba-scheduler-strategy": "--mamba-radix-cache-strategy",
    "--speculative-dflash-draft-window-size": "--speculative-draft-window-size",
    "--enable-gdn-replayssm-spec": "--enable-linear-replayssm-spec",
    "--cuda-graph-max-bs": "--cuda-graph-max-bs-decode",
}


class PresetError(ValueError):
    """A preset cannot be read or used; the message names the file (and line) or the flag."""


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

@dataclass
class Preset:
    name: str
    path: Path
    model: str
    draft_model: str | None
    flags: dict[str, list[str]]  # flag -> values ([] = a bare switch), in file order
    env: dict[str, str] = field(default_factory=dict)


PACKAGED_PRESETS = Path(str(importlib.resources.files("dspine.serve") / "presets"))


def presets_dirs() -> list[Path]:
    """Where presets are looked up by name, first match wins: `$DSPINE_PRESETS_DIR` when set, then
    the presets installed with the package (`dspine/serve/presets/`)."""
    override = env.DSPINE_PRESETS_DIR.get()
    return ([override] if override else []) + [PACKAGED_PRESETS]


def available_presets() -> list[str]:
    return sorted({p.stem for d in presets_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def load_preset(name_or_path: str) -> Preset:
    """A preset by name (`qwen3-8b`) or by path to a YAML file."""
    path = _preset_path(name_or_path)
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise PresetError(f"{where}: malformed YAML: {problem}") from None
    lines = _key_lines(root, path)

    def fail(message: str, *keys: str) -> PresetError:
        line = lines.get(keys)
        return PresetError(f"{path}:{line}: {message}" if line else f"{path}: {message}")

    if not isinstance(data, dict):
        raise fail(f"a preset is a mapping with keys {', '.join(_PRESET_KEYS)}")
    for key in data:
        if key not in _PRESET_KEYS:
            raise fail(f"unknown key {key!r}: expected {', '.join(_PRESET_KEYS)}", str(key))
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise fail("`model` (the target, passed as --model-path) must be a non-empty string", "model")
    draft = data.get("draft_model")
    if draft is not None and not isinstance(draft, str):
        raise fail("`draft_model` must be a path or hub id", "draft_model")
    raw_flags = data.get("flags") or {}
    if not isinstance(raw_flags, dict):
        raise fail("`flags` must map sglang flags to values", "flags")
    flags: dict[str, list[str]] = {}
    for flag, value in raw_flags.items():
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise fail(f"flags key {flag!r} must be an sglang flag spelled with '--'", "flags", str(flag))
        if canonical_flag(flag) in (MODEL_FLAG, DRAFT_FLAG):
            raise fail(f"{flag} belongs in the `model:` / `draft_model:` keys", "flags", flag)
        values = _flag_values(value)
        if values is not None:
            flags[flag] = values
    raw_env = data.get("env") or {}
    if not isinstance(raw_env, dict) or not all(isinstance(k, str) for k in raw_env):
        raise fail("`env` must map environment variable names to values", "env")
    preset_env = {k: str(v) for k, v in raw_env.items() if v is not None}
    if draft is not None and not _is_placeholder(draft):
        draft = _resolve_relative(draft, path)
    return Preset(name=path.stem, path=path, model=model, draft_model=draft, flags=flags, env=preset_env)


def _preset_path(name_or_path: str) -> Path:
    candidate = Path(name_or_path).expanduser()
    if candidate.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not candidate.is_file():
            raise PresetError(f"preset file {candidate} not found")
        return candidate
    for directory in presets_dirs():
        path = directory / f"{name_or_path}.yaml"
        if path.is_file():
            return path
    names = ", ".join(available_presets()) or "(none found)"
    where = ", ".join(str(d) for d in presets_dirs())
    raise PresetError(f"unknown preset {name_or_path!r}; available: {names} (in {where}), "
                      "or pass the path of a preset YAML file")


def _key_lines(root, path: Path) -> dict[tuple[str, ...], int]:
    """1-based line of every top-level key and of every key under `flags` / `env`."""
    lines: dict[tuple[str, ...], int] = {}
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key_node, value_node in root.value:
        key = str(key_node.value)
        lines[(key,)] = key_node.start_mark.line + 1
        if key in ("flags", "env") and isinstance(value_node, yaml.MappingNode):
            seen = set()
            for sub_key, _ in value_node.value:
                if sub_key.value in seen:
                    raise PresetError(f"{path}:{sub_key.start_mark.line + 1}: "
                                      f"{key} key {sub_key.value!r} appears twice")
                seen.add(sub_key.value)
                lines[(key, str(sub_key.value))] = sub_key.start_mark.line + 1
    return lines


def _flag_values(value) -> list[str] | None:
    """YAML value -> argv values: true -> bare switch, false/null -> flag left out."""
    if value is True:
        return []
    if value is False or value is None:
        return None
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, dict):
        return [json.dumps(value)]
    return [str(value)]


def _is_placeholder(value: str | None) -> bool:
    return value is not None and value.startswith("<") and value.endswith(">")


def _resolve_relative(draft: str, preset_path: Path) -> str:
    """A relative `draft_model` is relative to the preset file's folder (the packaged presets reach
    the packaged drafter as `../../checkpoints/NAME`); a hub id (`org/name`, no such local folder's
    parent) stays as written."""
    if Path(draft).is_absolute() or draft.startswith("~"):
        return str(Path(draft).expanduser())
    local = (preset_path.resolve().parent / draft).resolve()
    return str(local) if local.exists() or local.parent.is_dir() else draft


# ---------------------------------------------------------------------------------------------
# Validation of a merged flag set
# ---------------------------------------------------------------------------------------------

def canonical_flag(flag: str) -> str:
    """The spelling a merged flag set keys `flag` by (SGLang's other spellings mapped, see _ALIASES)."""
    return _ALIASES.get(flag, flag)


def validate_flags(flags: dict[str, list[str]], environ: dict[str, str]) -> tuple[list[str], list[str]]:
    """All problems of a merged DSPINE flag set (canonical names), and informational notes."""
    errors: list[str] = []
    notes: list[str] = []
    algorithm = single_value(flags, "--speculative-algorithm")
    if algorithm is None or algorithm.upper() != ALGORITHM:
        notes.append(f"--speculative-algorithm is {algorithm!r}, not {ALGORITHM}: DSPINE checks skipped")
        return errors, notes

    def number(flag: str) -> int | None:
        value = single_value(flags, flag)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            errors.append(f"{flag} {value!r}: expected an integer")
            return None

    def check(fn, *args) -> None:
        try:
            fn(*args)
        except FlagError as e:
            errors.append(str(e))

    draft = single_value(flags, DRAFT_FLAG)
    block, source = None, ""
    draft_dir = Path(draft).expanduser() if draft else None
    if draft is None or _is_placeholder(draft):
        errors.append(f"--speculative-algorithm {ALGORITHM} needs a draft checkpoint, but {DRAFT_FLAG} is "
                      f"{'the placeholder ' + draft if draft else 'missing'}. "
                      f"Fix: pass {DRAFT_FLAG} PATH (a DSpine checkpoint directory or hub id).")
    elif draft_dir.is_dir():
        try:
            block, source = read_draft_block_size(draft_dir)
        except FlagError as e:
            errors.append(str(e))
    elif draft.startswith(("/", ".", "~")) or (draft_dir.parent != Path(".") and draft_dir.parent.is_dir()):
        errors.append(f"{DRAFT_FLAG} {draft}: no such directory. Fix: train or download the DSpine "
                      f"checkpoint there, or pass {DRAFT_FLAG} with the right path.")
    else:
        notes.append(f"{DRAFT_FLAG} {draft} is not a local directory: taken as a hub id (the plugin "
                     "checks its block size at startup)")

    num_draft_tokens = 16
    try:
        num_draft_tokens = resolve_num_draft_tokens(number("--speculative-num-draft-tokens"),
                                                    number("--speculative-dflash-block-size"), block, source)
    except FlagError as e:
        errors.append(str(e))
    check(check_single_chain, number("--speculative-num-steps"), number("--speculative-eagle-topk"))
    dp_width = number("--attn-dp-size")
    check(check_parallelism, number("--pp-size"),
          "--enable-dp-attention" in flags or (dp_width is not None and dp_width > 1))
    check(check_draft_window, number("--speculative-draft-window-size"), num_draft_tokens)
    check(check_replayssm, "--enable-linear-replayssm-spec" in flags, number("--linear-replayssm-cache-len"),
          num_draft_tokens, environ.get(RAGGED_VERIFY_ENV))
    try:
        switch = resolve_step_switch(environ)
        snapshots = ("--disable-radix-cache" not in flags
                     and single_value(flags, "--mamba-radix-cache-strategy") != "no_buffer")
        check_switch_target("static" if switch is None else switch.policy, "--enable-linear-replayssm-spec" in flags,
                            snapshots)
        check_plain_tokens(switch, num_draft_tokens)
    except FlagError as e:
        errors.append(str(e))
    return errors, notes


def single_value(flags: dict[str, list[str]], flag: str) -> str | None:
    """The last value of `flag` in a merged flag set (None: absent or a bare switch)."""
    values = flags.get(flag)
    return values[-1] if values else None
