"""`dspine tune-sps`: measure a deployment's SPS table (and STS calibration) on the user's traces.

Replays trace requests (`dspine.data.traces`, the "tune" split by default) against a running
OpenAI-compatible DSPINE server (`--url`), or one started here through `dspine serve`'s command
builder (`--preset`, stopped afterwards), at a sweep of concurrencies (default 1, 4, 16, 64).

Step time, per concurrency level, from one of three sources (each row says which in `source`):

* `dspine_step_clock` (preferred): a DSPINE server started with `SGLANG_RECORD_STEP_TIME=1` also
  reports its worker's decode-step periods (`internal_states[*].dspine_step_time_dict`,
  written by the worker's step clock): launch-to-launch time of consecutive decode steps, prefills
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
* `switch.json` with `--plain-table FILE` (the `sps_table.json` of a run, with `--verify-tokens 1`,
  against the same deployment started with a forced plain switch file, `DSPINE_DYNAMIC=<file>` holding
  `{"force": "plain", "plain_tokens": K}`; pass the same `--plain-tokens K`): the speculation switch's
  file (`dspine.dynamic.switch`): this run's table for drafting steps, FILE for plain steps of K
  tokens, the affine calibration and the prior (the acceptance records' observed survival per
  position).
* `manifest.json`, `sps.png` (+ `calibration.png`; skipped without matplotlib), and, printed last,
  the command that serves this deployment with them: `DSPINE_DYNAMIC=<out>/switch.json dspine serve
  --preset NAME ...` (`sglang serve ...` with `--url`). A DSPINE server reads the tables and the
  calibration only through a switch file, so without `--plain-table` the command serves statically
  and a note says how to get the switch file.

Modules: `tune_sps_cli` (the command line, light: no torch), `sps_measure` (replay, step times,
acceptance records, a server from a preset), `sps_fit` (tables, calibration), this one (the sweep
and the outputs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from dspine import env
from dspine.data.traces import TraceError, TraceRequest, file_sha256, load_traces
from dspine.dynamic.calibration import PositionCalibration
from dspine.dynamic.cost_tables import sps_table_to_json
from dspine.dynamic.switch import SwitchConfigError, write_switch_file
from dspine.serve.flags import ALGORITHM
from dspine.serve.sps_fit import (
    TuningError,
    check_calibration,
    fit_additive,
    fit_calibration,
    fit_diagonal,
    observed_survival,
)
from dspine.serve.sps_measure import (
    clock_delta,
    clock_totals,
    collect_acceptance,
    launched_server,
    level_rows,
    new_step_times,
    replay,
    step_time_dict,
)
from dspine.utils.atomic import write_json_atomic, write_jsonl_atomic, write_text_atomic
from dspine.utils.http import HttpClient, HttpError
from dspine.utils.plot import save_figure

DEFAULT_VERIFY_TOKENS = 16
ROUNDS, TABLE, ADDITIVE, ACCEPTANCE, STS, STS_AFFINE, CHECK, MANIFEST = (
    "rounds.jsonl", "sps_table.json", "sps_table_additive.json", "acceptance.jsonl", "sts.json", "sts_affine.json",
    "calibration_check.json", "manifest.json")
SWITCH = "switch.json"
_FLAG_KEYS = ("tp_size", "dp_size", "pp_size", "attention_backend", "cuda_graph_max_bs", "cuda_graph_bs",
              "disable_cuda_graph", "max_running_requests", "mem_fraction_static", "enable_dp_attention",
              "disable_overlap_schedule", "dtype", "kv_cache_dtype")


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
    save_figure(fig, out / "sps.png", dpi=120)
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
        save_figure(fig, out / "calibration.png", dpi=120)
        written.append("calibration.png")
    return written


def serve_command(preset: str | None, serve_args: list[str], info: dict, switch: Path | None) -> str:
    """The command that serves the measured deployment with the switch file `switch` (None: none
    was written, the server speculates statically). With `preset`: `dspine serve --preset` and the
    sglang flags the sweep's server ran with; else `sglang serve` with the target, the drafter and the
    verify width the server at --url reports. Every flag is one a DSPINE server reads."""
    if preset is not None:
        args = ["dspine", "serve", "--preset", preset, *serve_args]
    else:
        args = ["sglang", "serve", "--model-path", str(info.get("model_path") or "<target>"),
                "--speculative-algorithm", ALGORITHM, "--speculative-draft-model-path",
                str(info.get("speculative_draft_model_path") or "<drafter>")]
        if info.get("speculative_num_draft_tokens"):
            args += ["--speculative-num-draft-tokens", str(info["speculative_num_draft_tokens"])]
    prefix = [] if switch is None else [f"{env.DSPINE_DYNAMIC.name}={shlex.quote(str(switch.resolve()))}"]
    return " ".join(prefix + [shlex.join(args)])


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


# ------------------------------------------------------------------------------------ the sweep
def tune(args, url: str, requests: list[TraceRequest], reference=None, serve_args: list[str] = ()) -> int:
    """The sweep, the fits and the outputs in args.out for the server at `url`; `reference`: the
    `--check-calibration` file's PositionCalibration (read before any server started), or None;
    `serve_args`: the sglang flags a --preset server was started with."""
    serve_args = list(serve_args)
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = [Path(p) for p in args.traces]
    client = HttpClient(url, timeout=args.request_timeout)
    replay_client = HttpClient(url, timeout=args.request_timeout, retries=0)   # a retry would skew latencies
    try:
        info = client.get("/server_info")
    except (HttpError, ValueError) as err:
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
            results, errors = replay(replay_client, requests, c, counts[c], model=model, max_tokens=args.max_tokens,
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
        try:
            write_switch_file(out / SWITCH, round_table=TABLE, plain_table=str(Path(args.plain_table).resolve()),
                              calibration=STS_AFFINE, prior_survival=observed_survival(records),
                              plain_tokens=args.plain_tokens)
        except SwitchConfigError as err:
            raise TuningError(f"--plain-table {args.plain_table}: {err}") from None
        files["switch"] = SWITCH
    if reference is not None:
        check = check_calibration(reference, Path(args.check_calibration), records)
        write_json_atomic(out / CHECK, check)
        files["calibration_check"] = CHECK
        notes.append(f"{args.check_calibration} on this run's {check['rounds']} verify steps: largest gap "
                     f"{check['max_abs_gap_points']:.1f} points, survival ECE {check['ece_raw']:.4f} raw -> "
                     f"{check['ece_calibrated']:.4f} calibrated")

    try:
        for name in plot_outputs(out, rounds, table, calibration):
            files[name.split(".")[0] + "_plot"] = name
    except ImportError:
        notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
    if "switch" not in files:
        notes.append(f"no {SWITCH} (pass --plain-table): a DSPINE server reads the SPS table and the calibration only "
                     f"through a switch file, so the command below serves statically. Measure the plain table with "
                     f"--verify-tokens 1 against this deployment started with {env.DSPINE_DYNAMIC.name}=<a forced "
                     'plain switch file: {"force": "plain", "plain_tokens": K}>, then rerun with --plain-table')
    command = serve_command(args.preset, serve_args, info, out / SWITCH if "switch" in files else None)
    write_json_atomic(out / MANIFEST, manifest(args, info, traces, requests, rounds, files, notes, command,
                                               verify_tokens))
    for note in notes:
        print(f"tune-sps: note: {note}", file=sys.stderr)
    print(f"tune-sps: wrote {', '.join(files.values())} and {MANIFEST} in {out}")
    print(command)
    return 0


def run(args: argparse.Namespace, serve_args: list[str]) -> int:
    try:
        requests = load_traces(args.traces, split=args.split)       # before any server is started
        if args.plain_tokens < 1:
            raise TuningError(f"--plain-tokens {args.plain_tokens}: a positive integer (the plain_tokens of the "
                              "forced plain switch file the --plain-table server ran with)")
        if args.plain_table and not Path(args.plain_table).is_file():
            raise TuningError(f"--plain-table {args.plain_table}: no such file (the sps_table.json of a tune-sps run "
                              "against this deployment started with a forced plain switch file)")
        reference = None
        if args.check_calibration:
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
            return tune(args, url, requests, reference, serve_args)
    except (TraceError, TuningError, HttpError, OSError) as err:
        print(f"tune-sps: error: {err}", file=sys.stderr)
        return 2
