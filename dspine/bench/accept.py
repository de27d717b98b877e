"""`dspine bench-accept`: τ and per-position acceptance of drafters on the evaluation sets.

Runs the lossless reference engine (so the figures are real acceptance, not a teacher-forced
estimate) on GSM8K, MATH-500, HumanEval, MBPP and held-out ShareGPT chat, at T=0 and T=1
(top-p 0.95, top-k 20), for every `--drafter NAME=PATH`. `--agentic FILE` adds a long-context
multi-turn workload per trace file (named by its stem; `python -m dspine.data.agentic` writes them:
coding-agent sessions and long ShareGPT threads), its `--agentic-split` requests rendered with
their tools by the target's chat template, the first `--num-prompts` of them. Prints a table, writes the JSON schema of
`benchmarks/results/acceptance_*.json` and a plot to `--out`: by default a new
`bench_accept_<UTC time>.json` in the working directory, never a tracked result file.
"""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

import torch

from dspine.model.checkpoint import load_checkpoint
from dspine.data.eval_sets import EVAL_SETS, load_eval_set
from dspine.data.prompt_sources import describe_prompt_sources
from dspine.data.traces import TraceError, load_traces
from dspine.engine.generate import generate
from dspine.engine.targets import chat_prompt_ids, load_target, stop_token_ids
from dspine.utils.plot import pyplot, save_figure

TEMPERATURES = {0.0: dict(temperature=0.0), 1.0: dict(temperature=1.0, top_p=0.95, top_k=20)}


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def default_out() -> Path:
    """A new result file in the working directory: `bench_accept_<UTC date>-<time>.json`."""
    return Path(f"bench_accept_{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}.json")


def run_bench_accept(args) -> int:
    out = Path(args.out) if args.out else default_out()
    if args.merge:
        return merge_results([Path(f) for f in args.merge], out, Path(args.served) if args.served else None)
    if args.served:
        raise SystemExit("bench-accept: --served goes with --merge (it joins a served comparison to result files)")
    if not args.drafter:
        raise SystemExit("bench-accept: give at least one --drafter NAME=PATH (or --merge FILES)")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    target, tokenizer = load_target(args.target, dtype=dtype, device=args.device)
    drafters = {}
    for spec in args.drafter:
        name, _, path = spec.partition("=")
        drafters[name] = load_checkpoint(path, target=target, device=args.device, dtype=dtype)
        if args.injection_candidates and drafters[name].injections is not None:  # a runtime choice: no weights
            drafters[name].config.injection_candidates = args.injection_candidates
        if args.injection_top_k is not None:
            if drafters[name].injections is None:
                raise SystemExit(f"bench-accept --injection-top-k: drafter {name!r} has no injection (it was "
                                 f"trained with injection=false)")
            drafters[name].config.injection_top_k = args.injection_top_k
            for module in drafters[name].injections:
                module.top_k = args.injection_top_k
        if args.selection == "transition" and drafters[name].transition is None:
            raise SystemExit(f"bench-accept --selection transition: drafter {name!r} has no transition scorer "
                             f"(it was trained with selection=argmax)")
        if args.selection:
            drafters[name].config.selection = args.selection
        if args.transition_lambda is not None:
            drafters[name].config.transition_lambda = args.transition_lambda
    stops = stop_token_ids(tokenizer, target)
    runs, parity = [], {name: {"prompts": 0, "identical": 0} for name in drafters}
    for dataset, ids in workloads(args, tokenizer):
        common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=args.seed,
                      batch_size=args.batch_size)
        plain = generate(target, None, ids, **common).tokens if args.check_parity else None
        for temp in args.temperatures:
            for name, drafter in drafters.items():
                res = generate(target, drafter, ids, **common, **TEMPERATURES[temp])
                s = res.stats
                runs.append({"method": name, "dataset": dataset, "temperature": temp, "n_prompts": len(ids),
                             "tau": s.tau, "per_position_accept": s.per_position_accept,
                             "tokens_per_s": s.tokens_per_s, "rounds": s.rounds})
                if plain is not None and temp == 0.0:
                    parity[name]["prompts"] += len(ids)
                    parity[name]["identical"] += sum(a == b for a, b in zip(plain, res.tokens))
                print(f"{name:10s} {dataset:17s} T={temp:.0f}  tau={s.tau:.3f}  "
                      f"acc@1..4={' '.join(f'{a:.2f}' for a in s.per_position_accept[:4])}", flush=True)
    result = {"target": args.target or "smollm2-135m-instruct",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_name(args.device), "command": " ".join(shlex.quote(a) for a in sys.argv),
              "torch": torch.__version__, "drafters": {k: v for k, v in (d.partition("=")[::2] for d in args.drafter)},
              "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "prompt_sources": describe_prompt_sources(
                  data_dir=args.data_dir, prompts_dir=args.prompts_dir),
              "summary": summarise(runs), "greedy_parity": parity if args.check_parity else None, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(runs)
    plot(runs, out.with_suffix(".png"))
    print(f"\nbench-accept: wrote {out}")
    return 0


