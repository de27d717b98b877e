"""`dspine serve`: launch SGLang with a DSpine preset, checked before anything starts.

`dspine serve --preset NAME [any sglang flag ...]` merges the preset's flags with the user's (the
user's win, spelled as the user spelled them), validates the combination (`dspine.serve.presets`),
prints the exact command, and execs `sglang serve` (or `python -m sglang.launch_server` where no
`sglang` script sits beside this Python). `--dry-run` prints the command and stops. No SGLang import
here: this runs on machines without SGLang too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from dspine import env as env_vars
from dspine.serve.flags import ALGORITHM
from dspine.serve.presets import (
    DEFAULT_PRESET,
    DRAFT_FLAG,
    MODEL_FLAG,
    Preset,
    PresetError,
    available_presets,
    canonical_flag,
    load_preset,
    single_value,
    validate_flags,
)

PLUGIN_ENTRY_POINT = ("sglang.srt.plugins", "dspine", "dspine.sglang.plugin:register")


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

    @property
    def flags_env(self) -> dict[str, str]:
        """`DSPINE_SERVE_FLAGS`: the merged flags, for the worker's start-up check that SGLang applied
        each (`dspine.sglang.flag_check`). Set on exec, left out of `render`."""
        return {env_vars.DSPINE_SERVE_FLAGS.name: json.dumps(self.flags, separators=(",", ":"))}

    def render(self) -> str:
        """The command, one flag per line, ready to paste into a shell (exec also sets `flags_env`)."""
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
    environ = env_vars.process_environ() if environ is None else dict(environ)
    merged: dict[str, tuple[str, list[str]]] = {MODEL_FLAG: (MODEL_FLAG, [preset.model])}
    if preset.draft_model is not None:
        merged[DRAFT_FLAG] = (DRAFT_FLAG, [preset.draft_model])
    for flag, values in preset.flags.items():
        merged[canonical_flag(flag)] = (flag, values)
    for flag, values in parse_sglang_flags(user_tokens).items():
        merged[canonical_flag(flag)] = (flag, values)  # replaces in place: preset order is kept
    args = [token for spelling, values in merged.values() for token in (spelling, *values)]
    flags = {key: values for key, (_, values) in merged.items()}
    env = {k: environ.get(k, v) for k, v in preset.env.items()}  # a variable already set wins
    errors, notes = validate_flags(flags, {**environ, **env})
    return ServeCommand(launcher=list(launcher or sglang_launcher()), args=args, env=env, flags=flags,
                        errors=errors, notes=notes)


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
    algorithm = single_value(command.flags, "--speculative-algorithm") or ""
    problem = check_sglang_installed(needs_plugin=algorithm.upper() == ALGORITHM)
    if problem is not None:
        print(f"dspine serve: {problem}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.argv[0], command.argv, {**os.environ, **command.env, **command.flags_env})
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
