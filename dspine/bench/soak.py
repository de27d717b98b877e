"""Soak test of an OpenAI-compatible SGLang server on this machine: sustained mixed chat traffic,
then a verdict on errors, latency tail, stalls, health and memory.

  python scripts/soak.py --url http://127.0.0.1:30000 --minutes 10 --clients 64 --out DIR \\
      [--config NAME] [--prompts FILE.jsonl] [--server-pid PID] [--seed S]

Only a server on 127.0.0.1 / localhost / ::1 is accepted (any other host is refused before anything is
sent). `--clients` threads send `/v1/chat/completions` requests back to back for `--minutes`:

* a good request takes a prompt (`--prompts`: JSONL, one object with `messages` in OpenAI format
  per line, optional `tools`; else a small built-in list), a temperature from {0, 0.7, 1.0},
  `max_tokens` drawn from `--max-tokens MIN MAX`, and is streamed half of the time. A streamed reply
  is read as server-sent events: every `data:` chunk is counted, an `error` chunk or a stream that
  does not end with `data: [DONE]` is an error. A non-streamed reply must carry `choices[0].message`;
* `--bad-fraction` (5 %) of the requests are bad, one of `BAD_KINDS` (negative max_tokens,
  temperature -1, a malformed JSON body, an unknown role, empty messages), always non-streamed (a
  server may only find some of them once a stream has begun); each must be answered with an HTTP
  4xx. A 2xx or 5xx answer, or none, is an error.

Every request is bounded by `--request-timeout` (connect and each read; a stream also as a whole).
Requests are never retried. A monitor thread polls `GET /health` every second (any answer other
than 200, and no answer within `--health-timeout-s` (5 s), counts in `health_non_200`; SGLang's
/health may take a second under load) and samples memory every 5 s: GPU memory
used (`nvidia-smi`, summed over the GPUs, where the command exists) and, with `--server-pid`, the
VmRSS of that process and of it with all its descendants (an SGLang server's scheduler and detokenizer
are child processes).

Afterwards (also after Ctrl-C, which stops the clients and still writes the results):

* `errors`: good requests that failed other than by a 4xx (5xx, broken stream or reply, no answer),
  bad requests not answered by a 4xx, and timeouts. Good requests refused with a 4xx are reported
  (`counts.good_rejected_4xx`, e.g. a prompt longer than the context) but are not errors;
* latency percentiles of the good requests that succeeded; the steady-state ones leave out the
  requests started during the warm-up (the first minute or the first 10 % of the run, whichever is
  shorter; `--warmup-s` sets it). `max_latency_over_p99` = the slowest good request of the
  whole run (warm-up included: a request stuck behind a start-up stall counts) over the steady-state p99 (0.0 in the file, and `max_latency_over_p99_measured` null, when no good
  request completed after the warm-up: the check then fails);
* stalls: stretches of more than max(`--stall-min-s` (5 s), 3 x steady p99) in which no request
  completed, from the start of the load to its end;
* memory first / last / max / growth per series.

The table goes to stdout and `OUT/soak_<config>.json` (characters other than letters, digits, `._-`
become `_`) holds `SOAK_SCHEMA` (the six keys `config`,
`minutes` (the load's actual length), `requests`, `errors`, `max_latency_over_p99`,
`health_non_200`) plus the details, the command, date, device (GPU names from nvidia-smi, else
`cpu`) and versions; it is rewritten with every progress line (every 30 s, `complete: false`), so
a run killed outright leaves what it measured. Exit status 0 when the soak passes (0 errors,
max_latency_over_p99 <= 2, health_non_200 == 0, no stall, steady-state latencies measured, not
interrupted), 1 when a check fails (each failed check is named), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import dspine
from dspine.bench.chat_client import CHAT, chat_body
from dspine.bench.results import check_schema, command_line, write_results
from dspine.utils.cli_args import non_negative_int, positive_float, positive_int
from dspine.utils.http import HttpClient, HttpError

SOAK_SCHEMA = {"config": str, "minutes": float, "requests": int, "errors": int, "max_latency_over_p99": float,
               "health_non_200": int}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
TEMPERATURES = (0.0, 0.7, 1.0)
BAD_KINDS = ("negative_max_tokens", "negative_temperature", "malformed_json", "unknown_role", "empty_messages")
MAX_LATENCY_OVER_P99 = 2.0      # the pass limit
STALL_P99_FACTOR = 3.0          # a stall: no completion for > max(--stall-min-s, this x steady p99)
WARMUP_MAX_S, WARMUP_SHARE = 60.0, 0.10
HEALTH_TIMEOUT_S = 5.0
ERROR_SAMPLES = 20
BUILTIN_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Tom has 3 apples and buys 5 more, then gives 2 away. How many apples does he have? Think step by step.",
    "Translate to French: 'The meeting has been moved to Thursday afternoon.'",
    "List five prime numbers greater than 100 and say how you checked them.",
    "Summarise the plot of a heist film in one paragraph, without naming any real film.",
    "What is the difference between a process and a thread? Answer briefly.",
    "Write a haiku about a server that never sleeps.",
)


class SoakError(RuntimeError):
    """A soak cannot start (bad prompts file, no server); the message says what to fix."""


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def local_base_url(url: str) -> str:
    """`url` as a server root (`http://127.0.0.1:30000`, a trailing `/v1` dropped); SoakError unless
    it is http(s) on 127.0.0.1, localhost or ::1."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SoakError(f"--url {url!r} is not an http(s) URL; give e.g. http://127.0.0.1:30000")
    if parts.hostname.lower() not in LOCAL_HOSTS:
        raise SoakError(f"--url {url!r}: host {parts.hostname!r} is not this machine; the soak test only loads a "
                        f"server on {' / '.join(LOCAL_HOSTS)} (run it on the server's host)")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise SoakError(f"--url {url!r}: {e}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", "")).rstrip("/")


