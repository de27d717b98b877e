"""The decode-step profiler (`dspine.sglang.step_profile`) on a stand-in scheduler class: it counts only
decode steps, times the wrapped methods inside the timing window only, profiles the next window,
writes one record per phase and stops after the last phase; the driver's errors."""

from __future__ import annotations

import json
import pstats
from types import SimpleNamespace

import pytest

from dspine.sglang import step_profile


class Scheduler:
    """Each decode step spends 2 ms in get_next_batch_to_run (only the timed methods are wrapped)."""

    def __init__(self):
        self.ran = 0

    def get_next_batch_to_run(self):
        step_profile.time.sleep(0.002)

    def run_batch(self, batch):
        self.ran += 1
        return "result"


def batch(extend=False, size=2):
    return SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: extend), reqs=[object()] * size)


def test_windows_phases_and_records(tmp_path):
    profile = step_profile.StepProfile(tmp_path, (3, 8, 10), phases=2)
    step_profile.install(Scheduler, profile)
    scheduler = Scheduler()
    for phase in range(3):
        for step in range(12):
            scheduler.get_next_batch_to_run()
            assert scheduler.run_batch(batch(size=2 + phase)) == "result"
            if step % 4 == 0:
                scheduler.run_batch(batch(extend=True))       # prefills are not decode steps
    records = sorted(tmp_path.glob("*-phase*.json"))
    assert [p.name.split("-")[1] for p in records] == ["phase0.json", "phase1.json"]   # two phases, then off
    assert profile.done and scheduler.ran == 3 * 15
    first = json.loads(records[0].read_text())
    assert first["steps"] == 5 and first["mean_batch_size"] == 2.0
    assert json.loads(records[1].read_text())["mean_batch_size"] == 3.0
    assert 2.0 <= first["ms_per_step_in"]["get_next_batch_to_run"] < 5.0
    assert first["ms_per_step"] >= first["ms_per_step_in"]["get_next_batch_to_run"]
    assert set(first["ms_per_step_in"]) == {"get_next_batch_to_run", "run_batch"}
    stats = pstats.Stats(str(records[0].with_suffix(".prof")))
    assert any(name == "get_next_batch_to_run" for (_, _, name) in stats.stats)


def test_bad_windows_and_environment(tmp_path):
    with pytest.raises(ValueError, match="0 < W0 < W1 < W2"):
        step_profile.StepProfile(tmp_path, (5, 5, 9), 1)
    assert step_profile.install_from_environment({}) is False
    with pytest.raises(ValueError, match="DSPINE_STEP_PROFILE_WINDOWS='1,2'.*three comma-separated step counts"):
        step_profile.install_from_environment({"DSPINE_STEP_PROFILE": str(tmp_path),
                                               "DSPINE_STEP_PROFILE_WINDOWS": "1,2"})


def test_driver_refuses_bad_requests(tmp_path, capsys):
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"messages": [{"role": "user", "content": "x"}]}\n{"prompt": "y"}\n')
    with pytest.raises(SystemExit):
        step_profile.main(["http://127.0.0.1:9", str(tmp_path), "--requests", str(requests)])
    assert "r.jsonl:2: not a JSON object with messages" in capsys.readouterr().err


def test_the_wait_for_the_device_is_timed_inside_the_window_only(tmp_path):
    class Event:
        def synchronize(self):
            step_profile.time.sleep(0.003)

    class Sched(Scheduler):
        pass

    profile = step_profile.StepProfile(tmp_path, (2, 6, 7), phases=1)
    step_profile.install(Sched, profile)
    step_profile.install_wait_timer(Event, profile)
    scheduler, event = Sched(), Event()
    for _ in range(8):
        scheduler.run_batch(batch())
        event.synchronize()
    record = json.loads(next(tmp_path.glob("*-phase0.json")).read_text())
    assert 3.0 <= record["ms_per_step_waiting"] < 6.0          # 4 steps in the window, one 3-ms wait each
