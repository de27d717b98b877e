"""Served copy-candidates benchmark: AR, NGRAM, DSPINE and DSPINE-copy SGLang servers on long
agentic traces and on the five evaluation sets, over HTTP.

Configs (SGLang flags; AR's and DSPINE's are `dspine.bench.serving.server_configs`'):
* AR: the target alone.
* NGRAM: SGLang's drafter-free `--speculative-algorithm NGRAM` with SGLang's defaults. NGRAM's cache
  keeps the tokens of the requests it served (prompt tails and outputs), so a prompt sent twice to
  one NGRAM server would be drafted from memory. Every level therefore sends prompts the server has
  not seen: each workload's levels take distinct slices of its pool, and the warm-up prompt is not
  in any workload; when a pool is too small for that, the NGRAM server is restarted before the
  level that would repeat a prompt (with `--url` it cannot be: NGRAM's levels stop there).
* DSPINE: the drafter `--draft`, copy candidates off (as in its config).
* DSPINE-copy: the same drafter with `dspine_config.copy_candidates = true` and the `--copy-set`
  overrides: a variant checkpoint folder `OUT_DIR/<results-name>_dspine_copy` holding that
  config.json and symlinks to the drafter's other files.
* DFLASH (with `--dflash-draft DIR`): SGLang's DFlash with that drafter.
* DSPINE-ablation (with `--ablation-draft DIR`): DSPINE with the DFlash-style ablation drafter trained
  beside `--draft` (same data, steps, seed): the served comparison of #21 (DSPINE, its ablation,
  NGRAM and AR on the same prompts), which `dspine bench-accept --merge ... --served FILE` joins to
  the acceptance results.

Workloads: each `--agentic` trace file (named by its stem, `agentic: true`; its `--agentic-split`)
and each evaluation set (`dspine.data.eval_sets.EVAL_SETS`, `agentic: false`; `--prompts-dir` reads
their exports). One level per (workload, concurrency): max(--prompts-per-workload, c) prompts of
the workload (at most its pool), greedy, fixed max_tokens, every request non-streamed with
`return_meta_info` (`dspine.bench.chat_client.run_level`): output_tok_per_s = completion tokens /
the level's wall time; accept_len = sum completion tokens / sum spec_verify_ct (1.0 for AR).

Each run also keeps `steps` (decode steps: rounds for the speculative configs, tokens for AR),
`wall_s` and `ms_per_step` = wall x streams in flight / steps, a client-side T_round (T_step for AR)
that includes prefills and HTTP turnaround.

One server per config serves every workload; configs run one after the other, levels by
concurrency then workload, and the results file is rewritten after every level. With
`--parallel-start` every config's server is started at once beforehand (config i on port
--port + i), so their start-ups overlap; only the measured one gets requests. `--time-budget-s`:
each config gets an equal share of the time left after the server starts still to come; levels
past it are skipped and named, the results keep what was measured.

Writes OUT_DIR/<results-name>.json (exactly `RESULTS_SCHEMA`; device from nvidia-smi, else the
server's /server_info; SGLang's version from the server), prints the table (accept length and
tok/s / AR per workload, concurrency and config) with the must-reach checks (`summary`), and draws
OUT_DIR/<results-name>.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dspine.bench.chat_client import chat_body, load_set_prompts, load_trace_prompts, run_level, send_with_meta
from dspine.bench.launchers import (
    PrestartedServers,
    UrlLauncher,
    add_server_arguments,
    check_server_arguments,
    detect_device,
    launcher_for,
)
from dspine.bench.results import BenchError, check_schema, command_line, write_results
from dspine.bench.serving import SERVER_START_S, SERVER_STOP_S, server_configs as serving_configs
from dspine.data.eval_sets import EVAL_SETS
from dspine.data.traces import TraceRequest
from dspine.utils.atomic import write_json_atomic
from dspine.utils.http import HttpClient, HttpError
from dspine.utils.plot import pyplot, save_figure

CONFIGS = ("AR", "NGRAM", "DSPINE", "DSPINE-ablation", "DSPINE-copy", "DFLASH")
DEFAULT_CONFIGS = ("DSPINE-copy", "DSPINE", "NGRAM", "AR")  # the must-reach numbers first
RESULTS_NAME = "copy_candidates_h200"
RESULTS_SCHEMA = {"device": str, "date": str, "command": str, "sglang": str, "runs": [
    {"config": str, "workload": str, "agentic": bool, "concurrency": int, "accept_len": float,
     "output_tok_per_s": float}]}
AGENTIC_VS_NGRAM, AGENTIC_VS_DSPINE, DEV_LOSS = 1.2, 2.0, 0.02  # the must-reach (copy candidates)
SERVED_VS_NGRAM, CHAT_AND_MATH = 1.5, ("sharegpt-heldout", "gsm8k", "math500")  # the drafter's, at c=1
WARMUP = {"messages": [{"role": "user", "content": "Count from one to twenty in words."}]}


@dataclass
class Workload:
    """`prompts`: dicts {"id", "messages"[, "tools"]}, the pool its levels take slices of."""

    name: str
    agentic: bool
    prompts: list[dict]


@dataclass
class Level:
    workload: Workload
    concurrency: int
    prompts: list[dict]


def prompt_key(prompt: dict) -> str:
    """A prompt's identity: `TraceRequest.key` of its messages and tools."""
    return TraceRequest(messages=tuple(prompt["messages"]), tools=tuple(prompt.get("tools") or ())).key