def workloads(args, tokenizer):
    """(name, prompt token ids) per evaluation set, then per `--agentic` trace file."""
    for dataset in args.datasets:
        prompts = load_eval_set(dataset, limit=args.num_prompts, data_dir=args.data_dir,
                                prompts_dir=args.prompts_dir)
        yield dataset, [chat_prompt_ids(tokenizer, p.messages) for p in prompts]
    for path in args.agentic or []:
        try:
            requests = load_traces([path], args.agentic_split)[: args.num_prompts]
        except TraceError as exc:
            raise SystemExit(f"bench-accept --agentic: {exc}") from None
        yield Path(path).stem, [chat_prompt_ids(tokenizer, list(r.messages), list(r.tools) or None)
                                for r in requests]


SERVED_METHODS = {"DSPINE": "dspine", "DSPINE-ablation": "ablation", "NGRAM": "ngram", "AR": "ar"}


def served_rows(served: dict) -> list[dict]:
    """The `served` list of an acceptance file from a served comparison (`python -m
    dspine.bench.copy_candidates` with DSPINE, DSPINE-ablation, NGRAM and AR on the same prompts):
    one row {"method", "workload", "concurrency", "accept_len", "output_tok_per_s"} per run of those
    configs; other configs (DSPINE-copy, DFLASH) are left out."""
    return [{"method": SERVED_METHODS[r["config"]], "workload": r["workload"], "concurrency": r["concurrency"],
             "accept_len": r["accept_len"], "output_tok_per_s": r["output_tok_per_s"]}
            for r in served["runs"] if r["config"] in SERVED_METHODS]


def merge_results(paths: list[Path], out: Path, served: Path | None = None) -> int:
    """Join result files of the same target and settings, measured by separate processes (e.g. one
    drafter per GPU), into one: drafters, runs and greedy parity are united, the summary recomputed.
    A drafter name found in two files, or files of different targets or settings, is an error.
    `served`: a served comparison's results file, kept as `served` (`served_rows`) with its
    `served_command`, `served_device` and `served_date`."""
    results = [json.loads(p.read_text()) for p in paths]
    first = results[0]
    for path, r in zip(paths[1:], results[1:]):
        for key in ("target", "max_new_tokens", "dtype"):
            if r.get(key) != first.get(key):
                raise SystemExit(f"bench-accept --merge: {path} has {key}={r.get(key)!r}, "
                                 f"{paths[0]} has {first.get(key)!r}; merge only runs of the same settings")
    merged = dict(first, drafters={}, runs=[], greedy_parity={} if first.get("greedy_parity") is not None else None,
                  command=" | ".join(r["command"] for r in results), merged_from=[str(p) for p in paths])
    for path, r in zip(paths, results):
        clash = set(r["drafters"]) & set(merged["drafters"])
        if clash:
            raise SystemExit(f"bench-accept --merge: drafter {sorted(clash)} appears twice (again in {path})")
        merged["drafters"].update(r["drafters"])
        merged["runs"].extend(r["runs"])
        if merged["greedy_parity"] is not None:
            merged["greedy_parity"].update(r.get("greedy_parity") or {})
    merged["summary"] = summarise(merged["runs"])
    if served is not None:
        comparison = json.loads(served.read_text())
        merged["served"] = served_rows(comparison)
        if not merged["served"]:
            raise SystemExit(f"bench-accept --served: {served} has no run of {sorted(SERVED_METHODS)}; give the "
                             "results of python -m dspine.bench.copy_candidates --configs AR,NGRAM,DSPINE "
                             "--ablation-draft DIR")
        merged.update(served_command=comparison["command"], served_device=comparison["device"],
                      served_date=comparison["date"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2) + "\n")
    print_table(merged["runs"])
    if merged.get("served"):
        print_served(merged["served"])
    plot(merged["runs"], out.with_suffix(".png"))
    print(f"\nbench-accept: wrote {out}")
    return 0


