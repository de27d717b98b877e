"""Results files of the serving benchmarks: one JSON per run, rewritten whole after every
measurement (so a run cut short leaves what it measured), and the schema check applied at the end.

A schema is a template: a dict maps keys to sub-schemas, a one-element list applies its element
to every item, a type checks the value (ints pass for floats, bools never pass for numbers).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from dspine.utils.atomic import write_json_atomic

DEFAULT_OUT_DIR = Path("benchmarks/results")


class BenchError(RuntimeError):
    """A server answered something a benchmark cannot use; the message says what and where."""


def write_results(results: dict, out_dir: Path, stem: str) -> Path:
    """Rewrite `out_dir/stem.json` atomically; returns its path."""
    return write_json_atomic(Path(out_dir) / f"{stem}.json", results)


def device_slug(name: str) -> str:
    """What a result file is named after: the model number in a device name, lower case ("h100" for
    "NVIDIA H100 80GB HBM3", "a100" for "NVIDIA A100-SXM4-80GB"), "cpu" for a CPU, else the whole
    name as lower-case words joined by "-"."""
    for word in name.split():
        found = re.match(r"[A-Za-z]{1,3}\d{2,4}", word)
        if found:
            return found.group(0).lower()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return "cpu" if slug.startswith("cpu") else slug or "device"


def command_line(argv: list[str] | None) -> str:
    """The command that produced a result: the program name, then `argv` (the process's own
    arguments when None, i.e. when called from a script's `main()`)."""
    return shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


def check_schema(value, schema, where: str = "results") -> None:
    """Raise BenchError where `value` does not follow `schema` (extra keys are allowed)."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise BenchError(f"{where}: expected an object")
        for key, sub in schema.items():
            if key not in value:
                raise BenchError(f"{where}: missing key {key!r}")
            check_schema(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        if not isinstance(value, list):
            raise BenchError(f"{where}: expected a list")
        for i, item in enumerate(value):
            check_schema(item, schema[0], f"{where}[{i}]")
    elif not (isinstance(value, schema) or (schema is float and isinstance(value, int))) or (
            isinstance(value, bool) and schema is not bool):
        raise BenchError(f"{where}: expected {schema.__name__}, got {value!r}")