def plan_levels(workloads: list[Workload], concurrency: list[int], per_workload: int) -> list[Level]:
    """Levels by concurrency, then workload. A level takes the next min(max(per_workload, c), pool)
    prompts of its workload's pool, wrapping to the pool's start once it is used up: no prompt
    repeats within a level, nor across a workload's levels while its pool lasts."""
    offsets, levels = {w.name: 0 for w in workloads}, []
    for c in concurrency:
        for w in workloads:
            n, start = min(max(per_workload, c), len(w.prompts)), offsets[w.name]
            levels.append(Level(w, c, [w.prompts[(start + i) % len(w.prompts)] for i in range(n)]))
            offsets[w.name] = start + n
    return levels


def ngram_restarts(levels: list[Level]) -> set[int]:
    """Indices of the levels an NGRAM server must be (re)started before: the first level, and each
    that would send a prompt the server has answered since its last start."""
    restarts, seen = {0}, set()
    for i, level in enumerate(levels):
        keys = {prompt_key(p) for p in level.prompts}
        if keys & seen:
            restarts.add(i)
            seen = set()
        seen |= keys
    return restarts


def load_workloads(args: argparse.Namespace) -> list[Workload]:
    """The `--agentic` files' `--agentic-split` requests, then the evaluation sets (as many prompts
    as the levels can use), kept to `--workloads` when given."""
    out = []
    for path in args.agentic:
        out.append(Workload(Path(path).stem, True, load_trace_prompts(Path(path), split=args.agentic_split)))
    need = sum(max(args.prompts_per_workload, c) for c in args.concurrency)
    out += [Workload(name, False, load_set_prompts(name, need, args.prompts_dir)) for name in EVAL_SETS
            if not args.workloads or name in args.workloads]
    unknown = set(args.workloads or ()) - {w.name for w in out}
    if unknown:
        raise BenchError(f"--workloads {sorted(unknown)}: not among {[w.name for w in out]}")
    return [w for w in out if not args.workloads or w.name in args.workloads]


def parse_overrides(values: list[str]) -> dict:
    """`--copy-set key=value` -> {key: value}; the value as JSON when it parses (true, 4, 0.5), else a
    string. Only `copy_*` keys: the other drafter settings stay as trained."""
    out = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key.startswith("copy_"):
            raise BenchError(f"--copy-set {item!r}: give copy_<key>=<value>, e.g. copy_min_match=3")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def make_variant(draft: Path, dest: Path, overrides: dict) -> Path:
    """`dest` rebuilt: `draft`'s config.json with `dspine_config.copy_candidates = true` and
    `overrides` set, and a symlink to each other file of `draft` (weights, index, card)."""
    config = json.loads((draft / "config.json").read_text())
    if not isinstance(config.get("dspine_config"), dict):
        raise BenchError(f"{draft}/config.json has no dspine_config: --draft must be a DSpine drafter folder")
    if dest.resolve() == draft.resolve():
        raise BenchError(f"the DSPINE-copy variant {dest} would overwrite the drafter itself")
    config["dspine_config"].update(copy_candidates=True, **overrides)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for file in sorted(draft.iterdir()):
        if file.name != "config.json":
            (dest / file.name).symlink_to(file.resolve())
    write_json_atomic(dest / "config.json", config)
    return dest