def summarise(runs: list[dict]) -> dict:
    """Mean τ over the evaluation sets per method and temperature, and the DSpine/ablation ratio
    when both ran; the `--agentic` workloads' τ apart, under "long_context" (T -> method -> workload)."""
    out: dict = {}
    summary: dict = {}
    for r in runs:
        if r["dataset"] in EVAL_SETS:
            out.setdefault(f"T={r['temperature']:g}", {}).setdefault(r["method"], []).append(r["tau"])
        else:
            summary.setdefault("long_context", {}).setdefault(f"T={r['temperature']:g}", {}).setdefault(
                r["method"], {})[r["dataset"]] = r["tau"]
    for temp, methods in out.items():
        summary[temp] = {m: sum(v) / len(v) for m, v in methods.items()}
        if "dspine" in methods and "ablation" in methods:
            summary[temp]["ratio_dspine_over_ablation"] = summary[temp]["dspine"] / summary[temp]["ablation"]
    return summary


def print_table(runs: list[dict]) -> None:
    methods = sorted({r["method"] for r in runs})
    print(f"\n{'dataset':17s} {'T':>3s} " + " ".join(f"{m:>10s}" for m in methods))
    keys = sorted({(r["dataset"], r["temperature"]) for r in runs}, key=lambda k: (k[1], k[0]))
    for ds, temp in keys:
        vals = {r["method"]: r["tau"] for r in runs if r["dataset"] == ds and r["temperature"] == temp}
        print(f"{ds:17s} {temp:3.0f} " + " ".join(f"{vals.get(m, float('nan')):10.3f}" for m in methods))


def print_served(rows: list[dict]) -> None:
    """Accept length and output tok/s per workload and concurrency, one column per method."""
    methods = [m for m in SERVED_METHODS.values() if any(r["method"] == m for r in rows)]
    print(f"\nserved{'':11s} {'c':>3s} " + " ".join(f"{m + ' acc / tok/s':>22s}" for m in methods))
    cells = {(r["workload"], r["concurrency"], r["method"]): r for r in rows}
    for workload, c in dict.fromkeys((r["workload"], r["concurrency"]) for r in rows):
        line = [f"{cells[(workload, c, m)]['accept_len']:.2f} / {cells[(workload, c, m)]['output_tok_per_s']:.0f}"
                if (workload, c, m) in cells else "-" for m in methods]
        print(f"{workload:17s} {c:3d} " + " ".join(f"{x:>22s}" for x in line))


def plot(runs: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    methods = sorted({r["method"] for r in runs})
    temps = sorted({r["temperature"] for r in runs})
    fig, axes = plt.subplots(1, len(temps) + 1, figsize=(6 * (len(temps) + 1), 4))
    for ax, temp in zip(axes, temps):
        datasets = [d for d in EVAL_SETS if any(r["dataset"] == d for r in runs)] + sorted(
            {r["dataset"] for r in runs} - set(EVAL_SETS))                                   # then --agentic ones
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = [next((r["tau"] for r in runs if r["method"] == m and r["dataset"] == d
                          and r["temperature"] == temp), 0) for d in datasets]
            ax.bar([x + i * width for x in range(len(datasets))], vals, width, label=m)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(datasets))], datasets, rotation=20)
        ax.set_ylabel("τ (tokens per round, bonus included)")
        ax.set_title(f"τ per dataset, T={temp:g}")
        ax.legend()
    ax = axes[-1]
    for m in methods:
        for temp in temps:
            rs = [r["per_position_accept"] for r in runs if r["method"] == m and r["temperature"] == temp]
            if rs:
                mean = [sum(x) / len(x) for x in zip(*rs)]
                ax.plot(range(1, len(mean) + 1), mean, marker="o", label=f"{m} T={temp:g}")
    ax.set_xlabel("block position")
    ax.set_ylabel("acceptance rate (given verified)")
    ax.set_title("acceptance by position (mean over datasets)")
    ax.legend()
    save_figure(fig, path)
