"""Round-cost benchmark: AR's decode step against a speculative round, side by side, with host time.

For each config (AR, DSPINE, DSPINE-copy, DSPINE-eager, DFLASH, NGRAM) a server already runs (`--url NAME=URL`),
started with `DSPINE_STEP_PROFILE=DIR` (`--profile-dir NAME=DIR`, same machine) and
`DSPINE_STEP_PROFILE_PHASES` = the number of concurrency levels. Per config and concurrency c:

1. Step profile: greedy chat requests at c in flight until the server's profiler has written the
   level's phase (`dspine.sglang.step_profile`): `ms_per_step` = server-side wall time per decode
   step (AR) or round (speculative), prefills excluded; `host_ms_per_step` = host time inside the
   scheduler's methods per step (`ms_per_step_in`, summed; each method's share is kept in the row)
   less its wait for the device (`wait_ms_per_step`: a step with a long wait is device-bound).
2. Throughput: `--prompts` greedy chat requests (`--workload`: an evaluation set, the five-set mix,
   `synthetic:N`, prompts of about N tokens of plain prose for context-length sweeps, or
   `trace:FILE`, the multi-turn requests of a trace file, e.g. coding-agent sessions with 2k-6k-token
   contexts; rows name it by the file's stem) at c in flight, non-streamed with meta_info:
   `output_tok_per_s` (completion tokens / wall time) and `accept_len` (completion tokens / verify
   steps; 1.0 for AR). With `--repeats R` the
   levels run R times, the configs interleaved within each repeat (AR, DSPINE, ... , AR, DSPINE,
   ...) so drift on the host is shared; `output_tok_per_s` is the mean and
   `output_tok_per_s_repeats` keeps each repeat.

Every (repeat, level) sends its own `--prompts` prompts, the same ones to every config, and the
step profile drives a further pool of 64: no server sees a prompt twice, which matters for NGRAM
(it remembers earlier outputs). `--skip-prompts K` leaves out each set's first K prompts, for
servers an earlier benchmark already sent them to.
3. Parity (`--parity N`, AR and DSPINE both given, or the servers of `--parity-url`): N greedy mix
   prompts, one at a time, on both servers; `deterministic_parity` = `{"prompts", "identical",
   "note", ...}`, identical meaning equal token ids, plus each divergence with the AR server's
   top-2 logprob gap there and the token its own one-pass prefill of prompt + common prefix picks
   (`dspine.bench.parity`). The note records both servers' `enable_deterministic_inference` and
   attention backends as `/server_info` reports them, and what the divergences are.

Every profile phase of a config runs before its throughput levels: the profiler counts every decode
step, so a throughput level run between two phases would be measured as the next phase. Hence
`--temperature 0,1` measures both temperatures in one run (phases: each temperature's levels in
turn, then the throughput levels); a phase whose mean batch size is not about its level's
concurrency is refused, naming the cause.

DSPINE-copy is a DSPINE server whose drafter has `copy_candidates: true`; any other `DSPINE-<label>`
names a DSPINE server started with a setting of the caller's (e.g. `DSPINE-splitkv` with
`DSPINE_VERIFY_SPLITKV=1`). DSPINE-eager is a DSPINE server with `DSPINE_ROUND_GRAPH=0` (SGLang's DFlash round, step by step),
the control for the captured round. The table puts each config's ms per step over AR's at the same
concurrency (T_round / T_step).

Writes OUT_DIR/<results-name>.json and .png (`plot`; `--report-only` redraws both from the JSON): `{"device", "date", "command", "sglang", "runs": [{"config",
"shape", "workload", "concurrency", "temperature", "prompt_tokens", "ms_per_step", "host_ms_per_step",
"output_tok_per_s", "accept_len", "wait_ms_per_step", "ms_per_step_in", "mean_batch_size"}]}`; runs of other shapes,
configs or temperatures already in
the file are kept (one file gathers SmolLM2 and 8B-shaped servers), as are its `soak` and
`deterministic_parity` sections.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from dspine.bench.chat_client import (chat_body, load_prompt_mix, load_set_prompts, load_trace_prompts, parity_pass,
                                      run_level)
from dspine.bench.launchers import detect_device
from dspine.bench.launchers import parse_urls
from dspine.bench.parity import NEAR_TIE_NATS, parity_summary, prefill_check
from dspine.bench.results import BenchError, check_schema, command_line, write_results
from dspine.data.eval_sets import EVAL_SETS
from dspine.sglang.round_graph import STAGES
from dspine.sglang.step_profile import drive
from dspine.utils.http import HttpClient, HttpError
from dspine.utils.plot import pyplot, save_figure

CONFIGS = ("AR", "DSPINE", "DSPINE-copy", "DSPINE-eager", "DFLASH", "NGRAM")


def config_order(name: str) -> tuple[int, str]:
    """Sort key: the named configs in `CONFIGS` order; other DSPINE variants (`DSPINE-<label>`, a
    DSPINE server started with some other setting) right after DSPINE-eager, by name."""
    if name in CONFIGS:
        return CONFIGS.index(name), ""
    return CONFIGS.index("DSPINE-eager"), name


def known_config(name: str) -> bool:
    return name in CONFIGS or (name.startswith("DSPINE-") and len(name) > len("DSPINE-"))
RESULTS_NAME = "round_cost_h200"
RUN_SCHEMA = {"config": str, "shape": str, "workload": str, "concurrency": int, "prompt_tokens": int,
              "ms_per_step": float, "host_ms_per_step": float, "output_tok_per_s": float, "accept_len": float}
RESULTS_SCHEMA = {"device": str, "date": str, "command": str, "sglang": str, "runs": [RUN_SCHEMA]}


def profile_record(profile_dir: Path, phase: int) -> dict:
    """The step profiler's record of `phase` (1-based, the server's phase files in order)."""
    files = sorted(profile_dir.glob("*-phase*.json"), key=lambda f: int(f.stem.rsplit("phase", 1)[1]))
    if len(files) < phase:
        raise BenchError(f"{profile_dir}: {len(files)} phase records, phase {phase} wanted (was the server "
                         "started with DSPINE_STEP_PROFILE set to this folder, and enough phases?)")
    return json.loads(files[phase - 1].read_text())


SYNTHETIC_PROSE = ("The river turned east past the old mill, where the road from the valley met the "
                   "track to the quarry, and the carts waited in the shade until the bell rang. ")


def synthetic_prompts(tokens: int, count: int) -> list[dict]:
    """`count` chat prompts of about `tokens` tokens each (prose repeated, numbered so no two are
    the same; the server reports the exact count as `prompt_tokens`)."""
    words_per_repeat = len(SYNTHETIC_PROSE.split())
    repeats = max(1, round(tokens / (1.3 * words_per_repeat)))        # ~1.3 tokens per English word
    return [{"id": f"synthetic-{tokens}-{i}", "source": "synthetic", "messages": [
        {"role": "user", "content": f"Passage {i}: " + SYNTHETIC_PROSE * repeats + "Summarise the passage."}]}
        for i in range(count)]


def host_ms(record: dict) -> float:
    """Host milliseconds per decode step: the scheduler's timed methods, summed, less the time they
    spent waiting for the device."""
    return float(sum(record["ms_per_step_in"].values()) - record.get("ms_per_step_waiting", 0.0))


def prompt_tokens(base: str, bodies: list[dict], timeout: float) -> int:
    """Mean prompt tokens of `bodies` as the server counts them (one 1-token request each)."""
    client = HttpClient(base, timeout=timeout, retries=1)
    counts = []
    for body in bodies:
        usage = client.post("/v1/chat/completions", {**body, "max_tokens": 1})["usage"]
        counts.append(int(usage["prompt_tokens"]))
    return round(statistics.fmean(counts))


PROFILE_POOL = 64      # prompts the step-profile phases cycle through, apart from the throughput levels


def check_phase_batch(name: str, phase: int, concurrency: int, mean_batch_size: float) -> None:
    """A phase measured at `concurrency` in flight has a mean decode batch of about that size (half to
    one and a half times it); anything else means other steps filled the phase."""
    if not 0.5 * concurrency <= mean_batch_size <= 1.5 * concurrency:
        raise BenchError(f"{name}: the step profile's phase {phase} (c={concurrency}) measured a mean batch of "
                         f"{mean_batch_size:.1f}: other decode steps filled it (an earlier run's throughput levels "
                         "or another client). Fix: measure every temperature in one run (--temperature 0,1) on a "
                         "freshly started server, with DSPINE_STEP_PROFILE_PHASES = temperatures x levels")


def profile_config(name: str, base: str, profile_dir: Path | None, args, bodies: dict[float, list[dict]]) -> list[dict]:
    """One config's rows, one per (temperature, concurrency level), with its step-profile phases
    measured in that order (when given a folder; see the module docstring). `bodies`: the profile
    pool's requests per temperature."""
    first = bodies[args.temperature[0]]
    tokens = prompt_tokens(base, first[: min(8, len(first))], args.request_timeout)
    runs = [{"config": name, "shape": args.shape, "workload": args.workload_name, "concurrency": c,
             "temperature": t, "prompt_tokens": tokens} for t in args.temperature for c in args.concurrency]
    if profile_dir is not None:
        for level, row in enumerate(runs, args.profile_from_phase):
            c = row["concurrency"]
            load = drive(base, profile_dir, bodies[row["temperature"]], c, want_files=level,
                         timeout_s=args.profile_timeout)
            if not load["phase_done"]:
                raise BenchError(f"{name}: the step profile's phase {level} (c={c}) did not finish within "
                                 f"{args.profile_timeout:.0f} s ({load['tokens']} tokens sent)")
            record = profile_record(profile_dir, level)
            check_phase_batch(name, level, c, float(record["mean_batch_size"]))
            row.update(ms_per_step=float(record["ms_per_step"]), host_ms_per_step=host_ms(record),
                       wait_ms_per_step=float(record.get("ms_per_step_waiting", 0.0)),
                       ms_per_step_in={name: round(float(ms), 4) for name, ms in record["ms_per_step_in"].items()},
                       mean_batch_size=float(record["mean_batch_size"]))
    return runs


