"""`dspine serve`: launch SGLang with a DSpine preset, checked before anything starts.

A preset (`dspine/serve/presets/NAME.yaml`) is a mapping:

    model: Qwen/Qwen3-8B                  # -> --model-path
    draft_model: <path/to/checkpoint>     # -> --speculative-draft-model-path (<...> = placeholder)
    flags: {--speculative-algorithm: DSPINE, --enable-linear-replayssm-spec: true, ...}
    env: {SGLANG_RAGGED_VERIFY_MODE: static}

`dspine serve --preset NAME [any sglang flag ...]` merges the flags (the user's win, spelled as the
user spelled them), validates the combination with the same rules the plugin applies inside SGLang
(`dspine.serve.flags`), prints the exact command, and execs `sglang serve` (or
`python -m sglang.launch_server` where no `sglang` script sits beside this Python). `--dry-run`
prints the command and stops. No SGLang import here: this runs on machines without SGLang too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dspine import env
from dspine.serve.flags import (
    ALGORITHM,
    PLAIN_TOKENS_ENV,
    RAGGED_VERIFY_ENV,
    FlagError,
    check_draft_window,
    check_parallelism,
    check_replayssm,
    check_single_chain,
    check_switch_target,
    read_draft_block_size,
    resolve_num_draft_tokens,
    resolve_plain_tokens,
    resolve_step_switch,
)

DEFAULT_PRESET = "smollm2-135m"
PLUGIN_ENTRY_POINT = ("sglang.srt.plugins", "dspine", "dspine.sglang.plugin:register")
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
        if _canonical(flag) in (MODEL_FLAG, DRAFT_FLAG):
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
# Merging, validation, the command
# ---------------------------------------------------------------------------------------------

def _canonical(flag: str) -> str:
    return _ALIASES.get(flag, flag)


def parse_sglang_flags(tokens: list[str]) -> dict[str, list[str]]:
    """`["--a", "1", "--b", "--c=x", "--d", "1", "2"]` -> {--a: [1], --b: [], --c: [x], --d: [1, 2]}.

    Values are the tokens up to the next `--flag`; a repeated flag keeps its last occurrence.
    """
    flags: dict[str, list[str]] = {}
    current = None
    for token in tokens:
        if token == "--":
            continue
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token.partition("=")
            flags.pop(name, None)
            flags[name] = [value] if eq else []
            current = None if eq else name
        elif current is not None:
            flags[current].append(token)
        else:
            raise PresetError(f"unexpected argument {token!r}: pass sglang flags in their --long form")
    return flags


@dataclass
class ServeCommand:
    launcher: list[str]  # e.g. [".../bin/sglang", "serve"]
    args: list[str]  # the sglang flags and values
    env: dict[str, str]  # the preset's variables with their effective values
    flags: dict[str, list[str]]  # merged, canonical name -> values
    errors: list[str]
    notes: list[str]

    @property
    def argv(self) -> list[str]:
        return self.launcher + self.args

    def render(self) -> str:
        """The exact command, one flag per line, ready to paste into a shell."""
        lines = [" ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.launcher)])]
        start = 0
        for i in range(1, len(self.args) + 1):
            if i == len(self.args) or self.args[i].startswith("--"):
                lines.append(shlex.join(self.args[start:i]))
                start = i
        return " \\\n    ".join(lines)


def build_serve_command(preset: Preset, user_tokens: list[str], launcher: list[str] | None = None,
                        environ: dict[str, str] | None = None) -> ServeCommand:
    """Preset + user flags (the user's win) -> argv, the preset env, and every problem found."""
    environ = dict(os.environ if environ is None else environ)
    merged: dict[str, tuple[str, list[str]]] = {MODEL_FLAG: (MODEL_FLAG, [preset.model])}
    if preset.draft_model is not None:
        merged[DRAFT_FLAG] = (DRAFT_FLAG, [preset.draft_model])
    for flag, values in preset.flags.items():
        merged[_canonical(flag)] = (flag, values)
    for flag, values in parse_sglang_flags(user_tokens).items():
        merged[_canonical(flag)] = (flag, values)  # replaces in place: preset order is kept
    args = [token for spelling, values in merged.values() for token in (spelling, *values)]
    flags = {key: values for key, (_, values) in merged.items()}
    env = {k: environ.get(k, v) for k, v in preset.env.items()}  # a variable already set wins
    errors, notes = validate_flags(flags, {**environ, **env})
    return ServeCommand(launcher=list(launcher or sglang_launcher()), args=args, env=env, flags=flags,
                        errors=errors, notes=notes)


def validate_flags(flags: dict[str, list[str]], environ: dict[str, str]) -> tuple[list[str], list[str]]:
    """All problems of a merged DSPINE flag set (canonical names), and informational notes."""
    errors: list[str] = []
    notes: list[str] = []
    algorithm = _single(flags, "--speculative-algorithm")
    if algorithm is None or algorithm.upper() != ALGORITHM:
        notes.append(f"--speculative-algorithm is {algorithm!r}, not {ALGORITHM}: DSPINE checks skipped")
        return errors, notes

    def number(flag: str) -> int | None:
        value = _single(flags, flag)
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

    draft = _single(flags, DRAFT_FLAG)
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
        check_switch_target(resolve_step_switch(environ)[0], "--enable-linear-replayssm-spec" in flags)
        plain_tokens = resolve_plain_tokens(environ)
        if plain_tokens is not None and num_draft_tokens is not None and plain_tokens > num_draft_tokens:
            errors.append(f"{PLAIN_TOKENS_ENV}={plain_tokens} exceeds --speculative-num-draft-tokens "
                          f"{num_draft_tokens}: SGLang reserves one block of KV slots per request and step. "
                          f"Fix: {PLAIN_TOKENS_ENV}={num_draft_tokens} or less")
    except FlagError as e:
        errors.append(str(e))
    return errors, notes


def _single(flags: dict[str, list[str]], flag: str) -> str | None:
    values = flags.get(flag)
    return values[-1] if values else None


def sglang_launcher() -> list[str]:
    """`sglang serve` from this Python's environment, else `python -m sglang.launch_server`."""
    script = Path(sys.executable).with_name("sglang")
    if script.is_file():
        return [str(script), "serve"]
    return [sys.executable, "-m", "sglang.launch_server"]


def check_sglang_installed(needs_plugin: bool = True) -> str | None:
    """None when this Python can launch a DSPINE server, else what is missing and how to fix it."""
    try:
        importlib.metadata.version("sglang")  # metadata, not import: no namespace-package look-alikes
    except importlib.metadata.PackageNotFoundError:
        return (f"sglang is not installed in this Python ({sys.executable}). Fix: pip install 'dspine[sglang]' "
                "(SGLang 0.5.17 to 0.5.22, CUDA), then run dspine serve again.")
    if needs_plugin:
        group, name, value = PLUGIN_ENTRY_POINT
        found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
        if not found or found[0].value != value:
            return (f"dspine's SGLang plugin is not installed in this Python: the entry point {group}: "
                    f"{name} = {value} is {'stale' if found else 'missing'}, so SGLang would answer "
                    "'Unknown speculative algorithm name: DSPINE'. Fix: reinstall dspine here "
                    "(pip install -e /path/to/dspine, or pip install dspine).")
    return None


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dspine serve`; every other argument is passed to SGLang (use parse_known_args)."""
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help=f"preset name in dspine/serve/presets (default: {DEFAULT_PRESET}) or a YAML file path")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the sglang command (after validation) and exit without launching")
    parser.add_argument("--list-presets", action="store_true", help="list the available presets and exit")


def run_serve(args: argparse.Namespace, extra_sglang_args: list[str]) -> int:
    """Validate, print the exact command, then exec SGLang (or stop there with --dry-run)."""
    if getattr(args, "list_presets", False):
        for name in available_presets():
            print(name)
        return 0
    try:
        command = build_serve_command(load_preset(args.preset), list(extra_sglang_args))
    except PresetError as e:
        print(f"dspine serve: {e}", file=sys.stderr)
        return 2
    for note in command.notes:
        print(f"dspine serve: note: {note}", file=sys.stderr)
    print(command.render())
    if command.errors:
        print(f"dspine serve: {len(command.errors)} problem(s), nothing launched:", file=sys.stderr)
        for error in command.errors:
            print(f"  - {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        return 0
    algorithm = _single(command.flags, "--speculative-algorithm") or ""
    problem = check_sglang_installed(needs_plugin=algorithm.upper() == ALGORITHM)
    if problem is not None:
        print(f"dspine serve: {problem}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.argv[0], command.argv, {**os.environ, **command.env})
    return 0  # not reached


def add_command(subparsers) -> None:
    """`dspine serve` in `dspine.cli` (which passes unknown arguments on as `args.extra`)."""
    parser = subparsers.add_parser("serve", help="launch SGLang with a DSpine preset; other flags go to sglang",
                                   description=__doc__.split("\n\n")[0])
    add_serve_arguments(parser)
    parser.set_defaults(func=lambda args: run_serve(args, args.extra), accepts_extra=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspine serve", description=__doc__.split("\n\n")[0])
    add_serve_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    return run_serve(args, extra)


if __name__ == "__main__":
    sys.exit(main())