def load_prompt_file(path: str | Path) -> list[dict]:
    """The prompts of an OpenAI-messages JSONL file: per non-blank line an object with `messages`
    (a non-empty list of `{"role", "content"}`; `tools` kept when present) or a bare such list.
    Returns dicts `{"messages", ["tools"]}`; SoakError naming the first bad line."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SoakError(f"--prompts {path}: cannot be read ({e})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise SoakError(f"--prompts {path}:{number}: not JSON ({e})") from None
        messages = row.get("messages") if isinstance(row, dict) else row
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise SoakError(f"--prompts {path}:{number}: want {{\"messages\": [{{\"role\": ..., \"content\": ...}}, "
                            "...]} or a bare list of messages")
        prompt = {"messages": messages}
        if isinstance(row, dict) and row.get("tools"):
            prompt["tools"] = row["tools"]
        prompts.append(prompt)
    if not prompts:
        raise SoakError(f"--prompts {path}: no prompt in the file")
    return prompts


def builtin_prompts() -> list[dict]:
    return [{"messages": [{"role": "user", "content": text}]} for text in BUILTIN_PROMPTS]


# ---------------------------------------------------------------------------------------------
# One request
# ---------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Outcome:
    """One finished request; times in seconds from the start of the load."""

    start: float
    end: float
    kind: str                 # "good" or one of BAD_KINDS
    stream: bool
    status: int | None        # HTTP status, None without one
    error: str | None = None  # error class (`errors_by_kind`); None when the request passed
    detail: str = ""
    chunks: int = 0           # data chunks of a stream

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def good_ok(self) -> bool:
        return self.kind == "good" and self.error is None and self.status == 200


def failure_class(exc: BaseException) -> str:
    """`timeout`, `no_answer` (no connection), `broken_reply` or `bad_reply` for an exception
    raised while sending a request or reading its reply."""
    if isinstance(exc, HttpError):
        return "timeout" if "timed out" in str(exc) else "no_answer"
    if isinstance(exc, TimeoutError) or (isinstance(exc, urllib.error.URLError)
                                         and isinstance(exc.reason, TimeoutError)):
        return "timeout"
    if isinstance(exc, ValueError):
        return "bad_reply"
    if isinstance(exc, (ConnectionError, urllib.error.URLError)):
        return "no_answer"
    return "broken_reply"


def read_sse(lines, deadline: float) -> tuple[int, str | None, str]:
    """Read a chat-completions event stream: (data chunks, error class or None, detail). The stream
    must end with `data: [DONE]`; an `error` chunk, a chunk that is not JSON, no chunk at all, or
    passing `deadline` (time.monotonic()) is an error."""
    chunks = 0
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else raw.strip()
        if time.monotonic() > deadline:
            return chunks, "timeout", f"stream still running at the request timeout after {chunks} chunks"
        if not line.startswith("data:"):
            continue  # blank separators, `:` comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            if chunks == 0:
                return chunks, "stream_no_chunks", "[DONE] before any data chunk"
            return chunks, None, ""
        try:
            chunk = json.loads(data)
        except ValueError:
            return chunks, "stream_bad_json", f"chunk {chunks + 1} is not JSON: {data[:200]!r}"
        if isinstance(chunk, dict) and "error" in chunk:
            return chunks, "stream_error_chunk", f"error chunk: {str(chunk['error'])[:200]}"
        chunks += 1
    return chunks, "stream_no_done", f"stream ended after {chunks} chunks without data: [DONE]"


def send_good(base: str, body: dict, stream: bool, timeout: float, t0: float) -> Outcome:
    """One good request (`body` from `chat_body`), streamed or not."""
    start = time.monotonic()
    out = Outcome(start - t0, 0.0, "good", stream, None)
    client = HttpClient(base, timeout, retries=0)
    try:
        if stream:
            chunks, error, detail = read_sse(client.stream_lines(CHAT, {**body, "stream": True}), start + timeout)
            out.status, out.chunks, out.error, out.detail = 200, chunks, error, detail
        else:
            payload = client.post(CHAT, body)
            out.status = 200
            choices = payload.get("choices") if isinstance(payload, dict) else None
            if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
                out.error, out.detail = "bad_reply", f"no choices[0].message in {str(payload)[:200]}"
    except HttpError as e:
        out.status = e.status
        if e.status is None:
            out.error, out.detail = failure_class(e), str(e)
        elif not 400 <= e.status < 500:  # a 4xx of a good request is reported, not an error
            out.error, out.detail = f"http_{e.status}", str(e)[:300]
    except Exception as e:  # noqa: BLE001 (whatever breaks a reply is one failed request, not a crashed client)
        out.error, out.detail = failure_class(e), f"{type(e).__name__}: {e}"[:300]
    out.end = time.monotonic() - t0
    return out


def bad_body(kind: str, good: dict) -> bytes:
    """The bytes of a bad request of `kind`, made from a good body."""
    if kind == "malformed_json":
        return json.dumps(good).encode()[:-7] + b',,"messages": [{'
    body = dict(good)
    if kind == "negative_max_tokens":
        body["max_tokens"] = -5
    elif kind == "negative_temperature":
        body["temperature"] = -1.0
    elif kind == "unknown_role":
        body["messages"] = [{"role": "wizard", "content": "Say hello."}]
    elif kind == "empty_messages":
        body["messages"] = []
    else:
        raise ValueError(f"unknown bad request kind {kind!r}; one of {BAD_KINDS}")
    return json.dumps(body).encode()


def post_bytes(url: str, data: bytes, timeout: float) -> int:
    """POST raw bytes as JSON (HttpClient only sends what json.dumps writes); the HTTP status."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as err:
        err.read()
        return err.code