def server_configs(args: argparse.Namespace, variant: Path | None) -> dict[str, list[str]]:
    """SGLang flags per config in --configs order: AR and DSPINE as the serving benchmark builds
    them; NGRAM = AR + the algorithm; DSPINE-copy / DSPINE-ablation / DFLASH = DSPINE with their drafter
    (and algorithm)."""
    base = serving_configs(argparse.Namespace(model_path=args.model_path, extra_flags=args.extra_flags,
                                              num_draft_tokens=args.num_draft_tokens, draft=args.draft, spec_flags="",
                                              ablation_draft=None, configs=["AR", "DSPINE"]))
    dspine = base["DSPINE"]
    at = dspine.index("--speculative-draft-model-path") + 1

    def swapped(draft: str, algorithm: str = "DSPINE") -> list[str]:
        flags = [*dspine[:at], draft, *dspine[at + 1:]]
        flags[flags.index("--speculative-algorithm") + 1] = algorithm
        return flags

    every = {"AR": base["AR"], "NGRAM": [*base["AR"], "--speculative-algorithm", "NGRAM"], "DSPINE": dspine,
             "DSPINE-copy": swapped(str(variant)) if variant else None,
             "DSPINE-ablation": swapped(args.ablation_draft) if args.ablation_draft else None,
             "DFLASH": swapped(args.dflash_draft, "DFLASH") if args.dflash_draft else None}
    return {name: every[name] for name in args.configs}


def summary(results: dict) -> list[dict]:
    """The must-reach checks from `runs`: per agentic workload at concurrency 1, DSPINE-copy's accept
    length over NGRAM's (goal >= AGENTIC_VS_NGRAM) and over DSPINE's (>= AGENTIC_VS_DSPINE); per
    evaluation set, DSPINE-copy's over DSPINE's, each the mean over the concurrencies both have
    (goal >= 1 - DEV_LOSS); on the chat and math sets (CHAT_AND_MATH) at concurrency 1, DSPINE's
    over NGRAM's (goal >= SERVED_VS_NGRAM). Rows {"workload", "check", "ratio", "goal", "ok"}; a
    check lacking a config is left out."""
    accept = {(r["config"], r["workload"], r["concurrency"]): r["accept_len"] for r in results["runs"]}
    agentic = {r["workload"]: r["agentic"] for r in results["runs"]}
    rows = []
    for workload, is_agentic in agentic.items():
        pairs = ([("NGRAM", AGENTIC_VS_NGRAM), ("DSPINE", AGENTIC_VS_DSPINE)] if is_agentic
                 else [("DSPINE", 1 - DEV_LOSS)])
        for other, goal in pairs:
            levels = [c for (name, w, c) in accept if name == "DSPINE-copy" and w == workload
                      and (other, w, c) in accept and (c == 1 or not is_agentic)]
            if levels:
                ratio = statistics.fmean(accept[("DSPINE-copy", workload, c)] / accept[(other, workload, c)]
                                         for c in levels)
                rows.append({"workload": workload, "check": f"DSPINE-copy / {other} accept"
                             + (" at c=1" if is_agentic else " (mean over c)"), "ratio": ratio, "goal": goal,
                             "ok": ratio >= goal})
        if workload in CHAT_AND_MATH and ("DSPINE", workload, 1) in accept and ("NGRAM", workload, 1) in accept:
            ratio = accept[("DSPINE", workload, 1)] / accept[("NGRAM", workload, 1)]
            rows.append({"workload": workload, "check": "DSPINE / NGRAM accept at c=1", "ratio": ratio,
                         "goal": SERVED_VS_NGRAM, "ok": ratio >= SERVED_VS_NGRAM})
    return rows