def level_prompts(args) -> int:
    """Prompts one (repeat, level) sends: `--prompts`, at least one wave of the largest level."""
    return max(args.prompts, max(args.concurrency))


def throughput(rows: dict[str, list[dict]], args, bodies: dict[float, list[dict]]) -> None:
    """Fill each row's `output_tok_per_s` (mean over `args.repeats`, each kept in
    `output_tok_per_s_repeats`) and `accept_len` (over every repeat's replies), configs interleaved
    within each repeat; (repeat r, row i) sends slice r * rows + i of its temperature's `bodies`."""
    samples: dict[tuple[str, int], list[dict]] = {}
    size = level_prompts(args)
    for repeat in range(args.repeats):
        for name, runs in rows.items():
            for i, row in enumerate(runs):
                c = row["concurrency"]
                start = (repeat * len(runs) + i) * size
                stats, _ = run_level(args.urls[name].rstrip("/"), bodies[row["temperature"]][start: start + size], c,
                                     args.request_timeout, streamed=False)
                samples.setdefault((name, c), []).append(stats)
                print(f"{name:<13} c={c:<3} repeat {repeat + 1}/{args.repeats}: "
                      f"{stats['output_tok_per_s']:.1f} tok/s, accept {stats['accept_len']:.3f}", flush=True)
    for name, runs in rows.items():
        for row in runs:
            level = samples[(name, row["concurrency"])]
            rates = [s["output_tok_per_s"] for s in level]
            tokens = sum(s["completion_tokens"] for s in level)
            steps = sum(s["steps"] for s in level)
            row.update(output_tok_per_s=float(statistics.fmean(rates)),
                       output_tok_per_s_repeats=[round(r, 2) for r in rates],
                       accept_len=float(tokens / steps) if steps else 1.0)


