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


def _flag_map(raw: str) -> dict[str, list[str]]:
    import json

    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and k.startswith("--") and isinstance(v, list) and all(isinstance(x, str) for x in v)
            for k, v in value.items()):
        raise ValueError('not a JSON object {"--flag": ["value", ...]}')
    return value


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


def process_environ() -> dict[str, str]:
    """A copy of this process's whole environment: what a server launched from here inherits
    (`dspine serve` checks the declared variables in it with `EnvVar.get(mapping)`)."""
    return dict(os.environ)


REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, default, doc: str, kind: str, parse: Callable[[str], Any]) -> EnvVar:
    var = EnvVar(name, default, doc, kind, parse)
    REGISTRY[name] = var
    return var


def _path_var(name: str, doc: str, default: Path | None = None) -> EnvVar:
    return _declare(name, default, doc, "a path", lambda raw: Path(raw).expanduser())


def _bool_var(name: str, doc: str) -> EnvVar:
    return _declare(name, False, doc, "0 or 1", _bool)


# --- anywhere -------------------------------------------------------------------------------------
DSPINE_KERNELS = _declare("DSPINE_KERNELS", "auto", "Kernels: auto (Triton on CUDA tensors), triton or torch.",
                          "auto, triton or torch", _choice("auto", "triton", "torch"))
DSPINE_CACHE = _path_var("DSPINE_CACHE", "Cache folder (the default target converted from its GGUF file).",
                         default=Path("~/.cache/dspine").expanduser())
DSPINE_DEFAULT_DRAFTER = _path_var("DSPINE_DEFAULT_DRAFTER", "Drafter `dspine generate` loads without --drafter.")
TRITON_INTERPRET = _bool_var("TRITON_INTERPRET", "Triton's interpreter (the CPU tests run kernels in it).")
DSPINE_PRESETS_DIR = _path_var("DSPINE_PRESETS_DIR", "Extra `dspine serve` presets, searched before the packaged.")

# --- inside an SGLang server (read by the plugin and the DSPINE worker) ---------------------------
DSPINE_DYNAMIC = _path_var("DSPINE_DYNAMIC", "Switch file: per decode step, draft or decode plainly (or forced).")
DSPINE_SERVE_FLAGS = _declare("DSPINE_SERVE_FLAGS", None, "Set by `dspine serve`: the flags the worker checks are "
                               "in effect at start-up.", 'a JSON object {"--flag": ["value", ...]}', _flag_map)
DSPINE_RECORD_CONFIDENCE = _bool_var("DSPINE_RECORD_CONFIDENCE", "Record drafter confidence in /server_info.")
DSPINE_ROUND_GRAPH = _declare("DSPINE_ROUND_GRAPH", "1", "Captured rounds: 1 greedy, all greedy and sampled, 0 off.",
                              "0, 1 or all", _choice("0", "1", "all"))
DSPINE_VERIFY_SPLITKV = _declare("DSPINE_VERIFY_SPLITKV", True, "Verify and draft block attention through DSpine's "
                                 "split-KV kernel (DSPINE servers, triton attention); 0: SGLang's prefill kernel.",
                                 "0 or 1", _bool)
DSPINE_ROUND_TIMING = _declare("DSPINE_ROUND_TIMING", 0, "Diagnostic: log device ms per captured-round stage "
                               "every N rounds (0: off).", "an integer >= 0", _int_at_least(0))
SGLANG_RAGGED_VERIFY_MODE = _declare("SGLANG_RAGGED_VERIFY_MODE", "static", "SGLang's verify-width mode.",
                                     "static or another SGLang mode", str)
SGLANG_RECORD_STEP_TIME = _bool_var("SGLANG_RECORD_STEP_TIME", "Step-time recording (per step kind in DSPINE).")
DSPINE_STEP_PROFILE = _path_var("DSPINE_STEP_PROFILE", "Diagnostic: folder for the host-time profile of steps.")
DSPINE_STEP_PROFILE_WINDOWS = _declare("DSPINE_STEP_PROFILE_WINDOWS", (300, 1300, 2300),
                                       "Profile windows: warm-up, phase-1 and phase-2 ends, in decode steps.",
                                       "three comma-separated step counts", _ints(3))
DSPINE_STEP_PROFILE_PHASES = _declare("DSPINE_STEP_PROFILE_PHASES", 2, "Profile: measured phases (1 or 2).",
                                      "an integer >= 1", _int_at_least(1))

# --- set by torchrun (read by the trainer) ----------------------------------------------------------
WORLD_SIZE = _declare("WORLD_SIZE", 1, "Processes in a torchrun job (torchrun sets it).", "an integer >= 1",
                      _int_at_least(1))
LOCAL_RANK = _declare("LOCAL_RANK", 0, "This process's GPU on its host in a torchrun job (torchrun sets it).",
                      "an integer >= 0", _int_at_least(0))