def table(results: dict) -> str:
    """Accept length and tok/s / AR (same workload and concurrency) per config, then the checks."""
    runs = {(r["config"], r["workload"], r["concurrency"]): r for r in results["runs"]}
    configs = [c for c in CONFIGS if any(k[0] == c for k in runs)]
    rows = [(w, c) for w in dict.fromkeys(k[1] for k in runs) for c in sorted({k[2] for k in runs}) if
            any(k[1:] == (w, c) for k in runs)]                      # workloads in measuring order
    lines = [f"{'workload':<22}{'c':>4}" + "".join(f"{name + ' acc / xAR':>26}" for name in configs)]
    for workload, c in rows:
        ar = runs.get(("AR", workload, c))
        cells = []
        for name in configs:
            r = runs.get((name, workload, c))
            ratio = f"{r['output_tok_per_s'] / ar['output_tok_per_s']:.2f}x" if r and ar else "-"
            cells.append(f"{r['accept_len']:.2f} / {ratio}" if r else "-")
        lines.append(f"{workload:<22}{c:>4}" + "".join(f"{cell:>26}" for cell in cells))
    if any("ms_per_step" in r for r in runs.values()):
        lines.append("ms per decode step or round (client side) / AR's step:")
        for workload, c in rows:
            ar = runs.get(("AR", workload, c), {}).get("ms_per_step")
            cells = []
            for name in configs:
                ms = runs.get((name, workload, c), {}).get("ms_per_step")
                cells.append("-" if ms is None else f"{ms:.2f} / {ms / ar:.2f}x" if ar else f"{ms:.2f}")
            lines.append(f"{workload:<22}{c:>4}" + "".join(f"{cell:>26}" for cell in cells))
    lines.append("must-reach:")
    lines += [f"  {s['workload']}: {s['check']} = {s['ratio']:.3f} (goal >= {s['goal']:.2f}) "
              f"{'PASS' if s['ok'] else 'FAIL'}" for s in summary(results)]
    return "\n".join(lines)


def plot(results: dict, out_dir: Path, stem: str) -> Path | None:
    """`stem`.png: accept length (top) and tok/s / AR (bottom; plain tok/s when AR was not measured)
    per workload and config, one column per concurrency; None (with a note) without matplotlib or
    without runs."""
    plt = pyplot("run `--report-only` where it is installed")
    if plt is None:
        return None
    runs = {(r["config"], r["workload"], r["concurrency"]): r for r in results["runs"]}
    if not runs:
        print("no runs measured: no plot", flush=True)
        return None
    levels = sorted({k[2] for k in runs})
    has_ar = any(k[0] == "AR" for k in runs)
    workloads = list(dict.fromkeys(k[1] for k in runs))
    configs = [c for c in CONFIGS if any(k[0] == c for k in runs)]
    fig, axes = plt.subplots(2, len(levels), figsize=(5 * len(levels), 7), squeeze=False)
    width = 0.8 / max(1, len(configs))

    def value(row: int, name: str, workload: str, c: int) -> float:
        r, ar = runs[(name, workload, c)], runs.get(("AR", workload, c))
        if row == 0:
            return r["accept_len"]
        if not has_ar:
            return r["output_tok_per_s"]
        return r["output_tok_per_s"] / ar["output_tok_per_s"] if ar else float("nan")

    for col, c in enumerate(levels):
        for row, label in enumerate(("accept length", "output tok/s / AR" if has_ar else "output tok/s (no AR run)")):
            ax = axes[row][col]
            for i, name in enumerate(configs):
                at = [j for j, w in enumerate(workloads) if (name, w, c) in runs]
                ax.bar([j + i * width for j in at], [value(row, name, workloads[j], c) for j in at], width, label=name)
            ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(workloads))], workloads,
                          rotation=45, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"concurrency {c}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"copy candidates on {results['device']} (SGLang {results['sglang']})")
    return save_figure(fig, out_dir / f"{stem}.png", dpi=110)


def estimate_s(configs: list[str], levels: list[Level], max_tokens: int, tok_per_s: float, managed: bool) -> float:
    """Server starts and stops (NGRAM's restarts too), plus each level's decode at `tok_per_s` per
    stream (c streams at once)."""
    decode = sum(len(lv.prompts) * max_tokens / (tok_per_s * min(lv.concurrency, len(lv.prompts))) for lv in levels)
    starts = len(configs) + ("NGRAM" in configs) * (len(ngram_restarts(levels)) - 1)
    return len(configs) * decode + (starts * (SERVER_START_S + SERVER_STOP_S) if managed else 0.0)


def step_period(stats: dict, concurrency: int) -> dict:
    """A level's wall time per decode step (AR) or speculative round, from the client side:
    wall x streams in flight / steps (`{"steps", "wall_s", "ms_per_step"}`; {} without step counts).
    It includes each request's prefill and HTTP turnaround, so it overstates a step a little."""
    steps = stats.get("steps")
    if not steps:
        return {}
    in_flight = min(concurrency, stats["prompts"])
    return {"steps": int(steps), "wall_s": stats["wall_s"], "ms_per_step": 1e3 * stats["wall_s"] * in_flight / steps}


