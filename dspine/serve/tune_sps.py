"""`dspine tune-sps`: measure a deployment's SPS table (and STS calibration) on the user's traces.

Replays trace requests (`dspine.data.traces`, the "tune" split by default) against a running
OpenAI-compatible DSPINE server (`--url`), or one started here through `dspine serve`'s command
builder (`--preset`, stopped afterwards), at a sweep of concurrencies (default 1, 4, 16, 64).

Step time, per concurrency level, from one of three sources (each row says which in `source`):

* `dspine_step_clock` (preferred): a DSPINE server started with `SGLANG_RECORD_STEP_TIME=1` also
  reports its worker's decode-step periods (`internal_states[*].dspine_step_time_dict`,
  `dspine.sglang.step_clock`): launch-to-launch time of consecutive decode steps, prefills
  excluded, per step kind ("plain" when `--verify-tokens 1`, else "draft") and batch size; one row
  per (bs, level) with steps/s = steps / seconds.
* `server_step_time`: the server was started with `SGLANG_RECORD_STEP_TIME=1`, so `/server_info`
  has `internal_states[*].step_time_dict {bs: [seconds per step, one average per log interval]}`.
  The intervals added during the level give one row per (bs, interval): exact batch sizes, but
  each interval's wall time includes the prefills that ran in it (AR servers have only this).
* `client_timing`: otherwise. Per request, steps/s = completion tokens / latency, i.e. one step
  per emitted token (exact under `SGLANG_SIMULATE_ACC_LEN=1.0`; with real acceptance it
  overestimates steps/s), and the level's median is one row at batch size = concurrency / DP.

Output directory (every file written atomically; a level already in rounds.jsonl is skipped
unless `--restart`):

* `rounds.jsonl`: SGLang `dspark_sps_profiler` rows `{batch_size_per_rank, batch_tokens,
  steps_per_sec, frac, concurrency, source}`; batch_tokens = bs x verify tokens (verify-all, frac 1).
* `sps_table.json`: the diagonal table (median steps/s per batch_tokens); `sps_table_additive.json`
  too when rounds hold off-diagonal cells (frac < 1, e.g. merged from SGLang's profiler).
* `acceptance.jsonl` + `sts.json` (temperatures: SGLang's STS) + `sts_affine.json` (temperatures
  and biases: DSpine's planner, see docs/dynamic_verification.md): per-position calibration, fitted when `/generate` responses
  carry per-step `meta_info.dspine_confidence_logits [steps][N]` and `dspine_accept_lens [steps]`
  (a DSPINE server started with `DSPINE_RECORD_CONFIDENCE=1`, as `--preset` does; the worker adds
  no host sync for it); otherwise skipped with a note in the manifest.
* `calibration_check.json` with `--check-calibration FILE` (a calibration fitted on another split,
  e.g. the tune run's `sts_affine.json`, checked on this run's acceptance records, e.g. `--split
  heldout`): predicted vs observed acceptance per position, in points, and survival ECE raw vs
  calibrated.
* `switch.json` with `--plain-table FILE` (the `sps_table.json` of a run against the same server
  started with `DSPINE_SWITCH=plain DSPINE_PLAIN_TOKENS=K`, measured with `--verify-tokens 1`; pass
  the same `--plain-tokens K`): the speculation switch's file (`dspine.dynamic.switch`): this run's
  table for drafting steps, FILE for plain steps of K tokens, the affine calibration and the prior
  (the acceptance records' observed survival per position).
  Serve with `DSPINE_DYNAMIC=<out>/switch.json` in the server's environment.
* `manifest.json`, `sps.png` (+ `calibration.png`; skipped without matplotlib), and the
  `dspine serve` command that uses them, printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from dspine.sglang.step_clock import STATE_KEY as CLOCK_KEY
from dspine.data.traces import TraceError, TraceRequest, file_sha256, load_traces, write_jsonl_atomic

DEFAULT_CONCURRENCIES = (1, 4, 16, 64)
DEFAULT_VERIFY_TOKENS = 16
ROUNDS, TABLE, ADDITIVE, ACCEPTANCE, STS, STS_AFFINE, CHECK, MANIFEST = (
    "rounds.jsonl", "sps_table.json", "sps_table_additive.json", "acceptance.jsonl", "sts.json", "sts_affine.json",
    "calibration_check.json", "manifest.json")
SWITCH = "switch.json"
M_BIN = 64          # additive fit: verify-token cells binned by 64, as SGLang's profiler
_FLAG_KEYS = ("tp_size", "dp_size", "pp_size", "attention_backend", "cuda_graph_max_bs", "cuda_graph_bs",
              "disable_cuda_graph", "max_running_requests", "mem_fraction_static", "enable_dp_attention",
              "disable_overlap_schedule", "dtype", "kv_cache_dtype")


class TuningError(RuntimeError):
    """The sweep cannot go on; the message says what failed and what to do."""


# ------------------------------------------------------------------------------------ HTTP
@dataclass
class Client:
    """JSON over HTTP with the stdlib. `url` is the server root, e.g. http://127.0.0.1:30000."""

    url: str
    timeout: float = 600.0

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url.rstrip("/") + path, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url.rstrip("/") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise TuningError(f"POST {path}: HTTP {err.code}: {err.read()[:300]!r}") from None


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
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict) and CLOCK_KEY in s]
    if not states:
        return None
    totals: dict[int, tuple[int, float]] = {}
    for state in states:
        for bs, (steps, seconds) in ((state[CLOCK_KEY] or {}).get(kind) or {}).items():
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