def parity(args, prompts: list[dict]) -> dict:
    """`deterministic_parity` of the DSPINE server against AR on `args.parity` mix prompts (see the
    module docstring): the counts, each divergence with the AR server's top-2 gap there
    (`dspine.bench.parity`) and which token the AR server's own one-pass prefill of prompt + common
    prefix picks (`prefill_picks`: "spec" means the target's multi-token forward itself chooses
    DSPINE's token there, the numerics of a verify rather than a fault of the round)."""
    prompts = prompts[: args.parity]
    bodies = [chat_body(p, args.served_model, args.max_tokens) for p in prompts]
    urls = {name: url.rstrip("/") for name, url in {**args.urls, **args.parity_urls}.items()}
    ar = parity_pass(urls["AR"], bodies, args.request_timeout, logprobs=True)
    spec = parity_pass(urls["DSPINE"], bodies, args.request_timeout, logprobs=False)
    block = prefill_check(urls["AR"], ar, spec, parity_summary(ar, spec, prompts, NEAR_TIE_NATS), prompts,
                          args.request_timeout)
    modes = []
    for name in ("AR", "DSPINE"):
        info = HttpClient(urls[name], timeout=30, retries=1).get("/server_info")
        modes.append(f"{name}: enable_deterministic_inference={info.get('enable_deterministic_inference')}, "
                     f"attention_backend={info.get('attention_backend')}")
    picks = block["prefill_picks"]
    found = (f"; of {len(block['divergences'])} divergences, {block['near_tie_divergences']} are near-ties "
             f"(top-2 gap <= {NEAR_TIE_NATS} nats) and the AR server's one-pass prefill picks DSPINE's token at "
             f"{picks['spec']}, its own at {picks['ar']}, neither at {picks['neither']}") if block["divergences"] else ""
    return {**block, "note": "; ".join(modes) + found}