def send_bad(base: str, kind: str, good: dict, timeout: float, t0: float) -> Outcome:
    """One bad request of `kind`: passes only when answered with a 4xx."""
    start = time.monotonic()
    out = Outcome(start - t0, 0.0, kind, False, None)
    try:
        out.status = post_bytes(base + CHAT, bad_body(kind, good), timeout)
        if not 400 <= out.status < 500:
            out.error = "bad_request_answered_5xx" if out.status >= 500 else f"bad_request_accepted_{out.status}"
            out.detail = f"{kind} answered HTTP {out.status}, want a 4xx"
    except Exception as e:  # noqa: BLE001
        out.error, out.detail = failure_class(e), f"{kind}: {type(e).__name__}: {e}"[:300]
    out.end = time.monotonic() - t0
    return out


# ---------------------------------------------------------------------------------------------
# Health and memory
# ---------------------------------------------------------------------------------------------

def nvidia_smi_memory_mib() -> list[int] | None:
    """GPU memory used per GPU (MiB) from nvidia-smi; None where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        values = [int(float(v)) for v in done.stdout.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return values if done.returncode == 0 and values else None


def gpu_names() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def rss_kib(pid: int) -> int | None:
    """VmRSS of `pid` (KiB) from /proc/PID/status; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return 0  # a zombie or kernel thread has no VmRSS line


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (children, their children, ...), read from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def memory_sample(pid: int | None) -> dict:
    """One sample: `gpu_mib` (per GPU) or None, and with `pid` its `rss_mib` and `rss_tree_mib`
    (itself and its descendants); None where the process is gone."""
    sample: dict = {"gpu_mib": nvidia_smi_memory_mib()}
    if pid is not None:
        own = rss_kib(pid)
        tree = None if own is None else own + sum(r for r in map(rss_kib, descendants(pid)) if r)
        sample["rss_mib"] = None if own is None else round(own / 1024, 1)
        sample["rss_tree_mib"] = None if tree is None else round(tree / 1024, 1)
    return sample


