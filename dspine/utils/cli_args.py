"""argparse `type=` checks shared by the commands (`generate`, `bench-accept`, `gen-data`, `train`).

Each function takes the option's string and returns its value, or raises
`argparse.ArgumentTypeError` naming the allowed range, so a bad value stops the command before
anything heavy loads: exit status 2 with `dspine <command>: error: argument --top-p: ...`.
Only `device` imports torch, and only for a device other than `cpu`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable


def _number(text: str, kind: type, allowed: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}; "
                                         f"{allowed}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite; {allowed}")
    return value


def _ranged(kind: type, in_range: Callable[[float], bool], allowed: str, doc: str) -> Callable[[str], float]:
    """An argparse type: `kind` parsed from the option's text, refused unless `in_range`."""
    def parse(text: str):
        value = _number(text, kind, allowed)
        if not in_range(value):
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; {allowed}")
        return value
    parse.__doc__ = doc
    return parse


positive_int = _ranged(int, lambda v: v >= 1, "give an integer >= 1",
                       "An integer >= 1 (token budgets, batch sizes, counts).")
non_negative_int = _ranged(int, lambda v: v >= 0, "give an integer >= 0 (0 = off)",
                           "An integer >= 0 (0 means off or default: `--top-k 0`, `--threads 0`).")
temperature = _ranged(float, lambda v: v >= 0, "give a temperature >= 0 (0 = greedy)", "A finite float >= 0 (0 = greedy).")
positive_float = _ranged(float, lambda v: v > 0, "give a number > 0", "A finite float > 0 (time limits).")
top_p = _ranged(float, lambda v: 0 < v <= 1, "give a top-p in (0, 1] (1 = off)", "A nucleus mass in (0, 1] (1 = off).")


def text_lines(path: str) -> list[str]:
    """The non-blank lines of UTF-8 text file `path` (trailing newlines stripped); at least one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such file; give a text file, one user message per line")
    try:
        lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: cannot be read as UTF-8 text ({exc})") from None
    if not lines:
        raise argparse.ArgumentTypeError(f"{path}: has no non-blank line; write one user message per line")
    return lines


def device(spec: str) -> str:
    """A torch device that exists on this machine: `cpu`, `cuda`, `cuda:N` (N < the GPU count) or `mps`."""
    if spec == "cpu":
        return spec
    import torch

    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{spec!r} is not a device; give cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{spec!r}: CUDA is not available on this machine (torch "
                                             f"{torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"{spec!r}: this machine has {count} CUDA device(s), "
                                             f"cuda:0..cuda:{count - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{spec!r}: MPS is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{spec!r}: unsupported device type; give cpu, cuda, cuda:N or mps")
    return spec