def table(results: dict) -> str:
    """ms per step (and / AR's at the same shape, workload and concurrency), host ms, tok/s, accept
    length."""
    ar = {(r["shape"], r["workload"], r["concurrency"]): r["ms_per_step"] for r in results["runs"]
          if r["config"] == "AR" and "ms_per_step" in r}
    lines = [f"{'config':<15}{'shape':<15}{'workload':<18}{'c':>4}{'ms/step':>10}{'/ AR':>8}{'host ms':>10}"
             f"{'tok/s':>10}{'accept':>8}"]
    for r in sorted(results["runs"], key=lambda r: (r["shape"], r["workload"], r["concurrency"],
                                                    config_order(r["config"]))):
        ms = r.get("ms_per_step")
        ref = ar.get((r["shape"], r["workload"], r["concurrency"]))
        lines.append(f"{r['config']:<15}{r['shape']:<15}{r['workload']:<18}{r['concurrency']:>4}"
                     f"{'-' if ms is None else f'{ms:.3f}':>10}{f'{ms / ref:.2f}x' if ms and ref else '-':>8}"
                     f"{'-' if r.get('host_ms_per_step') is None else format(r['host_ms_per_step'], '.3f'):>10}"
                     f"{r['output_tok_per_s']:>10.1f}{r['accept_len']:>8.2f}")
    return "\n".join(lines)