class Monitor(threading.Thread):
    """Polls `/health` every `health_interval` s and samples memory every `memory_interval` s
    until `stop` is set (one last memory sample then)."""

    def __init__(self, base: str, pid: int | None, health_interval: float, memory_interval: float,
                 stop: threading.Event, t0: float, health_timeout: float = HEALTH_TIMEOUT_S):
        super().__init__(name="soak-monitor", daemon=True)
        self.base, self.pid, self.stop, self.t0 = base, pid, stop, t0
        self.health_timeout = health_timeout
        self.health_interval, self.memory_interval = health_interval, memory_interval
        self.lock = threading.Lock()
        self.health = {"checks": 0, "non_200": 0, "timeouts": 0, "statuses": Counter(), "failures": []}
        self.memory: list[dict] = []

    def poll_health(self) -> None:
        now = time.monotonic() - self.t0
        try:
            HttpClient(self.base, self.health_timeout, retries=0).request_raw("/health")
            what = None
        except HttpError as e:
            what = str(e.status) if e.status is not None else failure_class(e)
        except Exception as e:  # noqa: BLE001
            what = failure_class(e)
        with self.lock:
            self.health["checks"] += 1
            if what is not None:
                self.health["non_200"] += 1
                self.health["timeouts"] += what == "timeout"
                self.health["statuses"][what] += 1
                if len(self.health["failures"]) < 50:
                    self.health["failures"].append([round(now, 2), what])

    def sample_memory(self) -> None:
        sample = {"t_s": round(time.monotonic() - self.t0, 2), **memory_sample(self.pid)}
        with self.lock:
            self.memory.append(sample)

    def run(self) -> None:
        next_health = next_memory = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_health:
                self.poll_health()
                next_health = max(next_health + self.health_interval, time.monotonic())
            if now >= next_memory:
                self.sample_memory()
                next_memory = max(next_memory + self.memory_interval, time.monotonic())
            self.stop.wait(max(0.0, min(next_health, next_memory) - time.monotonic()))
        self.sample_memory()

    def snapshot(self) -> tuple[dict, list[dict]]:
        with self.lock:
            health = {**self.health, "statuses": dict(self.health["statuses"]),
                      "failures": list(self.health["failures"])}
            return health, list(self.memory)


# ---------------------------------------------------------------------------------------------
# The load
# ---------------------------------------------------------------------------------------------

@dataclass
class Settings:
    base: str
    model: str
    clients: int
    duration_s: float
    prompts: list[dict]
    max_tokens: tuple[int, int] = (16, 128)
    bad_fraction: float = 0.05
    request_timeout: float = 120.0
    seed: int = 0


class Load:
    """`clients` threads sending requests until `stop` is set; `outcomes` grows as they finish."""

    def __init__(self, settings: Settings, t0: float):
        self.s, self.t0 = settings, t0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.threads = [threading.Thread(target=self.client, args=(i,), name=f"soak-client-{i}", daemon=True)
                        for i in range(settings.clients)]

    def request(self, rng: random.Random) -> Outcome:
        s = self.s
        good = chat_body(rng.choice(s.prompts), s.model, rng.randint(*s.max_tokens),
                         temperature=rng.choice(TEMPERATURES))
        if rng.random() < s.bad_fraction:
            return send_bad(s.base, rng.choice(BAD_KINDS), good, s.request_timeout, self.t0)
        return send_good(s.base, good, rng.random() < 0.5, s.request_timeout, self.t0)

    def client(self, index: int) -> None:
        rng = random.Random(self.s.seed * 1_000_003 + index)
        while not self.stop.is_set():
            with self.lock:
                self.in_flight += 1
            try:
                outcome = self.request(rng)
            finally:
                with self.lock:
                    self.in_flight -= 1
            with self.lock:
                self.outcomes.append(outcome)

    def snapshot(self) -> list[Outcome]:
        with self.lock:
            return list(self.outcomes)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, linear between closest ranks; None when empty."""
    if not values:
        return None
    v = sorted(values)
    pos = q / 100 * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def latency_summary(latencies_s: list[float]) -> dict:
    """n, mean, p50, p90, p99, max in ms (None when there are none)."""
    ms = [x * 1e3 for x in latencies_s]

    def r(x):
        return None if x is None else round(x, 2)

    return {"n": len(ms), "mean": r(sum(ms) / len(ms)) if ms else None, "p50": r(percentile(ms, 50)),
            "p90": r(percentile(ms, 90)), "p99": r(percentile(ms, 99)), "max": r(max(ms)) if ms else None}


def find_stalls(completions: list[float], start: float, end: float, threshold: float) -> list[dict]:
    """Gaps longer than `threshold` between consecutive completion times in [start, end], the
    start and the end counting as boundaries: `{"from_s", "to_s", "gap_s"}` each."""
    points = [start, *sorted(t for t in completions if start <= t <= end), end]
    return [{"from_s": round(a, 2), "to_s": round(b, 2), "gap_s": round(b - a, 2)}
            for a, b in zip(points, points[1:]) if b - a > threshold]


def series_summary(values: list[float | None]) -> dict | None:
    """first, last, max, growth (last - first) of a memory series; None without a value."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"samples": len(v), "first": v[0], "last": v[-1], "max": max(v), "growth": round(v[-1] - v[0], 1)}


