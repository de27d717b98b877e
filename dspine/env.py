"""Every environment variable DSpine reads, declared once: name, type, default and one line of doc.

Nothing else in the package reads `os.environ`; code asks the declaration instead:

    from dspine import env
    if env.DSPINE_RECORD_CONFIDENCE.get(): ...

`get(environ)` takes an optional mapping (tests, or a server's launch environment); an unset or
empty variable gives the default, a malformed one raises `EnvError` naming the variable, the value
and what it accepts. `docs/environment.md` is the user-facing table of the same declarations
(`tests/test_env.py` keeps the two in step).

Client-side paths (data and prompt folders) are command-line options, not variables; server-side
switches that change what a decode step does live in the switch file (`DSPINE_DYNAMIC`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class EnvError(ValueError):
    """A variable holds a value its declaration does not accept."""


@dataclass(frozen=True)
class EnvVar:
    """One declared variable. `parse` turns the raw string into the typed value (raises ValueError)."""

    name: str
    default: Any
    doc: str
    kind: str
    parse: Callable[[str], Any]

    def get(self, environ: Mapping[str, str] | None = None):
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise EnvError(f"{self.name}={raw!r}: {exc}. Fix: unset it, or set {self.kind}.") from None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return bool((os.environ if environ is None else environ).get(self.name, "").strip())


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(f"not one of {', '.join(choices)}")
        return raw.lower()
    return parse


def _ints(count: int) -> Callable[[str], tuple[int, ...]]:
    def parse(raw: str) -> tuple[int, ...]:
        values = tuple(int(x) for x in raw.split(","))
        if len(values) != count or min(values) < 0:
            raise ValueError(f"not {count} comma-separated step counts")
        return values
    return parse


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < low:
            raise ValueError(f"below {low}")
        return value
    return parse


REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, default, doc: str, kind: str, parse: Callable[[str], Any]) -> EnvVar:
    var = EnvVar(name, default, doc, kind, parse)
    REGISTRY[name] = var
    return var


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


# --- anywhere -------------------------------------------------------------------------------------
DSPINE_KERNELS = _declare(
    "DSPINE_KERNELS", "auto", "Kernel choice: `auto` (Triton on CUDA tensors, PyTorch elsewhere), `triton`, `torch`.",
    "auto, triton or torch", _choice("auto", "triton", "torch"))
DSPINE_CACHE = _declare(
    "DSPINE_CACHE", Path("~/.cache/dspine").expanduser(),
    "Cache folder: the default target converted from its GGUF file.", "a folder path", _path)
DSPINE_DEFAULT_DRAFTER = _declare(
    "DSPINE_DEFAULT_DRAFTER", None,
    "The drafter `dspine generate` loads when `--drafter` is not given (default: the drafter in the package).",
    "a checkpoint folder", _path)
DSPINE_PRESETS_DIR = _declare(
    "DSPINE_PRESETS_DIR", None, "Extra folder of `dspine serve` presets, searched before the packaged ones.",
    "a folder path", _path)
TRITON_INTERPRET = _declare(
    "TRITON_INTERPRET", False, "Triton's interpreter (CPU tests run the kernels in it); read, never set, by DSpine.",
    "0 or 1", _bool)

# --- inside an SGLang server (read by the plugin and the DSPINE worker) ---------------------------
DSPINE_DYNAMIC = _declare(
    "DSPINE_DYNAMIC", None,
    "Switch file (`dspine tune-sps` writes it): per decode step, draft or decode plainly, or force one kind.",
    "a switch-file path", _path)
DSPINE_RECORD_CONFIDENCE = _declare(
    "DSPINE_RECORD_CONFIDENCE", False,
    "Record per-position drafter confidence and acceptance in `/server_info` (`dspine tune-sps` sets it).",
    "0 or 1", _bool)
SGLANG_RECORD_STEP_TIME = _declare(
    "SGLANG_RECORD_STEP_TIME", False,
    "SGLang's step-time recording; with it the DSPINE worker also times decode steps per kind (draft, plain).",
    "0 or 1", _bool)
SGLANG_RAGGED_VERIFY_MODE = _declare(
    "SGLANG_RAGGED_VERIFY_MODE", "static",
    "SGLang's verify-width mode, read where SGLang's own reader is absent; DSPINE needs `static`.",
    "static or another SGLang mode", str)
DSPINE_STEP_PROFILE = _declare(
    "DSPINE_STEP_PROFILE", None, "Diagnostic: a folder; the scheduler writes where its decode steps spend host time.",
    "a folder path", _path)
DSPINE_STEP_PROFILE_WINDOWS = _declare(
    "DSPINE_STEP_PROFILE_WINDOWS", (300, 1300, 2300),
    "With DSPINE_STEP_PROFILE: warm-up end, phase-1 end and phase-2 end, in decode steps.",
    "three comma-separated step counts", _ints(3))
DSPINE_STEP_PROFILE_PHASES = _declare(
    "DSPINE_STEP_PROFILE_PHASES", 2, "With DSPINE_STEP_PROFILE: how many measured phases (1 or 2).",
    "an integer >= 1", _int_at_least(1))
