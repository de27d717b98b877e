"""The flags `dspine serve` launched SGLang with, checked against what SGLang resolved.

`dspine serve` hands the merged preset + user flags to the server as `DSPINE_SERVE_FLAGS` (JSON
`{"--flag": ["value", ...]}`). At start-up the DSPINE worker reads each flag's server argument
(`--tp-size` -> `tp_size`, SGLang's other spellings mapped first) as SGLang resolved it, logs one
line per flag with its effect, and raises `FlagsNotApplied` naming every flag SGLang did not apply
(a different value, or no such server argument in this SGLang): a preset flag that silently does
nothing is a failure, not a default. Once SGLang has sized its pools, `check_running_cap` does the same
for `--max-running-requests`, which SGLang lowers after the arguments are resolved when a hybrid
target's recurrent-state pool holds fewer requests.

How a wanted value matches: a bare flag (`--enable-x`, no values) or `true` wants True, `false`
False; a number equals numerically (`0.75` = 0.75, `16` = 16); other strings compare
case-insensitively (`dspine` = `DSPINE`); several values compare as a list.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from dspine import env
from dspine.serve.presets import canonical_flag

logger = logging.getLogger(__name__)
_MISSING = object()


class FlagsNotApplied(RuntimeError):
    """SGLang resolved some of `dspine serve`'s flags to something else."""


@dataclass(frozen=True)
class FlagEffect:
    flag: str
    wanted: list[str]
    field: str
    actual: Any          # the resolved server argument (`_MISSING`: no such field)
    applied: bool

    def describe(self) -> str:
        given = " ".join([self.flag, *self.wanted])
        if self.actual is _MISSING:
            return f"{given}: this SGLang has no server argument {self.field}"
        return f"{given}: {self.field} = {self.actual!r}"


def server_arg_field(flag: str) -> str:
    """`--tp-size` -> `tp_size` (SGLang's other spellings first mapped to the one presets use)."""
    return canonical_flag(flag)[2:].replace("-", "_")


def matches(wanted: list[str], actual: Any) -> bool:
    """Whether the resolved value `actual` is what the flag's `wanted` values ask for (module doc)."""
    if actual is _MISSING:
        return False
    if not wanted or (len(wanted) == 1 and wanted[0].lower() in ("true", "false")):
        want = not wanted or wanted[0].lower() == "true"
        return isinstance(actual, bool) and actual is want
    if len(wanted) > 1 or isinstance(actual, (list, tuple)):
        items = list(actual) if isinstance(actual, (list, tuple)) else [actual]
        return len(items) == len(wanted) and all(matches([w], a) for w, a in zip(wanted, items))
    value = wanted[0]
    if actual is None:
        return value.lower() in ("none", "null")
    if isinstance(actual, (int, float)) and not isinstance(actual, bool):
        try:
            return abs(float(value) - float(actual)) <= 1e-9 * max(1.0, abs(float(actual)))
        except ValueError:
            return False
    return value.lower() == str(actual).lower()


def flag_effects(flags: dict[str, list[str]], read: Callable[[str], Any]) -> list[FlagEffect]:
    """One `FlagEffect` per flag; `read(field)` returns the resolved server argument (or `_MISSING`)."""
    effects = []
    for flag, wanted in flags.items():
        field = server_arg_field(flag)
        actual = read(field)
        effects.append(FlagEffect(flag, list(wanted), field, actual, matches(list(wanted), actual)))
    return effects


def check_served_flags(server_args, environ=None) -> list[FlagEffect]:
    """The worker's start-up check (module doc); [] when `DSPINE_SERVE_FLAGS` is unset."""
    flags = env.DSPINE_SERVE_FLAGS.get(environ)
    if not flags:
        return []
    from dspine.sglang import compat

    effects = flag_effects(flags, lambda field: compat.server_args_value(server_args, field, _MISSING))
    for effect in effects:
        logger.info("DSPINE serve flag %s%s", effect.describe(), "" if effect.applied else "  <- NOT APPLIED")
    failed = [e for e in effects if not e.applied]
    if failed:
        raise FlagsNotApplied(
            f"SGLang did not apply {len(failed)} of the flags `dspine serve` passed: "
            + "; ".join(e.describe() for e in failed)
            + ". Fix: read SGLang's start-up log for why it changed them (an incompatible combination, a "
              "backend this build lacks), then change or drop them on the command line or in the preset.")
    return effects


def check_running_cap(server_args, pool_max_running: int, environ=None) -> None:
    """Raise `FlagsNotApplied` when `dspine serve` asked for `--max-running-requests N` and the model
    runner, its pools sized, serves fewer (per attention-DP rank: N // dp_size)."""
    flags = env.DSPINE_SERVE_FLAGS.get(environ) or {}
    wanted = next((values for flag, values in flags.items()
                   if server_arg_field(flag) == "max_running_requests"), None)
    if not wanted:
        return
    from dspine.sglang import compat

    ranks = int(compat.server_args_value(server_args, "dp_size", 1) or 1) if compat.dp_attention_enabled(server_args) else 1
    per_rank = int(float(wanted[0])) // ranks
    if int(pool_max_running) < per_rank:
        raise FlagsNotApplied(
            f"--max-running-requests {wanted[0]}: SGLang sized its pools for {pool_max_running} running requests "
            f"per rank, not {per_rank} (a hybrid target's recurrent-state pool caps it; SGLang's log says by how "
            "much). Fix: raise --mem-fraction-static, or give --max-mamba-cache-size (3 state slots per request "
            "with the radix cache, 1 with --disable-radix-cache), or lower --max-running-requests.")