def warmup_seconds(duration_s: float, override: float | None) -> float:
    """The warm-up left out of the steady state: `override`, else the first minute or the first
    10 % of the run, whichever is shorter."""
    return override if override is not None else min(WARMUP_MAX_S, WARMUP_SHARE * duration_s)


def summarize(outcomes: list[Outcome], load_s: float, warmup_s: float, stall_min_s: float) -> dict:
    """The request-side results of a load that ran `load_s` seconds."""
    good = [o for o in outcomes if o.kind == "good"]
    bad = [o for o in outcomes if o.kind != "good"]
    ok = [o for o in good if o.good_ok]
    steady = [o for o in ok if o.start >= warmup_s]
    errors = [o for o in outcomes if o.error is not None]
    steady_lat = latency_summary([o.latency for o in steady])
    steady_p99 = steady_lat["p99"]
    slowest = max((o.latency for o in ok), default=None)   # every request, warm-up included: a stall counts
    ratio = (1e3 * slowest / steady_p99) if steady_p99 and slowest is not None else None
    p99_for_stalls = steady_p99 if steady_p99 is not None else latency_summary([o.latency for o in ok])["p99"]
    threshold = max(stall_min_s, STALL_P99_FACTOR * (p99_for_stalls or 0.0) / 1e3)
    stalls = find_stalls([o.end for o in outcomes], 0.0, load_s, threshold)
    return {
        "requests": len(outcomes),
        "errors": len(errors),
        "max_latency_over_p99": round(ratio, 3) if ratio is not None else None,
        "counts": {
            "good": len(good), "good_ok": len(ok), "good_rejected_4xx": sum(1 for o in good if o.error is None
                                                                             and o.status != 200),
            "streamed": sum(1 for o in good if o.stream), "stream_chunks": sum(o.chunks for o in good),
            "bad": len(bad), "bad_answered_4xx": sum(1 for o in bad if o.error is None),
            "bad_by_kind": {k: {"sent": sum(1 for o in bad if o.kind == k),
                                "answered_4xx": sum(1 for o in bad if o.kind == k and o.error is None)}
                            for k in BAD_KINDS},
            "timeouts": sum(1 for o in errors if o.error == "timeout"),
        },
        "errors_by_kind": dict(Counter(o.error for o in errors)),
        "error_samples": [{"t_s": round(o.start, 2), "kind": o.kind, "stream": o.stream, "status": o.status,
                           "error": o.error, "detail": o.detail} for o in errors[:ERROR_SAMPLES]],
        "requests_per_s": round(len(outcomes) / load_s, 3) if load_s > 0 else None,
        "latency_ms": {"all": latency_summary([o.latency for o in ok]), "steady": steady_lat},
        "steady_p99_ms": steady_p99,
        "warmup_s": round(warmup_s, 3),
        "stall_threshold_s": round(threshold, 3),
        "stalls": stalls,
    }


