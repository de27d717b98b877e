"""Where a server's decode step spends host time: wall timers and cProfile inside SGLang's scheduler.

A diagnostic for "why is this DSPINE server slower than AR?". With `DSPINE_STEP_PROFILE=DIR` in a
server's environment (AR or DSPINE: the plugin is loaded by both), the plugin wraps a few
`Scheduler` methods in the scheduler process. Decode steps (`run_batch` on a non-extend batch) are
counted per phase; with windows W0 < W1 < W2 (`DSPINE_STEP_PROFILE_WINDOWS`, default 300,1300,2300):

- steps [W0, W1): wall time per step and the share spent inside each wrapped method (no profiler);
- steps [W1, W2): the same thread under cProfile (every Python call of the scheduler loop, the
  worker and the model runner; time in a device sync shows as time in the method that waits);
- then `DIR/<pid>-phase<i>.json` (timers), `.prof` (pstats) and `.txt` (top functions) are written
  and the next phase (`DSPINE_STEP_PROFILE_PHASES`, default 2) starts counting from zero.

Under overlap scheduling a step's wall time is max(host work, device work). The methods' times
include the scheduler waiting for the device (`torch.cuda.Event.synchronize`, which it calls before
reading a step's results); that wait is timed too (`ms_per_step_waiting`), so host work per step is
the methods' sum minus it, and a large wait means the step is device-bound. The driver sends the load for each phase:

    DSPINE_STEP_PROFILE=/tmp/prof sglang serve ...        # or dspine serve
    python -m dspine.sglang.step_profile http://127.0.0.1:30000 /tmp/prof --requests heldout.jsonl \\
        --concurrency 1,16

Recorded profiles live in `benchmarks/results/` (see its README for how each was obtained).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from dspine import env
from dspine.utils.atomic import write_json_atomic, write_text_atomic
from dspine.utils.http import HttpClient, HttpError

PROFILE_DIR_ENV = env.DSPINE_STEP_PROFILE.name
WINDOWS_ENV = env.DSPINE_STEP_PROFILE_WINDOWS.name
TIMED_METHODS = ("process_input_requests", "get_next_batch_to_run", "run_batch", "process_batch_result",
                 "launch_batch_sample_if_needed")


class StepProfile:
    """Counts decode steps and owns the windows of one phase (see the module docstring)."""

    def __init__(self, out_dir: str | Path, windows: tuple[int, int, int], phases: int) -> None:
        w0, w1, w2 = windows
        if not 0 < w0 < w1 < w2:
            raise ValueError(f"{WINDOWS_ENV}: need 0 < W0 < W1 < W2, got {windows}")
        self.out_dir, self.windows, self.phases = Path(out_dir), windows, int(phases)
        self.phase = 0
        self._arm()

    def _arm(self) -> None:
        self.steps, self.requests = 0, 0
        self.method_seconds: dict[str, float] = {}
        self.wait_seconds = 0.0
        self.timing = self.profiling = False
        self.t_w0 = self.t_w1 = 0.0
        self.profiler: cProfile.Profile | None = None

    @property
    def done(self) -> bool:
        return self.phase >= self.phases

    def add_method_time(self, name: str, seconds: float) -> None:
        self.method_seconds[name] = self.method_seconds.get(name, 0.0) + seconds

    def add_wait_time(self, seconds: float) -> None:
        self.wait_seconds += seconds

    def on_decode_step(self, batch_size: int) -> None:
        """Called before each decode step's `run_batch`."""
        if self.done:
            return
        self.steps += 1
        w0, w1, w2 = self.windows
        if self.steps == w0:
            self.timing, self.t_w0 = True, time.perf_counter()
        elif self.steps == w1:
            self.timing, self.t_w1 = False, time.perf_counter()
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        elif self.steps == w2:
            self.profiler.disable()
            self._write(time.perf_counter())
            self.phase += 1
            self._arm()
        if self.timing:
            self.requests += batch_size

    def _write(self, t_w2: float) -> None:
        w0, w1, w2 = self.windows
        steps = w1 - w0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        base = self.out_dir / f"{os.getpid()}-phase{self.phase}"
        record = {"phase": self.phase, "steps": steps, "mean_batch_size": self.requests / steps,
                  "ms_per_step": 1e3 * (self.t_w1 - self.t_w0) / steps,
                  "ms_per_step_profiled": 1e3 * (t_w2 - self.t_w1) / (w2 - w1),
                  "ms_per_step_in": {k: 1e3 * v / steps for k, v in sorted(self.method_seconds.items())},
                  "ms_per_step_waiting": 1e3 * self.wait_seconds / steps}
        text = io.StringIO()
        stats = pstats.Stats(self.profiler, stream=text)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(120)
        stats.dump_stats(str(base) + ".prof")
        write_text_atomic(str(base) + ".txt", text.getvalue())
        write_json_atomic(str(base) + ".json", record, indent=1)  # the driver waits for the .json: written last, whole