def measure(args: argparse.Namespace, configs: dict[str, list[str]], levels: list[Level], launcher,
            results: dict, errors: list[str]) -> None:
    """Every config's server, started once (NGRAM again before each of `ngram_restarts`), every
    level on it; the results file rewritten after each level; `--time-budget-s` shares as documented."""
    t0, restarts = time.monotonic(), ngram_restarts(levels)

    def start(name: str) -> str:
        base = launcher.start(name, configs[name])
        info = HttpClient(base, timeout=10.0, retries=0).get_or_none("/server_info") or {}
        results["sglang"] = str(info.get("version") or results["sglang"])
        if results["device"] == "unknown":
            results["device"] = args.device or detect_device(info)
        send_with_meta(base, chat_body(WARMUP, args.served_model, 32), args.request_timeout)
        return base

    # a server still to start costs SERVER_START_S + SERVER_STOP_S of the budget; running ones nothing
    start_s = 0.0 if isinstance(launcher, (UrlLauncher, PrestartedServers)) else SERVER_START_S + SERVER_STOP_S
    for k, name in enumerate(configs):
        left = args.time_budget_s - (time.monotonic() - t0) if args.time_budget_s else float("inf")
        if left <= start_s:
            errors.append(f"{name}: not measured, the time budget is spent")
            continue
        try:
            base = start(name)
            share = (left - (len(configs) - k) * start_s) / (len(configs) - k)
            deadline = time.monotonic() + share
            for i, level in enumerate(levels):
                where = f"{name} {level.workload.name} c={level.concurrency}"
                if time.monotonic() > deadline:
                    errors.append(f"{where}: skipped, past this config's share of --time-budget-s")
                    continue
                if name == "NGRAM" and i and i in restarts:
                    if isinstance(launcher, UrlLauncher):
                        errors.append(f"{where} and later: skipped, they would repeat prompts on NGRAM's --url server")
                        break
                    print(f"[NGRAM] restarting: {where} would repeat prompts it has served", flush=True)
                    launcher.stop(name)
                    base = start(name)
                bodies = [chat_body(p, args.served_model, args.max_tokens) for p in level.prompts]
                stats, _ = run_level(base, bodies, level.concurrency, args.request_timeout, streamed=False)
                results["runs"].append({"config": name, "workload": level.workload.name,
                                        "agentic": level.workload.agentic, "concurrency": level.concurrency,
                                        "accept_len": stats["accept_len"],
                                        "output_tok_per_s": stats["output_tok_per_s"],
                                        **step_period(stats, level.concurrency)})
                write_results(results, args.out_dir, args.results_name)
                print(f"[{where}] {len(bodies)} prompts: accept {stats['accept_len']:.2f}, "
                      f"{stats['output_tok_per_s']:.0f} tok/s, {stats['wall_s']:.1f} s", flush=True)
        except (BenchError, HttpError, OSError) as e:
            errors.append(f"{name}: {e}")
            print(f"[{name}] FAILED: {e}", flush=True)
        finally:
            launcher.stop(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example (GPU host, repo root; traces from `python -m dspine.data.agentic .gpu-dspine/agentic`):\n"
               "  python3 scripts/bench_copy_candidates.py --model-path \"$SMOLLM2\" \\\n"
               "    --draft dspine/checkpoints/dspine-smollm2-135m-instruct \\\n"
               "    --agentic .gpu-dspine/agentic/agentic_coding.jsonl .gpu-dspine/agentic/agentic_sharegpt.jsonl \\\n"
               "    --prompts-dir .gpu-dspine/prompts --out-dir runs/copy_candidates --time-budget-s 480")
    add_server_arguments(p, configs=CONFIGS, default_configs=DEFAULT_CONFIGS,
                         extra_flags="--cuda-graph-max-bs-decode 64",
                         url_help="running server(s): URL for every config, or NAME=URL (repeatable); none is "
                                  "started, so NGRAM's levels that would repeat a prompt are skipped")
    p.set_defaults(device=None)
    p.add_argument("--agentic", nargs="*", default=[], metavar="FILE",
                   help="agentic trace files (python -m dspine.data.agentic), one workload each")
    p.add_argument("--agentic-split", choices=("tune", "heldout", "all"), default="heldout",
                   help="the trace files' split to replay (default %(default)s)")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=None,
                   help="comma-separated subset: agentic file stems and " + ",".join(EVAL_SETS))
    p.add_argument("--prompts-dir", type=Path, default=None,
                   help="read the evaluation sets from the exports eval-<set>.jsonl in this folder")
    p.add_argument("--prompts-per-workload", type=int, default=8,
                   help="prompts of a level (at least one wave: max(this, concurrency))")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64],
                   help="comma-separated levels (default 1,16,64)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--copy-set", action="append", default=[], metavar="KEY=VALUE",
                   help="DSPINE-copy drafter setting (copy_* keys of dspine_config), repeatable")
    p.add_argument("--dflash-draft", default=None, help="a DFlash drafter: adds the DFLASH config")
    p.add_argument("--ablation-draft", default=None,
                   help="the DFlash-style ablation trained beside --draft: adds the DSPINE-ablation config")
    p.add_argument("--time-budget-s", type=float, default=0.0, help="stop cleanly after about this long (0: no limit)")
    p.add_argument("--assume-tok-per-s", type=float, default=500.0, help="per-stream decode rate for the estimate")
    p.add_argument("--results-name", default=RESULTS_NAME, help="stem of the JSON and PNG in --out-dir")
    p.add_argument("--report-only", action="store_true", help="print the table and redraw the plot from the JSON")
    p.add_argument("--parallel-start", action="store_true",
                   help="start every config's server at once (config i on --port + i) before measuring; give "
                        "each a memory share in --extra-flags, e.g. --mem-fraction-static 0.12")
    args = p.parse_args(argv)
    if args.dflash_draft and "DFLASH" not in args.configs:
        args.configs.append("DFLASH")
    if "DFLASH" in args.configs and not args.dflash_draft:
        p.error("DFLASH needs --dflash-draft DIR")
    if args.ablation_draft and "DSPINE-ablation" not in args.configs:
        args.configs.append("DSPINE-ablation")
    if "DSPINE-ablation" in args.configs and not args.ablation_draft:
        p.error("DSPINE-ablation needs --ablation-draft DIR")
    check_server_arguments(p, args, CONFIGS)
    return args