def plot(results: dict, out_dir: Path, stem: str) -> Path | None:
    """`stem`.png, one column per (shape, workload) with step profiles: T_round / T_step per config
    and concurrency (top), tok/s / AR with each repeat's spread (middle); and, when the results
    carry `round_stages_device_ms`, the captured round's device ms per stage (bottom). None (with a
    note) without matplotlib."""
    plt = pyplot("run `--report-only` where it is installed")
    if plt is None:
        return None
    runs = [r for r in results["runs"] if "ms_per_step" in r]
    groups = list(dict.fromkeys((r["shape"], r["workload"]) for r in runs))
    stages = results.get("round_stages_device_ms") or {}
    if not groups:
        print("no step-profiled runs: no plot", flush=True)
        return None
    rows = 3 if stages else 2
    fig, axes = plt.subplots(rows, len(groups), figsize=(5.5 * len(groups), 3.6 * rows), squeeze=False)
    for col, (shape, workload) in enumerate(groups):
        cell = {(r["config"], r["concurrency"]): r for r in runs if (r["shape"], r["workload"]) == (shape, workload)}
        levels = sorted({c for _, c in cell})
        configs = sorted({k[0] for k in cell}, key=config_order)
        width = 0.8 / max(1, len(configs))
        for i, name in enumerate(configs):
            xs, step, speed, low, high = [], [], [], [], []
            for j, c in enumerate(levels):
                row, ar = cell.get((name, c)), cell.get(("AR", c))
                if row is None or ar is None:
                    continue
                rates = row.get("output_tok_per_s_repeats") or [row["output_tok_per_s"]]
                xs.append(j + (i - (len(configs) - 1) / 2) * width)
                step.append(row["ms_per_step"] / ar["ms_per_step"])
                speed.append(row["output_tok_per_s"] / ar["output_tok_per_s"])
                low.append(max(0.0, speed[-1] - min(rates) / ar["output_tok_per_s"]))
                high.append(max(0.0, max(rates) / ar["output_tok_per_s"] - speed[-1]))
            axes[0][col].bar(xs, step, width, label=name)
            axes[1][col].bar(xs, speed, width, yerr=[low, high], capsize=2, label=name)
        for row, title in ((0, "ms per round / AR's ms per step"), (1, "output tok/s / AR (repeats: min-max)")):
            ax = axes[row][col]
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xticks(range(len(levels)), [f"c={c}" for c in levels])
            ax.set_title(f"{shape}, {workload}: {title}", fontsize=9)
        axes[0][col].legend(fontsize=7)
    if stages:
        names = list(STAGES)
        labels = [f"{cfg} bs {bs}" for cfg, sizes in stages.items() for bs in sizes]
        values = [sizes[bs] for sizes in stages.values() for bs in sizes]
        for col in range(len(groups)):
            ax = axes[2][col]
            if col:
                ax.axis("off")
                continue
            bottom = [0.0] * len(values)
            for name in names:
                part = [v.get(name, 0.0) for v in values]
                ax.barh(labels, part, left=bottom, label=name)
                bottom = [b + x for b, x in zip(bottom, part)]
            ax.set_xlabel("device ms per captured round (DSPINE_ROUND_TIMING)")
            ax.legend(fontsize=7, ncol=len(names), loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.suptitle(f"Round cost on {results.get('device', '?')} (SGLang {results.get('sglang', '?')})")
    return save_figure(fig, out_dir / f"{stem}.png", dpi=110)


def merge(old: dict | None, new_runs: list[dict], header: dict) -> dict:
    """`header` and `new_runs`, plus the old file's runs of other (config, shape, workload,
    concurrency, temperature) keys and its soak / parity sections."""
    key = lambda r: (r["config"], r["shape"], r["workload"], r["concurrency"], r.get("temperature", 0.0))  # noqa: E731
    fresh = {key(r) for r in new_runs}
    kept = [r for r in (old or {}).get("runs", []) if key(r) not in fresh]
    merged = {**{k: v for k, v in (old or {}).items() if k not in header and k != "runs"}, **header,
              "runs": kept + new_runs}
    return merged


def temperatures(text: str) -> list[float]:
    """`--temperature`: comma-separated temperatures >= 0, each once."""
    values = [float(x) for x in text.split(",")]
    if any(not v >= 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: temperatures >= 0, comma-separated, each once (e.g. 0,1)")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="T_step against T_round, with host time per step, for servers already running "
                    "(see the module docstring for how to start them).",
        epilog="Example: DSPINE_STEP_PROFILE=/tmp/prof/AR sglang serve ... (and one per config), then "
               "python scripts/bench_round_cost.py --url AR=http://127.0.0.1:30020 --profile-dir AR=/tmp/prof/AR "
               "--url DSPINE=http://127.0.0.1:30021 --profile-dir DSPINE=/tmp/prof/DSPINE --shape smollm2-135m")
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="a running server per config; NAME one of " + ", ".join(CONFIGS)
                        + ", or DSPINE-<label> for another DSPINE server setting")
    p.add_argument("--profile-dir", action="append", default=[], metavar="NAME=DIR",
                   help="that server's DSPINE_STEP_PROFILE folder (without it: no ms_per_step / host time)")
    p.add_argument("--shape", help="label of the target's shape, e.g. smollm2-135m or qwen3-8b (required to measure)")
    p.add_argument("--workload", default="mix",
                   help="an evaluation set (%s), mix (default: the five), synthetic:N (prompts of ~N tokens), "
                        "or trace:FILE (a trace file's multi-turn requests, e.g. python -m dspine.data.agentic's "
                        "agentic_coding.jsonl; rows name the workload by the file's stem)" % ", ".join(EVAL_SETS))
    p.add_argument("--prompts-dir", type=Path, default=None, help="exported evaluation prompts (eval-<set>.jsonl)")
    p.add_argument("--prompts", type=int, default=32, help="requests per throughput level (at least c)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=temperatures, default=[0.0], metavar="T[,T...]",
                   help="sampling temperature(s) of the requests (default 0: greedy); several, e.g. 0,1, are "
                        "measured in one run, each temperature's levels in turn; rows record it")
    p.add_argument("--served-model", default="default")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--profile-timeout", type=float, default=120.0, help="seconds per step-profile phase")
    p.add_argument("--profile-from-phase", type=int, default=1, metavar="K",
                   help="the first step-profile phase this run reads (default 1; a server an earlier run "
                        "profiled has written phases 1..K-1 already)")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--results-name", default=RESULTS_NAME)
    p.add_argument("--repeats", type=int, default=1, help="throughput repeats, configs interleaved (default 1)")
    p.add_argument("--parity", type=int, default=0, metavar="N",
                   help="also compare AR's and DSPINE's greedy token ids on N mix prompts (deterministic_parity)")
    p.add_argument("--parity-url", action="append", default=[], metavar="NAME=URL",
                   help="AR=... / DSPINE=...: the servers --parity compares, when not the measured ones "
                        "(e.g. both started with --enable-deterministic-inference)")
    p.add_argument("--skip-prompts", type=int, default=0, metavar="K",
                   help="leave out each set's first K prompts (an earlier run sent them to these servers)")
    p.add_argument("--report-only", action="store_true",
                   help="print the table and redraw the plot from OUT_DIR/<results-name>.json; measure nothing")
    args = p.parse_args(argv)
    if not args.report_only and (not args.url or not args.shape):
        p.error("--url NAME=URL (at least one) and --shape are required to measure (or give --report-only)")
    args.urls = parse_urls(args.url)
    args.parity_urls = parse_urls(args.parity_url) if args.parity_url else {}
    args.profiles = {k: Path(v) for k, v in (item.split("=", 1) for item in args.profile_dir)}
    unknown = {name for name in set(args.urls) | set(args.profiles) if not known_config(name)}
    if unknown:
        p.error(f"unknown config(s) {sorted(unknown)}; choose from {', '.join(CONFIGS)} or DSPINE-<label> "
                "(as NAME=...)")
    synthetic = args.workload.startswith("synthetic:") and args.workload.split(":", 1)[1].isdigit()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.parity and not {"AR", "DSPINE"} <= set(args.urls) | set(args.parity_urls):
        p.error("--parity compares AR with DSPINE: give --url AR=... and --url DSPINE=...")
    args.trace = Path(args.workload.split(":", 1)[1]) if args.workload.startswith("trace:") else None
    if args.trace is not None and not args.trace.is_file():
        p.error(f"--workload {args.workload}: no such trace file (python -m dspine.data.agentic DIR writes "
                "agentic_coding.jsonl and agentic_sharegpt.jsonl)")
    if args.workload != "mix" and args.workload not in EVAL_SETS and not synthetic and args.trace is None:
        p.error(f"--workload {args.workload}: one of {', '.join(EVAL_SETS)}, mix, synthetic:N (N tokens) or trace:FILE")
    args.workload_name = args.trace.stem if args.trace is not None else args.workload
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.out_dir / f"{args.results_name}.json"
    if args.report_only:
        if not path.is_file():
            print(f"round cost: --report-only: no {path}", file=sys.stderr)
            return 1
        results = json.loads(path.read_text())
        print(table(results))
        plot(results, args.out_dir, args.results_name)
        return 0
    n = level_prompts(args) * args.repeats * len(args.concurrency) * len(args.temperature) + PROFILE_POOL
    if args.workload.startswith("synthetic:"):
        prompts = synthetic_prompts(int(args.workload.split(":", 1)[1]), n + args.skip_prompts)[args.skip_prompts:]
    elif args.workload == "mix":
        prompts = load_prompt_mix(n, args.prompts_dir, args.skip_prompts)
    else:
        try:
            prompts = (load_trace_prompts(args.trace, n, args.skip_prompts) if args.trace is not None
                       else load_set_prompts(args.workload, n, args.prompts_dir, args.skip_prompts))
        except BenchError as exc:
            print(f"round cost: {exc}", file=sys.stderr)
            return 1
        if len(prompts) < n:
            print(f"round cost: {args.workload_name} has {len(prompts)} prompts after skipping "
                  f"{args.skip_prompts}, {n} wanted (levels x temperatures x repeats x --prompts + "
                  f"{PROFILE_POOL}); lower --prompts or --repeats",
                  file=sys.stderr)
            return 1
    bodies = {t: [chat_body(p, args.served_model, args.max_tokens, temperature=t) for p in prompts]
              for t in args.temperature}
    profile_bodies = {t: b[-PROFILE_POOL:] for t, b in bodies.items()}
    level_bodies = {t: b[:-PROFILE_POOL] for t, b in bodies.items()}
    rows: dict[str, list[dict]] = {}
    info, sections = {}, {}
    try:
        for name in sorted(args.urls, key=config_order):     # a config that fails here is left out
            base = args.urls[name].rstrip("/")
            try:
                info = info or HttpClient(base, timeout=30, retries=1).get("/server_info")
                rows[name] = profile_config(name, base, args.profiles.get(name), args, profile_bodies)
            except (BenchError, HttpError) as exc:
                print(f"round cost: {name} left out: {exc}", file=sys.stderr)
        if not rows:
            return 1
        throughput(rows, args, level_bodies)
    except (BenchError, HttpError) as exc:
        print(f"round cost: {exc}", file=sys.stderr)
        return 1
    status = 0
    if args.parity:     # a failed parity pass leaves the measured runs to be written, and the exit status 1
        try:
            block = parity(args, load_prompt_mix(args.parity, args.prompts_dir))
            sections["deterministic_parity"] = block
            print(f"parity: {block['identical']} of {block['prompts']} identical; {block['note']}")
        except (BenchError, HttpError) as exc:
            print(f"round cost: parity not measured: {exc}", file=sys.stderr)
            status = 1
    runs = [row for runs in rows.values() for row in runs]
    old = json.loads(path.read_text()) if path.is_file() else None
    header = {"device": detect_device(info), "date": datetime.date.today().isoformat(),
              "command": command_line(argv), "sglang": str(info.get("version", "unknown"))}
    results = {**merge(old, runs, header), **sections}
    check_schema({**results, "runs": [r for r in results["runs"] if "ms_per_step" in r]}, RESULTS_SCHEMA)
    write_results(results, args.out_dir, args.results_name)
    print(table(results))
    plot(results, args.out_dir, args.results_name)
    print(f"wrote {path}")
    return status