def memory_summary(samples: list[dict], interval_s: float) -> dict:
    """Per series (GPU memory summed over the GPUs, server RSS, server tree RSS; MiB) its
    `series_summary`, and every sample."""
    gpu = [None if s.get("gpu_mib") is None else sum(s["gpu_mib"]) for s in samples]
    return {"gpu_mib": series_summary(gpu),
            "rss_mib": series_summary([s.get("rss_mib") for s in samples]),
            "rss_tree_mib": series_summary([s.get("rss_tree_mib") for s in samples]),
            "interval_s": interval_s, "series": samples}


def checks(results: dict) -> list[dict]:
    """The pass conditions: `{"check", "value", "want", "ok"}` each."""
    ratio = results["max_latency_over_p99_measured"]
    return [
        {"check": "errors", "value": results["errors"], "want": "== 0", "ok": results["errors"] == 0},
        {"check": "max_latency_over_p99", "value": ratio, "want": f"<= {MAX_LATENCY_OVER_P99:g}",
         "ok": ratio is not None and ratio <= MAX_LATENCY_OVER_P99},
        {"check": "health_non_200", "value": results["health_non_200"], "want": "== 0",
         "ok": results["health_non_200"] == 0},
        {"check": "stalls", "value": len(results["stalls"]),
         "want": f"== 0 (no {results['stall_threshold_s']:g} s without a completed request)",
         "ok": not results["stalls"]},
        {"check": "steady_state_latencies", "value": results["latency_ms"]["steady"]["n"],
         "want": f"> 0 good requests completed after the {results['warmup_s']:g} s warm-up",
         "ok": results["latency_ms"]["steady"]["n"] > 0},
        {"check": "ran_full_time", "value": results["minutes"], "want": f"{results['minutes_requested']:g} min, "
         "not interrupted", "ok": not results["interrupted"]},
    ]


def device_name() -> str:
    names = gpu_names()
    return " + ".join(sorted(set(names))) + (f" x{len(names)}" if len(names) > 1 else "") if names else "cpu"


def versions(server_info: dict | None) -> dict:
    def installed(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "dspine": dspine.__version__,
            "sglang_server": (server_info or {}).get("version"), "sglang_installed": installed("sglang")}


