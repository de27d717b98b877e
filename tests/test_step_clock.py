"""The worker's decode-step clock (`dspine.sglang.step_clock`): periods of consecutive decode steps
booked to the first step's kind and batch size, prefills breaking the chain, and the totals added
to SGLang's internal state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dspine.sglang import step_clock


def test_periods_of_consecutive_decode_steps_only():
    clock = step_clock.DecodeStepClock()
    clock.tick("draft", 4, 0.000)
    clock.tick("draft", 4, 0.003)          # draft@4 took 3 ms
    clock.tick("plain", 4, 0.006)          # draft@4 3 ms
    clock.tick(None, 0, 0.016)             # a prefill: plain@4's period ended inside it, not booked
    clock.tick("plain", 5, 0.030)          # first decode after the prefill: nothing booked
    clock.tick("plain", 5, 0.040)          # plain@5 10 ms
    assert clock.snapshot() == {"draft": {4: [2, pytest.approx(0.006)]}, "plain": {5: [1, pytest.approx(0.010)]}}
    with pytest.raises(ValueError, match="step kind"):
        clock.tick("verify", 1, 0.05)


def test_totals_reach_the_internal_state():
    class Scheduler:
        def get_internal_state(self, request):
            return SimpleNamespace(internal_state={"last_gen_throughput": 1.0})

    clock = step_clock.DecodeStepClock()
    clock.tick("plain", 2, 0.0)
    clock.tick("plain", 2, 0.5)
    step_clock.install_server_info(Scheduler, clock)
    state = Scheduler().get_internal_state(None).internal_state
    assert state == {"last_gen_throughput": 1.0, "dspine_step_time_dict": {"draft": {}, "plain": {2: [1, 0.5]}}}


def test_recording_follows_sglangs_flag():
    assert step_clock.recording({"SGLANG_RECORD_STEP_TIME": "1"})
    assert step_clock.recording({"SGLANG_RECORD_STEP_TIME": "true"})
    assert not step_clock.recording({}) and not step_clock.recording({"SGLANG_RECORD_STEP_TIME": "0"})
    assert step_clock.install_from_environment({}) is False