# ------------------------------------------------------------------------------------ replay
@dataclass
class Result:
    latency: float
    completion_tokens: int


def replay(client: Client, requests: list[TraceRequest], concurrency: int, count: int, *, model: str | None,
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
        except (TuningError, OSError, KeyError, TypeError, ValueError) as err:
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


# ------------------------------------------------------------------------------------ fitting
def fit_diagonal(rounds: list[dict], max_batch_tokens: int | None = None):
    """SpsCostTable from the frac-1 rows: the median steps/s per batch_tokens (as SGLang's `fit`)."""
    from dspine.dynamic.verification import SpsCostTable

    cells: dict[int, list[float]] = {}
    for row in rounds:
        if row.get("frac", 1.0) >= 1.0:
            cells.setdefault(int(row["batch_tokens"]), []).append(float(row["steps_per_sec"]))
    if not cells:
        raise TuningError("no diagonal (frac = 1) rows to fit: every level failed; check the server log")
    probes = sorted(cells)
    return SpsCostTable(sample_batch_tokens=tuple(probes),
                        sample_steps_per_sec=tuple(statistics.median(cells[p]) for p in probes),
                        max_batch_tokens=max(probes[-1], max_batch_tokens or 0))


def _hat_basis(xs: list[float], probes: list[int]):
    """[n, len(probes)] piecewise-linear interpolation weights, clamped beyond the ends."""
    import torch

    x = torch.tensor(xs, dtype=torch.float64).clamp(probes[0], probes[-1])
    basis = torch.zeros(len(xs), len(probes), dtype=torch.float64)
    if len(probes) == 1:
        return basis.fill_(1.0)
    p = torch.tensor(probes, dtype=torch.float64)
    hi = torch.bucketize(x, p, right=True).clamp(1, len(probes) - 1)
    w = (x - p[hi - 1]) / (p[hi] - p[hi - 1])
    rows = torch.arange(len(xs))
    basis[rows, hi - 1] = 1 - w
    basis[rows, hi] += w
    return basis


def fit_additive(rounds: list[dict]):
    """SpsAdditiveCostTable T(bs, M) = bias + alpha(bs) + theta(M), least squares over every row
    (alpha and theta are 0 at their first probe; M binned by 64 above 64). None when the rows have
    no off-diagonal (frac < 1) cell, or the fit gives a non-positive bias."""
    import torch

    from dspine.dynamic.verification import SpsAdditiveCostTable

    if not any(row.get("frac", 1.0) < 1.0 for row in rounds):
        return None
    bs = [float(r["batch_size_per_rank"]) for r in rounds]
    m = [float(r["batch_tokens"]) for r in rounds]
    bs_probes = sorted({int(b) for b in bs})
    m_probes = sorted({int(v) if v < M_BIN else M_BIN * round(v / M_BIN) for v in m})
    design = torch.cat([torch.ones(len(rounds), 1, dtype=torch.float64),
                        _hat_basis(bs, bs_probes)[:, 1:], _hat_basis(m, m_probes)[:, 1:]], dim=1)
    seconds = torch.tensor([1.0 / r["steps_per_sec"] for r in rounds], dtype=torch.float64)
    coef = torch.linalg.lstsq(design, seconds[:, None]).solution[:, 0].tolist()
    bias, k = coef[0], len(bs_probes) - 1
    if not bias > 0:
        return None
    return SpsAdditiveCostTable(bias_seconds=bias, bs_probes=tuple(bs_probes), alpha_seconds=(0.0, *coef[1:1 + k]),
                                m_probes=tuple(m_probes), theta_seconds=(0.0, *coef[1 + k:]))


def render_prompt(request: TraceRequest) -> str:
    """Plain "role: content" text for /generate (no chat template: acceptance probes only)."""
    lines = [f"{m['role']}: {m.get('content') if isinstance(m.get('content'), str) else json.dumps(m.get('content'))}"
             for m in request.messages]
    return "\n".join(lines) + "\nassistant:"


def collect_acceptance(client: Client, requests: list[TraceRequest], count: int, max_tokens: int) -> list[dict]:
    """`count` /generate calls (sequential); one record per call with what meta_info holds:
    completion_tokens, spec_verify_ct, and DSPINE's per-step confidence logits / accept lengths."""
    records = []
    for request in requests[:count]:
        body = {"text": render_prompt(request),
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": request.temperature or 0.0}}
        meta = client.post("/generate", body).get("meta_info", {})
        records.append({"source": request.source, **{k: meta[k] for k in (
            "completion_tokens", "spec_verify_ct", "dspine_confidence_logits", "dspine_accept_lens") if k in meta}})
    return records


def recorded_rounds(records: list[dict]):
    """(logits [n, N] fp64, accepted drafts [n]) over the records' verify steps, or None without them."""
    import torch

    logits, accept = [], []
    for rec in records:
        if "dspine_confidence_logits" in rec and "dspine_accept_lens" in rec:
            logits.extend(rec["dspine_confidence_logits"])
            accept.extend(rec["dspine_accept_lens"])
    if not logits:
        return None
    return torch.tensor(logits, dtype=torch.float64), torch.tensor(accept)


def observed_survival(records: list[dict]) -> list[float] | None:
    """[N-1]: the share of recorded verify steps that accepted at least j+1 proposals (the switch's
    prior), or None without per-step records."""
    from dspine.dynamic.verification import observed_survival as survival

    rounds = recorded_rounds(records)
    if rounds is None:
        return None
    logits, accepted = rounds
    return survival(accepted, logits.shape[1]).tolist()


def fit_calibration(records: list[dict], dataset: str, affine: bool = False):
    """PositionCalibration (temperature-only, or `affine`) from the records' per-step logits and
    accept lengths, or None without them."""
    from dspine.dynamic.verification import PositionCalibration

    rounds = recorded_rounds(records)
    if rounds is None:
        return None
    return PositionCalibration.fit(*rounds, dataset=dataset, affine=affine)


def check_calibration(calibration, path: Path, records: list[dict]) -> dict:
    """`calibration` (a PositionCalibration fitted elsewhere, read from `path`) against these
    records: per position the predicted and observed P(accepted drafts >= j) and their gap in
    points; survival ECE raw (identity) and calibrated. Raises TuningError without recorded
    confidences or on a width mismatch."""
    from dspine.dynamic.verification import PositionCalibration

    rounds = recorded_rounds(records)
    if rounds is None:
        raise TuningError("--check-calibration: the acceptance records hold no dspine_confidence_logits (start the "
                          "DSPINE server with DSPINE_RECORD_CONFIDENCE=1)")
    try:
        gaps = calibration.survival_gaps(*rounds)
    except ValueError as err:
        raise TuningError(f"--check-calibration {path}: {err}") from None
    raw = PositionCalibration.identity(rounds[0].shape[1]).calibration_error(*rounds)[1]
    return {"calibration": str(path), "rounds": int(rounds[0].shape[0]), "ece_raw": raw,
            "ece_calibrated": calibration.calibration_error(*rounds)[1],
            "max_abs_gap_points": max(abs(g["gap_points"]) for g in gaps), "positions": gaps}


# ------------------------------------------------------------------------------------ outputs
def write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def plot_outputs(out: Path, rounds: list[dict], table, calibration) -> list[str]:
    """sps.png (measured steps/s and the table's floor-probe steps) and calibration.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for source, marker in (("server_step_time", "o"), ("client_timing", "s")):
        pts = [(r["batch_tokens"], r["steps_per_sec"]) for r in rounds if r.get("source") == source]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, alpha=0.5, label=source.replace("_", " "))
    ax.step(table.sample_batch_tokens, table.sample_steps_per_sec, where="post", color="k", label="SPS table")
    ax.set(xscale="log", xlabel="batch tokens (verify tokens per step per rank)", ylabel="steps / s",
           title="Step rate vs batch tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sps.png", dpi=120)
    plt.close(fig)
    written.append("sps.png")
    if calibration is not None:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
        pos = range(len(calibration.temperatures))
        a1.plot(pos, calibration.temperatures, "o-")
        a1.set(xlabel="proposal position", ylabel="temperature", title="STS temperatures")
        a2.plot(pos, calibration.ece_before, "o-", label="before")
        a2.plot(pos, calibration.ece_after, "o-", label="after")
        a2.set(xlabel="proposal position", ylabel="survival ECE", title="Calibration error")
        a2.legend()
        fig.tight_layout()
        fig.savefig(out / "calibration.png", dpi=120)
        plt.close(fig)
        written.append("calibration.png")
    return written


def serve_command(preset: str | None, info: dict, table: Path, sts: Path | None) -> str:
    """The `dspine serve` command that uses the fitted files."""
    args = ["dspine", "serve", "--preset", preset or "<your-preset>"]
    if preset is None:
        for flag, key in (("--model-path", "model_path"), ("--speculative-draft-model-path",
                                                            "speculative_draft_model_path")):
            if info.get(key):
                args += [flag, str(info[key])]
    args += ["--speculative-dspark-sps-table-path", str(table.resolve())]
    if sts is not None:
        args += ["--speculative-dspark-confidence-sts-path", str(sts.resolve())]
    return shlex.join(args)


def manifest(args, info: dict, traces: list[Path], requests: list[TraceRequest], rounds: list[dict],
             files: dict, notes: list[str], command: str, verify_tokens: int) -> dict:
    gpu = args.gpu or next((info[k] for k in ("gpu_name", "device_name", "gpu") if info.get(k)), None)
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "server": args.url or f"preset {args.preset}",
        "gpu": gpu or "unknown (not in /server_info; pass --gpu)",
        "sglang_version": info.get("version"),
        "target": info.get("model_path"),
        "drafter": info.get("speculative_draft_model_path"),
        "speculative_algorithm": info.get("speculative_algorithm"),
        "verify_tokens": verify_tokens,
        "flags": {k: v for k, v in info.items() if k in _FLAG_KEYS or k.startswith("speculative_")},
        "cuda_graph_sizes": {k: v for k, v in info.items() if k.startswith("cuda_graph") and v is not None},
        "traces": [{"path": str(p), "sha256": file_sha256(p)} for p in traces],
        "split": args.split,
        "requests": len(requests),
        "concurrencies": sorted({r["concurrency"] for r in rounds}),
        "timing": {str(c): s for c, s in sorted({(r["concurrency"], r["source"]) for r in rounds})},
        "files": files,
        "notes": notes,
        "serve_command": command,
    }


# ------------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched_server(preset: str, serve_args: list[str], log_path: Path, startup_timeout: float):
    """Start `dspine serve --preset` (its command builder, SGLANG_RECORD_STEP_TIME=1 and
    DSPINE_RECORD_CONFIDENCE=1) on a free
    loopback port, wait until /server_info answers, yield the URL, stop the process group after."""
    from dspine.serve.presets import build_serve_command, load_preset

    port = free_port()
    command = build_serve_command(load_preset(preset), [*serve_args, "--host", "127.0.0.1", "--port", str(port)])
    if command.errors:
        raise TuningError("dspine serve would refuse this preset: " + "; ".join(command.errors))
    print(command.render(), file=sys.stderr)
    env = {**os.environ, **command.env, "SGLANG_RECORD_STEP_TIME": "1", "DSPINE_RECORD_CONFIDENCE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, client = f"http://127.0.0.1:{port}", Client(f"http://127.0.0.1:{port}", timeout=5)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise TuningError(f"the server exited with code {proc.returncode} while starting; see {log_path}")
            try:
                client.get("/server_info")
                break
            except OSError:
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


# ------------------------------------------------------------------------------------ the sweep
def tune(args, url: str, requests: list[TraceRequest], reference=None) -> int:
    """The sweep, the fits and the outputs in args.out for the server at `url`; `reference`: the
    `--check-calibration` file's PositionCalibration (read before any server started), or None."""
    from tqdm import tqdm

    from dspine.dynamic.verification import sps_table_to_json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = [Path(p) for p in args.traces]
    client = Client(url, timeout=args.request_timeout)
    try:
        info = client.get("/server_info")
    except OSError as err:
        raise TuningError(f"cannot read {url}/server_info ({err}): start the server, or fix --url") from None
    notes: list[str] = []
    verify_tokens = args.verify_tokens or info.get("speculative_num_draft_tokens")
    if not verify_tokens:
        verify_tokens = DEFAULT_VERIFY_TOKENS
        notes.append(f"verify tokens per request unknown (no speculative_num_draft_tokens in /server_info): "
                     f"assumed {DEFAULT_VERIFY_TOKENS}; pass --verify-tokens")
    if reference is not None:  # its width against this deployment's, before the sweep
        width = len(reference.temperatures)
        if width != verify_tokens - 1:
            raise TuningError(f"--check-calibration {args.check_calibration}: {width} temperatures, but this server "
                              f"verifies {verify_tokens} tokens per request ({verify_tokens - 1} proposals): use a "
                              "calibration fitted on this drafter and block size")
    dp_size = int(info.get("dp_size") or 1)
    model = args.model or info.get("served_model_name") or info.get("model_path")

    rounds_path = out / ROUNDS
    rounds = [] if args.restart else read_jsonl(rounds_path)
    done = {r["concurrency"] for r in rounds}
    pending = [c for c in args.concurrencies if c not in done]
    if done & set(args.concurrencies):
        print(f"tune-sps: levels {sorted(done & set(args.concurrencies))} already in {rounds_path}: skipped "
              "(--restart to redo)", file=sys.stderr)
    counts = {c: args.requests_per_level or max(16, 4 * c) for c in pending}
    clock_kind = "plain" if verify_tokens == 1 else "draft"
    with tqdm(total=sum(counts.values()), desc="SPS sweep", unit="req", disable=args.quiet) as bar:
        for c in pending:
            bar.set_postfix(concurrency=c)
            info_before = client.get("/server_info")
            before, clock_before = step_time_dict(info_before), clock_totals(info_before, clock_kind)
            results, errors = replay(client, requests, c, counts[c], model=model, max_tokens=args.max_tokens,
                                     deadline=time.monotonic() + args.level_timeout, progress=bar)
            info_after = client.get("/server_info") if before is not None or clock_before is not None else {}
            after = step_time_dict(info_after) if before is not None else None
            clock = clock_delta(clock_before, clock_totals(info_after, clock_kind) or {}) \
                if clock_before is not None else None
            if not results:
                raise TuningError(f"concurrency {c}: no request succeeded ({len(errors)} failed); first error: "
                                  f"{errors[0] if errors else 'none started before --level-timeout'}")
            if errors:
                notes.append(f"concurrency {c}: {len(errors)} request(s) failed, e.g. {errors[0]}")
            steps = new_step_times(before, after) if before is not None else None
            rows = level_rows(c, results, steps, verify_tokens, dp_size, clock)
            if not rows:
                raise TuningError(f"concurrency {c}: the server recorded no step times; is SGLANG_RECORD_STEP_TIME=1 "
                                  "set and the log interval shorter than the level?")
            rounds.extend(rows)
            write_jsonl_atomic(rounds_path, rounds)
    if not any(r["source"] in ("server_step_time", "dspine_step_clock") for r in rounds):
        notes.append("step times are client-side (no step_time_dict in /server_info): steps/s = completion tokens "
                     "/ latency, exact only with SGLANG_SIMULATE_ACC_LEN=1.0; start the server with "
                     "SGLANG_RECORD_STEP_TIME=1 for server-side step times")

    graph_max = info.get("cuda_graph_max_bs") or info.get("cuda_graph_max_bs_decode")  # 0.5.17+: per phase
    table = fit_diagonal(rounds, int(graph_max) * verify_tokens if isinstance(graph_max, int) else None)
    write_text_atomic(out / TABLE, sps_table_to_json(table))
    files = {"rounds": ROUNDS, "sps_table": TABLE}
    additive = fit_additive(rounds)
    if additive is not None:
        write_text_atomic(out / ADDITIVE, sps_table_to_json(additive))
        files["sps_table_additive"] = ADDITIVE
    else:
        notes.append("additive table not fitted: the rounds hold only diagonal (verify-all) cells")

    calibration = None
    acceptance_path = out / ACCEPTANCE
    records = [] if args.restart else read_jsonl(acceptance_path)
    if not records and args.acceptance_requests > 0:
        records = collect_acceptance(client, requests, args.acceptance_requests, args.max_tokens)
        write_jsonl_atomic(acceptance_path, records)
    if records:
        files["acceptance"] = ACCEPTANCE
        verify_ct = sum(r.get("spec_verify_ct", 0) for r in records)
        if verify_ct:
            notes.append(f"mean accepted tokens per verify step on /generate: "
                         f"{sum(r.get('completion_tokens', 0) for r in records) / verify_ct:.3f}")
        calibration = fit_calibration(records, dataset=",".join(p.name for p in traces))
    if calibration is not None:
        calibration.save(out / STS)
        fit_calibration(records, dataset=calibration.dataset, affine=True).save(out / STS_AFFINE)
        files["sts"], files["sts_affine"] = STS, STS_AFFINE
    else:
        notes.append("STS calibration skipped: /generate meta_info has no per-step dspine_confidence_logits / "
                     "dspine_accept_lens (start the DSPINE server with DSPINE_RECORD_CONFIDENCE=1)"
                     if records else "STS calibration skipped: --acceptance-requests 0")
    if args.plain_table:
        if calibration is None:
            raise TuningError("--plain-table: the switch file needs the calibration and the prior, i.e. per-step "
                              "confidences: start the DSPINE server with DSPINE_RECORD_CONFIDENCE=1 and keep "
                              "--acceptance-requests > 0")
        from dspine.dynamic.switch import SwitchConfigError, write_switch_file

        try:
            write_switch_file(out / SWITCH, round_table=TABLE, plain_table=str(Path(args.plain_table).resolve()),
                              calibration=STS_AFFINE, prior_survival=observed_survival(records),
                              plain_tokens=args.plain_tokens)
        except SwitchConfigError as err:
            raise TuningError(f"--plain-table {args.plain_table}: {err}") from None
        files["switch"] = SWITCH
    if reference is not None:
        check = check_calibration(reference, Path(args.check_calibration), records)
        write_text_atomic(out / CHECK, json.dumps(check, indent=2) + "\n")
        files["calibration_check"] = CHECK
        notes.append(f"{args.check_calibration} on this run's {check['rounds']} verify steps: largest gap "
                     f"{check['max_abs_gap_points']:.1f} points, survival ECE {check['ece_raw']:.4f} raw -> "
                     f"{check['ece_calibrated']:.4f} calibrated")

    try:
        for name in plot_outputs(out, rounds, table, calibration):
            files[name.split(".")[0] + "_plot"] = name
    except ImportError:
        notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
    command = serve_command(args.preset, info, out / TABLE, out / STS if calibration is not None else None)
    write_text_atomic(out / MANIFEST, json.dumps(manifest(args, info, traces, requests, rounds, files, notes,
                                                          command, verify_tokens), indent=2) + "\n")
    for note in notes:
        print(f"tune-sps: note: {note}", file=sys.stderr)
    print(f"tune-sps: wrote {', '.join(files.values())} and {MANIFEST} in {out}")
    if "switch" in files:
        print(f"DSPINE_DYNAMIC={shlex.quote(str((out / SWITCH).resolve()))} ", end="")
    print(command)
    return 0


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 1,4,16,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 1,4,16,64")
    return sorted(set(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--url", help="a running OpenAI-compatible DSPINE server, e.g. http://127.0.0.1:30000")
    server.add_argument("--preset", help="start one with `dspine serve --preset NAME` (other flags after the "
                                         "options go to sglang) and stop it afterwards")
    parser.add_argument("--traces", nargs="+", required=True, help="OpenAI-request JSONL / ShareGPT JSON(L) files")
    parser.add_argument("--out", required=True, help="output directory (resumable)")
    parser.add_argument("--split", default="tune", choices=["tune", "heldout", "all"],
                        help="which hash split of the traces to replay (default: tune)")
    parser.add_argument("--concurrencies", type=_concurrencies, default=list(DEFAULT_CONCURRENCIES),
                        help="comma-separated concurrency levels (default: 1,4,16,64)")
    parser.add_argument("--requests-per-level", type=int, default=0, help="default: max(16, 4 x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on each request's max_tokens")
    parser.add_argument("--verify-tokens", type=int, default=None,
                        help="verify tokens per request per step (default: speculative_num_draft_tokens)")
    parser.add_argument("--model", default=None, help="model name for requests (default: from /server_info)")
    parser.add_argument("--acceptance-requests", type=int, default=32,
                        help="/generate calls for acceptance records (0 = skip calibration)")
    parser.add_argument("--check-calibration", metavar="FILE", default=None,
                        help="check a calibration fitted on another split (e.g. the tune run's sts_affine.json) on "
                             "this run's acceptance records, e.g. with --split heldout: writes calibration_check.json")
    parser.add_argument("--plain-table", metavar="FILE", default=None,
                        help="the sps_table.json of a run against this deployment started with DSPINE_SWITCH=plain "
                             "(and --verify-tokens 1): also write switch.json for DSPINE_DYNAMIC (the per-step "
                             "draft-or-plain switch)")
    parser.add_argument("--plain-tokens", type=int, default=1, metavar="K",
                        help="target tokens per plain step: the DSPINE_PLAIN_TOKENS the --plain-table server ran with "
                             "(default 1); written into switch.json")
    parser.add_argument("--gpu", default=None, help="GPU name for the manifest (SGLang's /server_info has none)")
    parser.add_argument("--level-timeout", type=float, default=600.0, help="seconds per level before stopping")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=1200.0, help="--preset: seconds to wait for it")
    parser.add_argument("--restart", action="store_true", help="redo every level (ignore recorded rounds)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, serve_args: list[str]) -> int:
    try:
        requests = load_traces(args.traces, split=args.split)       # before any server is started
        if args.plain_tokens < 1:
            raise TuningError(f"--plain-tokens {args.plain_tokens}: a positive integer (the DSPINE_PLAIN_TOKENS of "
                              "the --plain-table server)")
        if args.plain_table and not Path(args.plain_table).is_file():
            raise TuningError(f"--plain-table {args.plain_table}: no such file (the sps_table.json of a tune-sps run "
                              "against this deployment started with DSPINE_SWITCH=plain)")
        reference = None
        if args.check_calibration:
            from dspine.dynamic.verification import PositionCalibration
            try:
                reference = PositionCalibration.load(args.check_calibration)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise TuningError(f"--check-calibration {args.check_calibration}: {err}") from None
        if args.url:
            if serve_args:
                raise TuningError(f"unexpected arguments {serve_args}: sglang flags apply only with --preset")
            return tune(args, args.url, requests, reference)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with launched_server(args.preset, serve_args, out / "server.log", args.startup_timeout) as url:
            return tune(args, url, requests, reference)
    except (TraceError, TuningError, OSError) as err:
        print(f"tune-sps: error: {err}", file=sys.stderr)
        return 2


def add_command(subparsers) -> None:
    """`dspine tune-sps` in `dspine.cli` (unknown arguments go to sglang with --preset)."""
    parser = subparsers.add_parser("tune-sps", help="measure an SPS table (and STS calibration) on your traces",
                                   description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_arguments(parser)
    parser.set_defaults(func=lambda args: run(args, args.extra), accepts_extra=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tune_sps", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    return run(args, extra)


if __name__ == "__main__":
    sys.exit(main())