def safe_name(config: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", config).strip("._") or "server"


def format_table(results: dict) -> str:
    lat, steady = results["latency_ms"]["all"], results["latency_ms"]["steady"]
    mem = results["memory"]

    def ms(x):
        return "-" if x is None else f"{x:.1f}"

    def series(name, s):
        return (f"{name:<24}-" if s is None else
                f"{name:<24}first {s['first']:g}  last {s['last']:g}  max {s['max']:g}  growth {s['growth']:+g}")

    c = results["counts"]
    rows = [
        f"{'config':<24}{results['config']}  ({results['url']}, model {results['model']})",
        f"{'minutes':<24}{results['minutes']:.2f} of {results['minutes_requested']:g}"
        + ("  (interrupted)" if results["interrupted"] else ""),
        f"{'requests':<24}{results['requests']}  ({results['requests_per_s'] or 0:.1f}/s; good {c['good']}, "
        f"streamed {c['streamed']}, bad {c['bad']})",
        f"{'errors':<24}{results['errors']}  {results['errors_by_kind'] or ''}",
        f"{'bad answered 4xx':<24}{c['bad_answered_4xx']} of {c['bad']}",
        f"{'good refused 4xx':<24}{c['good_rejected_4xx']}",
        f"{'latency ms (all)':<24}p50 {ms(lat['p50'])}  p90 {ms(lat['p90'])}  p99 {ms(lat['p99'])}  "
        f"max {ms(lat['max'])}  (n {lat['n']})",
        f"{'latency ms (steady)':<24}p50 {ms(steady['p50'])}  p90 {ms(steady['p90'])}  p99 {ms(steady['p99'])}  "
        f"max {ms(steady['max'])}  (n {steady['n']}, after {results['warmup_s']:g} s)",
        f"{'max_latency_over_p99':<24}{results['max_latency_over_p99']:.3f}",
        f"{'stalls':<24}{len(results['stalls'])}  (> {results['stall_threshold_s']:g} s) "
        + " ".join(f"[{s['from_s']}-{s['to_s']} s]" for s in results["stalls"][:5]),
        f"{'health_non_200':<24}{results['health_non_200']} of {results['health']['checks']} checks "
        f"{results['health']['statuses'] or ''}",
        series("GPU memory MiB", mem["gpu_mib"]),
        series("server RSS MiB", mem["rss_mib"]),
        series("server tree RSS MiB", mem["rss_tree_mib"]),
    ]
    rows += [f"check {ch['check']:<24}{'ok' if ch['ok'] else 'FAILED'}  ({ch['value']}, want {ch['want']})"
             for ch in results["checks"]]
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soak.py", description=" ".join(__doc__.split("\n\n")[0].split()),
                                epilog="Exit status: 0 when the soak passes, 1 when a check fails, 2 for a bad "
                                       "command line. More: dspine/bench/soak.py, docs/serving.md.")
    p.add_argument("--url", required=True, help="the server root on this machine, e.g. http://127.0.0.1:30000")
    p.add_argument("--minutes", type=positive_float, required=True, help="length of the load (a float)")
    p.add_argument("--clients", type=positive_int, default=64, help="concurrent client threads (default 64)")
    p.add_argument("--out", type=Path, required=True, help="folder for soak_<config>.json")
    p.add_argument("--config", default="server", help="name of the server config, in the results file's name")
    p.add_argument("--prompts", default=None, help="OpenAI-messages JSONL (default: a built-in list)")
    p.add_argument("--server-pid", type=positive_int, default=None,
                   help="sample this process's RSS (and its descendants')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None,
                   help="the requests' `model` (default: the first of /v1/models, else 'default')")
    p.add_argument("--max-tokens", type=positive_int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"),
                   help="max_tokens of a good request, uniform in [MIN, MAX] (default 16 128)")
    p.add_argument("--bad-fraction", type=float, default=0.05, help="share of bad requests (default 0.05)")
    p.add_argument("--request-timeout", type=positive_float, default=120.0, help="seconds per request (default 120)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="warm-up left out of the steady state (default: min(60 s, 10 %% of the run))")
    p.add_argument("--stall-min-s", type=positive_float, default=5.0,
                   help="shortest stall: no completion for > max(this, 3 x steady p99) (default 5)")
    p.add_argument("--health-interval-s", type=positive_float, default=1.0, help="seconds between /health polls")
    p.add_argument("--health-timeout-s", type=positive_float, default=HEALTH_TIMEOUT_S,
                   help=f"a /health poll not answered within this counts as a failure (default {HEALTH_TIMEOUT_S:g})")
    p.add_argument("--memory-interval-s", type=positive_float, default=5.0, help="seconds between memory samples")
    p.add_argument("--progress-s", type=positive_float, default=30.0, help="seconds between status lines")
    p.add_argument("--join-grace-s", type=non_negative_int, default=5,
                   help="after Ctrl-C, seconds to wait for requests in flight (default 5)")
    args = p.parse_args(argv)
    try:
        args.base = local_base_url(args.url)
    except SoakError as e:
        p.error(str(e))
    if args.max_tokens[0] > args.max_tokens[1]:
        p.error(f"--max-tokens {args.max_tokens[0]} {args.max_tokens[1]}: MIN is above MAX")
    if not 0 <= args.bad_fraction <= 1:
        p.error(f"--bad-fraction {args.bad_fraction}: give a share in [0, 1]")
    if args.warmup_s is not None and args.warmup_s < 0:
        p.error("--warmup-s must be >= 0")
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").is_dir():
        p.error(f"--server-pid {args.server_pid}: no such process on this machine")
    try:
        args.prompt_list = load_prompt_file(args.prompts) if args.prompts else builtin_prompts()
    except SoakError as e:
        p.error(str(e))
    return args


def preflight(base: str, model: str | None) -> tuple[str, dict | None]:
    """The server answers /health (SoakError otherwise); the model name and /server_info."""
    try:
        HttpClient(base, 10.0, retries=2).request_raw("/health")
    except HttpError as e:
        raise SoakError(f"the server at {base} is not healthy before the soak: {e}") from None
    client = HttpClient(base, 10.0, retries=0)
    if model is None:
        listed = client.get_or_none("/v1/models")
        data = listed.get("data") if isinstance(listed, dict) else None
        model = data[0].get("id") if data and isinstance(data[0], dict) and data[0].get("id") else "default"
    info = client.get_or_none("/server_info") or client.get_or_none("/get_server_info")
    return model, info if isinstance(info, dict) else None


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SoakError(f"--out {args.out}: cannot create the folder ({e})") from None
    model, server_info = preflight(args.base, args.model)
    duration = args.minutes * 60
    warmup = warmup_seconds(duration, args.warmup_s)
    settings = Settings(args.base, model, args.clients, duration, args.prompt_list, tuple(args.max_tokens),
                        args.bad_fraction, args.request_timeout, args.seed)
    stem = f"soak_{safe_name(args.config)}"
    static = {"config": args.config, "url": args.base, "model": model, "clients": args.clients, "seed": args.seed,
              "minutes_requested": float(args.minutes), "command": command_line(argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_name(), "versions": versions(server_info),
              "settings": {"max_tokens": list(args.max_tokens), "temperatures": list(TEMPERATURES),
                           "bad_fraction": args.bad_fraction, "bad_kinds": list(BAD_KINDS),
                           "request_timeout_s": args.request_timeout, "stall_min_s": args.stall_min_s,
                           "health_interval_s": args.health_interval_s, "health_timeout_s": args.health_timeout_s,
                           "memory_interval_s": args.memory_interval_s,
                           "prompts": args.prompts or "built-in", "prompt_count": len(args.prompt_list)},
              "server_pid": args.server_pid}
    print(f"soak: {args.clients} clients for {args.minutes:g} min against {args.base}{CHAT} (model {model}, "
          f"warm-up {warmup:g} s); results -> {args.out / (stem + '.json')}", flush=True)

    t0 = time.monotonic()
    load = Load(settings, t0)
    monitor = Monitor(args.base, args.server_pid, args.health_interval_s, args.memory_interval_s, load.stop, t0,
                      args.health_timeout_s)

    def results_now(load_s: float, interrupted: bool, complete: bool) -> dict:
        health, memory = monitor.snapshot()
        req = summarize(load.snapshot(), load_s, warmup, args.stall_min_s)
        ratio = req.pop("max_latency_over_p99")
        res = {"config": args.config, "minutes": round(load_s / 60, 4), "requests": req.pop("requests"),
               "errors": req.pop("errors"), "max_latency_over_p99": float(ratio or 0.0),
               "health_non_200": int(health["non_200"]),
               "max_latency_over_p99_measured": ratio, **static, "complete": complete, "interrupted": interrupted,
               **req, "health": health, "memory": memory_summary(memory, args.memory_interval_s)}
        res["checks"] = checks(res)
        res["failed_checks"] = [c["check"] for c in res["checks"] if not c["ok"]]
        res["passed"] = not res["failed_checks"]
        return res

    interrupted = False
    end_at = t0 + duration
    next_progress = t0 + args.progress_s
    try:
        monitor.start()
        for thread in load.threads:
            thread.start()
        while (now := time.monotonic()) < end_at:
            load.stop.wait(min(end_at, next_progress) - now)
            if time.monotonic() >= next_progress and time.monotonic() < end_at:
                next_progress += args.progress_s
                partial = results_now(time.monotonic() - t0, False, False)
                write_results(partial, args.out, stem)
                print(f"soak [{(time.monotonic() - t0) / 60:5.2f}/{args.minutes:g} min] requests "
                      f"{partial['requests']} errors {partial['errors']} p99 "
                      f"{partial['latency_ms']['all']['p99'] or 0:.0f} ms (steady "
                      f"{partial['steady_p99_ms'] or 0:.0f}) health_non_200 {partial['health_non_200']}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\nsoak: interrupted after {(time.monotonic() - t0) / 60:.2f} min; stopping the clients", flush=True)
    load_s = min(time.monotonic(), end_at) - t0
    load.stop.set()
    grace = args.join_grace_s if interrupted else args.request_timeout + 5
    deadline = time.monotonic() + grace
    try:
        for thread in [*load.threads, monitor]:
            if thread.ident is not None:  # started (Ctrl-C may come before they all are)
                thread.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        interrupted = True
        print("soak: not waiting for the requests in flight", flush=True)
    abandoned = load.in_flight
    results = results_now(load_s, interrupted, True)
    results["counts"]["abandoned_in_flight"] = abandoned
    check_schema(results, SOAK_SCHEMA, "soak")
    path = write_results(results, args.out, stem)
    print(format_table(results), flush=True)
    print(f"wrote {path}", flush=True)
    if results["passed"]:
        print("soak: PASSED", flush=True)
        return 0
    for c in results["checks"]:
        if not c["ok"]:
            print(f"soak: FAILED check {c['check']}: {c['value']} (want {c['want']})", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args, argv)
    except SoakError as e:
        print(f"soak: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # before the load started, or while the results were being written
        print("soak: interrupted before results could be written", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