def check_results(results: dict) -> None:
    """BenchError unless `results` follows RESULTS_SCHEMA."""
    check_schema(results, RESULTS_SCHEMA)


def main(argv: list[str] | None = None, launcher=None) -> int:
    """`launcher`: where servers come from (default `launchers.launcher_for(args)`)."""
    args = parse_args(argv)
    if args.report_only:
        results = json.loads((args.out_dir / f"{args.results_name}.json").read_text())
        print(table(results))
        print(plot(results, args.out_dir, args.results_name))
        return 0
    try:
        workloads = load_workloads(args)
    except (BenchError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)  # the managed servers' logs go there from the start
    variant = None
    if "DSPINE-copy" in args.configs:
        variant = make_variant(Path(args.draft), (args.out_dir / f"{args.results_name}_dspine_copy").resolve(),
                               parse_overrides(args.copy_set))
    configs = server_configs(args, variant)
    levels = plan_levels(workloads, args.concurrency, args.prompts_per_workload)
    launcher = launcher or launcher_for(args)
    est = estimate_s(list(configs), levels, args.max_tokens, args.assume_tok_per_s,
                     not isinstance(launcher, UrlLauncher))
    pools = ", ".join(f"{w.name} {len(w.prompts)}" for w in workloads)
    print(f"{len(configs)} config(s) x {len(levels)} levels (prompts: {pools}): ~{est:.0f} s estimated "
          f"at {args.assume_tok_per_s:.0f} tok/s per stream", flush=True)
    if "NGRAM" in configs and len(ngram_restarts(levels)) > 1:
        print(f"NGRAM restarts {len(ngram_restarts(levels)) - 1} time(s): a pool is smaller than its levels "
              "together (more prompts, or lower --prompts-per-workload / --concurrency, avoid it)", flush=True)
    for name, flags in configs.items():
        print(f"[{name}] {shlex.join(flags)}", flush=True)
    results = {"device": args.device or "unknown", "date": datetime.date.today().isoformat(),
               "command": command_line(argv), "sglang": "unknown", "runs": []}
    errors: list[str] = []
    if isinstance(launcher, PrestartedServers):
        print(f"starting {len(configs)} servers at once on ports {args.port}..{args.port + len(configs) - 1}", flush=True)
        errors += launcher.prestart(configs)
    measure(args, configs, levels, launcher, results, errors)
    path = write_results(results, args.out_dir, args.results_name)
    print(table(results))
    plot(results, args.out_dir, args.results_name)
    print(f"wrote {path}", flush=True)
    if errors:
        print("not measured / errors:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    check_results(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