def install(scheduler_cls, profile: StepProfile) -> None:
    """Wrap `scheduler_cls`'s TIMED_METHODS with wall timers (inside the timing window only) and its
    `run_batch` with the decode-step counter."""
    for name in TIMED_METHODS:
        if not hasattr(scheduler_cls, name):
            continue
        original = getattr(scheduler_cls, name)

        def timed(self, *args, _original=original, _name=name, **kwargs):
            if not profile.timing:
                return _original(self, *args, **kwargs)
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                profile.add_method_time(_name, time.perf_counter() - start)

        setattr(scheduler_cls, name, timed)
    run_batch = scheduler_cls.run_batch

    def counting_run_batch(self, batch, *args, **kwargs):
        if not batch.forward_mode.is_extend():
            profile.on_decode_step(len(batch.reqs))
        return run_batch(self, batch, *args, **kwargs)

    scheduler_cls.run_batch = counting_run_batch


def install_wait_timer(event_cls, profile: StepProfile) -> None:
    """Time `event_cls.synchronize` (the scheduler's wait for a step's results) inside the timing
    window."""
    original = event_cls.synchronize

    def timed_synchronize(self, *args, **kwargs):
        if not profile.timing:
            return original(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            profile.add_wait_time(time.perf_counter() - start)

    event_cls.synchronize = timed_synchronize


def install_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """The plugin's hook: wrap SGLang's Scheduler when DSPINE_STEP_PROFILE is set (False otherwise)."""
    out_dir = env.DSPINE_STEP_PROFILE.get(environ)
    if out_dir is None:
        return False
    windows = env.DSPINE_STEP_PROFILE_WINDOWS.get(environ)
    from sglang.srt.managers.scheduler import Scheduler

    if not getattr(Scheduler, "_dspine_step_profile", False):
        import torch

        profile = StepProfile(out_dir, windows, env.DSPINE_STEP_PROFILE_PHASES.get(environ))
        install(Scheduler, profile)
        install_wait_timer(torch.cuda.Event, profile)
        Scheduler._dspine_step_profile = True
    return True


def drive(url: str, out_dir: Path, bodies: list[dict], concurrency: int, want_files: int, timeout_s: float) -> dict:
    """Send `bodies` (cycled) at `concurrency` until `out_dir` holds `want_files` phase records."""
    client = HttpClient(url, timeout=timeout_s, retries=0)  # a failed request is counted, not repeated
    stop, lock = threading.Event(), threading.Lock()
    state = {"next": 0, "tokens": 0, "failures": 0}

    def phase_done() -> bool:
        return len(list(out_dir.glob("*-phase*.json"))) >= want_files

    def worker() -> None:
        while not stop.is_set():
            with lock:
                body = bodies[state["next"] % len(bodies)]
                state["next"] += 1
            try:
                tokens = client.post("/v1/chat/completions", body)["usage"]["completion_tokens"]
                with lock:
                    state["tokens"] += tokens
            except (HttpError, ValueError, KeyError, TypeError):
                with lock:
                    state["failures"] += 1
            if phase_done():
                stop.set()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    while not stop.is_set() and time.perf_counter() - start < timeout_s:
        time.sleep(0.2)
        if phase_done():
            stop.set()
    stop.set()
    for thread in threads:
        thread.join(timeout_s)
    return {"concurrency": concurrency, "tokens": state["tokens"], "failures": state["failures"],
            "seconds": time.perf_counter() - start, "phase_done": phase_done()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Drive a server started with DSPINE_STEP_PROFILE=DIR through one profiling phase per "
                    "concurrency and print where its decode steps spend host time.",
        epilog="Server side: DSPINE_STEP_PROFILE=DIR [DSPINE_STEP_PROFILE_WINDOWS=300,1300,2300] "
               "[DSPINE_STEP_PROFILE_PHASES=<number of concurrencies>] in the server's environment.")
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("out_dir", type=Path, help="the server's DSPINE_STEP_PROFILE directory (same machine)")
    parser.add_argument("--requests", type=Path, required=True,
                        help="OpenAI chat requests, JSONL (e.g. python -m dspine.data.traces heldout ... --out FILE)")
    parser.add_argument("--concurrency", default="1,16", help="one phase per value, in order (default 1,16)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per phase")
    args = parser.parse_args(argv)
    bodies = []
    for number, line in enumerate(args.requests.read_text().splitlines(), 1):
        if line.strip():
            try:
                messages = json.loads(line)["messages"]
            except (ValueError, KeyError, TypeError):
                parser.error(f"{args.requests}:{number}: not a JSON object with messages")
            bodies.append({"model": "default", "messages": messages, "max_tokens": args.max_tokens,
                           "temperature": 0})
    if not bodies:
        parser.error(f"{args.requests}: no requests")
    already = len(list(args.out_dir.glob("*-phase*.json")))
    for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
        load = drive(args.url, args.out_dir, bodies, c, already + i + 1, args.timeout)
        print(f"c={c}: {load['tokens']} tokens in {load['seconds']:.1f} s, {load['failures']} failed requests"
              + ("" if load["phase_done"] else " - phase not finished (server started without "
                 f"{PROFILE_DIR_ENV}, or too few decode steps within --timeout)"), flush=True)
        if not load["phase_done"]:
            return 1
    for path in sorted(args.out_dir.glob("*-phase*.json")):
        record = json.loads(path.read_text())
        inside = ", ".join(f"{k} {v:.3f}" for k, v in record["ms_per_step_in"].items())
        print(f"{path.name}: batch {record['mean_batch_size']:.1f}, {record['ms_per_step']:.3f} ms/step ({inside}); "
              f"cProfile in {path.with_suffix('.txt').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
