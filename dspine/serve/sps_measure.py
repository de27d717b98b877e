"""`dspine tune-sps`'s measurements against a DSPINE server: replaying trace requests at one
concurrency, the server's step times from `/server_info`, acceptance records from `/generate`, and a
server started here from a `dspine serve` preset.

Step-time sources, per level (each row says which in `source`): the DSPINE worker's step clock
(`internal_states[*].dspine_step_time_dict`: {kind: {bs: [steps, seconds]}}), SGLang's
`step_time_dict` ({bs: [seconds per step, one per log interval]}), or client timing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dspine.data.traces import TraceRequest
from dspine.serve.flags import STEP_TIME_STATE_KEY
from dspine.serve.launch import build_serve_command
from dspine.serve.presets import load_preset
from dspine.serve.sps_fit import TuningError
from dspine.utils.http import HttpClient, HttpError


def step_time_dict(info: dict) -> dict[int, list[float]] | None:
    """`internal_states[*].step_time_dict` merged over ranks as {bs: [seconds]}; None when no rank
    reports one (the server was not started with SGLANG_RECORD_STEP_TIME=1)."""
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict) and "step_time_dict" in s]
    if not states:
        return None
    merged: dict[int, list[float]] = {}
    for state in states:
        for bs, times in (state["step_time_dict"] or {}).items():
            merged.setdefault(int(bs), []).extend(float(t) for t in (times if isinstance(times, list) else [times]))
    return merged


def clock_totals(info: dict, kind: str) -> dict[int, tuple[int, float]] | None:
    """`internal_states[*].dspine_step_time_dict[kind]` as {bs: (steps, seconds)}, summed over ranks
    (each rank times the same steps: the ratio is unchanged); None when no rank reports a clock."""
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict) and STEP_TIME_STATE_KEY in s]
    if not states:
        return None
    totals: dict[int, tuple[int, float]] = {}
    for state in states:
        for bs, (steps, seconds) in ((state[STEP_TIME_STATE_KEY] or {}).get(kind) or {}).items():
            old = totals.get(int(bs), (0, 0.0))
            totals[int(bs)] = (old[0] + int(steps), old[1] + float(seconds))
    return totals


def clock_delta(before: dict[int, tuple[int, float]],
                after: dict[int, tuple[int, float]]) -> dict[int, tuple[int, float]]:
    """The decode steps (count, seconds) per batch size timed between two snapshots."""
    out = {}
    for bs, (steps, seconds) in after.items():
        old_steps, old_seconds = before.get(bs, (0, 0.0))
        if steps > old_steps:
            out[bs] = (steps - old_steps, seconds - old_seconds)
    return out


def new_step_times(before: dict[int, list[float]], after: dict[int, list[float]]) -> dict[int, list[float]]:
    """The intervals recorded between two snapshots (a list that shrank was reset: all of it is new)."""
    out = {}
    for bs, times in after.items():
        old = before.get(bs, [])
        fresh = times[len(old):] if len(times) >= len(old) else times
        if fresh:
            out[bs] = fresh
    return out


@dataclass
class Result:
    latency: float
    completion_tokens: int


def replay(client: HttpClient, requests: list[TraceRequest], concurrency: int, count: int, *, model: str | None,
           max_tokens: int, deadline: float, progress=None) -> tuple[list[Result], list[str]]:
    """Send `count` requests (cycling through `requests`) with at most `concurrency` in flight;
    requests not started by `deadline` (time.monotonic) are skipped. Returns (results, errors)."""
    def one(i: int) -> Result | str | None:
        if time.monotonic() > deadline:
            return None
        body = requests[i % len(requests)].to_openai(model, max_tokens)
        start = time.monotonic()
        try:
            resp = client.post("/v1/chat/completions", body)
            tokens = int(resp["usage"]["completion_tokens"])
        except (HttpError, KeyError, TypeError, ValueError) as err:
            return f"{requests[i % len(requests)].source}: {err}"
        finally:
            if progress is not None:
                progress.update(1)
        return Result(time.monotonic() - start, tokens)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(one, range(count)))
    return [o for o in outcomes if isinstance(o, Result)], [o for o in outcomes if isinstance(o, str)]


def level_rows(concurrency: int, results: list[Result], steps: dict[int, list[float]] | None,
               verify_tokens: int, dp_size: int, clock: dict[int, tuple[int, float]] | None = None) -> list[dict]:
    """rounds.jsonl rows of one level: the DSPINE step clock if it timed steps, else server step
    times if given, else client timing."""
    if clock:
        return [{"batch_size_per_rank": bs, "batch_tokens": bs * verify_tokens, "steps_per_sec": n / seconds,
                 "frac": 1.0, "concurrency": concurrency, "source": "dspine_step_clock", "steps": n}
                for bs, (n, seconds) in sorted(clock.items()) if bs > 0 and seconds > 0]
    if steps is not None:
        return [{"batch_size_per_rank": bs, "batch_tokens": bs * verify_tokens, "steps_per_sec": 1.0 / t,
                 "frac": 1.0, "concurrency": concurrency, "source": "server_step_time"}
                for bs in sorted(steps) for t in steps[bs] if t > 0 and bs > 0]
    rates = [r.completion_tokens / r.latency for r in results if r.completion_tokens > 0 and r.latency > 0]
    if not rates:
        return []
    bs = max(1, concurrency // dp_size)
    return [{"batch_size_per_rank": bs, "batch_tokens": bs * verify_tokens, "steps_per_sec": statistics.median(rates),
             "frac": 1.0, "concurrency": concurrency, "source": "client_timing", "requests": len(rates)}]


def render_prompt(request: TraceRequest) -> str:
    """Plain "role: content" text for /generate (no chat template: acceptance probes only)."""
    lines = [f"{m['role']}: {m.get('content') if isinstance(m.get('content'), str) else json.dumps(m.get('content'))}"
             for m in request.messages]
    return "\n".join(lines) + "\nassistant:"


def collect_acceptance(client: HttpClient, requests: list[TraceRequest], count: int, max_tokens: int) -> list[dict]:
    """`count` /generate calls (sequential); one record per call with what meta_info holds:
    completion_tokens, spec_verify_ct, and DSPINE's per-step confidence logits / accept lengths."""
    records = []
    for request in requests[:count]:
        body = {"text": render_prompt(request),
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": request.temperature or 0.0}}
        try:
            meta = client.post("/generate", body).get("meta_info", {})
        except HttpError as err:
            raise TuningError(f"acceptance records: {err}") from None
        records.append({"source": request.source, **{k: meta[k] for k in (
            "completion_tokens", "spec_verify_ct", "dspine_confidence_logits", "dspine_accept_lens") if k in meta}})
    return records


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched_server(preset: str, serve_args: list[str], log_path: Path, startup_timeout: float):
    """Start `dspine serve --preset` (its command builder, SGLANG_RECORD_STEP_TIME=1 and
    DSPINE_RECORD_CONFIDENCE=1) on a free
    loopback port, wait until /server_info answers, yield the URL, stop the process group after."""
    port = free_port()
    command = build_serve_command(load_preset(preset), [*serve_args, "--host", "127.0.0.1", "--port", str(port)])
    if command.errors:
        raise TuningError("dspine serve would refuse this preset: " + "; ".join(command.errors))
    print(command.render(), file=sys.stderr)
    env = {**os.environ, **command.env, "SGLANG_RECORD_STEP_TIME": "1", "DSPINE_RECORD_CONFIDENCE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    client = HttpClient(url, timeout=5, retries=0)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise TuningError(f"the server exited with code {proc.returncode} while starting; see {log_path}")
            try:
                client.get("/server_info")
                break
            except (HttpError, ValueError):
                if time.monotonic() > deadline:
                    raise TuningError(f"the server did not answer within {startup_timeout:.0f} s; see {log_path} "
                                      "or raise --startup-timeout") from None
                time.sleep(2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
