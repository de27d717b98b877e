"""Decode-step times as the DSPINE worker sees them, per step kind: the tables the speculation switch needs.

SGLang's `SGLANG_RECORD_STEP_TIME=1` records, per batch size, the wall time between two decode log
lines divided by the decode steps between them, so the prefills that ran in between count as
decode time. A K-token plain step has K times fewer decode steps per request than AR, and a
drafting step about τ times fewer, so those tables are inflated by different amounts and the
switch compares them wrongly.

With `SGLANG_RECORD_STEP_TIME=1` in the server's environment, the worker stamps the host time at
the start of every `forward_batch_generation` call. The interval between two consecutive calls is
one step's period (under overlap scheduling, launch to launch: the larger of host and device work);
it is kept only when both calls are decode steps, so nothing of a prefill is in it, and it is
booked to the first step's kind ("draft" or "plain") and batch size. The plugin adds the totals to
SGLang's `/server_info` (`internal_states[*].dspine_step_time_dict`:
`{kind: {batch size: [steps, seconds]}}`), where `dspine tune-sps` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping

from dspine import env
from dspine.serve.flags import STEP_TIME_STATE_KEY as STATE_KEY

KINDS = ("draft", "plain")


class DecodeStepClock:
    """Per (kind, batch size): the count and total seconds of decode-step periods (host clock)."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[int, list]] = {kind: {} for kind in KINDS}
        self._last: tuple[str, int, float] | None = None

    def tick(self, kind: str | None, batch_size: int, now: float) -> None:
        """A `forward_batch_generation` call starting at `now`: a decode step of `kind`, or None for
        anything else (prefill, idle), which ends the chain of consecutive decode steps."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"step kind {kind!r}: one of {KINDS} or None")
        if kind is not None and self._last is not None:
            last_kind, last_bs, last_now = self._last
            total = self.totals[last_kind].setdefault(last_bs, [0, 0.0])
            total[0] += 1
            total[1] += now - last_now
        self._last = (kind, int(batch_size), now) if kind is not None else None

    def snapshot(self) -> dict[str, dict[int, list]]:
        return {kind: {bs: list(total) for bs, total in per_bs.items()} for kind, per_bs in self.totals.items()}


CLOCK = DecodeStepClock()   # one per scheduler process: the worker ticks it, /server_info reads it


def recording(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `SGLANG_RECORD_STEP_TIME` is on (in `environ`, default the process environment)."""
    return env.SGLANG_RECORD_STEP_TIME.get(environ)


def install_server_info(scheduler_cls, clock: DecodeStepClock = CLOCK) -> None:
    """Add the clock's totals to `scheduler_cls.get_internal_state`'s `internal_state` dict."""
    original = scheduler_cls.get_internal_state

    def get_internal_state(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        state = getattr(out, "internal_state", None)
        if isinstance(state, dict):
            state[STATE_KEY] = clock.snapshot()
        return out

    scheduler_cls.get_internal_state = get_internal_state


def install_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """The plugin's hook: with SGLANG_RECORD_STEP_TIME set, expose the clock in /server_info."""
    if not recording(environ):
        return False
    from sglang.srt.managers.scheduler import Scheduler

    if not getattr(Scheduler, "_dspine_step_clock", False):
        install_server_info(Scheduler)
        Scheduler._dspine_step_clock = True
    return True
