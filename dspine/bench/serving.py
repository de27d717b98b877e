"""Serving benchmark: AR vs DSPINE vs DSPINE-ablation SGLang servers, over HTTP.

For each server config (a set of extra SGLang flags) the benchmark starts the server through a
launcher (`dspine.bench.launchers`), measures, stops it, and rewrites the results file after every
measurement (a timeout leaves what was measured):

* Throughput levels (concurrency 1, 4, 16, 64 by default): max(--prompts, --waves x c) prompts (a
  round-robin mix of the five evaluation sets, `dspine.data.eval_sets.EVAL_SETS`, or their exports in
  `--prompts-dir`; several waves per level, so that a level is not one burst timed by its longest
  request) go to `/v1/chat/completions` (the server applies the chat template), temperature 0,
  fixed `max_tokens`, EOS honoured (`dspine.bench.chat_client`). output_tok_per_s = total completion
  tokens / wall time of the level; TTFT (mean, p50) from the streamed half of the requests, the
  accept length (sum completion tokens / sum spec_verify_ct; 1.0 for AR) from the other half.
* Greedy parity (after the levels, one request at a time): every prompt once more, not streamed,
  with `return_meta_info` and `return_token_ids` (and, on the AR server only, `logprobs` with
  `top_logprobs=2`); each speculative server's token ids are judged against the AR server's
  (`dspine.bench.parity`: identical, near-tie or other divergence). `--reclassify` re-judges a
  results file at another `--near-tie-nats` from the stored gaps. `--ar-control C` measures the
  AR server's own band: it answers the parity prompts again with C in flight, judged against its
  serial answers (`parity_ar_control`). `--prefill-check` measures the AR server last and asks it,
  at each divergence, for its one-pass prefill's next token.
* Ceiling, from the non-streamed requests of the concurrency-1 level: speedup = tau * T_step /
  T_round; `achieved_fraction` = the concurrency-1 level's measured speedup / that speedup.

Launchers: `--url URL` (or `--url NAME=URL` per config) for servers already running; otherwise
`bash .gpu/host/serve.sh start|stop` with `SGL_PORT`, logs in --out-dir. `--spec-flags` adds SGLang
flags to the speculative configs only (e.g. ReplaySSM on a hybrid target).

Writes `--out-dir/serving_h200.json` (schema `RESULTS_SCHEMA`; `--results-name` picks another stem,
e.g. `serving_hybrid_h200`) and `serving_h200.png` (speedup over AR against concurrency; needs
matplotlib, else `--plot-only` later).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

from dspine.bench.chat_client import Reply, chat_body, load_prompt_mix, parity_pass, run_level, send_with_meta
from dspine.bench.launchers import (ServeShLauncher, add_server_arguments, check_server_arguments, detect_device,
                                    launcher_for)
from dspine.bench.parity import NEAR_TIE_NATS, PARITY_KEYS, ceiling, parity_summary, prefill_check, reclassify
from dspine.bench.results import BenchError, check_schema, command_line, write_results
from dspine.utils.http import HttpClient, HttpError
from dspine.utils.plot import pyplot, save_figure

ALGORITHMS = ("AR", "DSPINE", "DSPINE-ablation")
RESULTS_NAME = "serving_h200"
RESULTS_SCHEMA = {
    "device": str, "date": str, "sglang": str, "target": str, "drafter": str, "command": str,
    "runs": [{"algorithm": str, "concurrency": int, "output_tok_per_s": float, "accept_len": float, "ttft_ms": float}],
    "ceiling": {"t_step_ms": float, "t_round_ms": float, "accept_len": float, "speedup": float},
    "parity": {"prompts": int, "identical": int, "near_tie_divergences": int, "other_divergences": int},
}
SERVER_START_S = 75.0  # a warm start of a small target's server (CUDA graphs captured)
SERVER_STOP_S = 8.0


def server_configs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Extra sglang flags per algorithm; the ablation needs `--ablation-draft`; `--spec-flags` go to
    the speculative configs only."""
    common = ["--model-path", args.model_path, *shlex.split(args.extra_flags)]
    spec = ["--speculative-algorithm", "DSPINE", "--speculative-num-draft-tokens", str(args.num_draft_tokens),
            "--speculative-draft-attention-backend", "triton", "--max-running-requests", "48"]
    spec_only = shlex.split(args.spec_flags)
    configs = {"AR": common,
               "DSPINE": [*common, *spec, "--speculative-draft-model-path", args.draft, *spec_only]}
    if args.ablation_draft:
        configs["DSPINE-ablation"] = [*common, *spec, "--speculative-draft-model-path", args.ablation_draft,
                                      *spec_only]
    return {name: flags for name, flags in configs.items() if name in args.configs}


def new_results(args: argparse.Namespace, argv: list[str] | None) -> dict:
    return {
        "device": args.device or "unknown", "date": datetime.date.today().isoformat(), "sglang": "unknown",
        "target": args.model_path, "drafter": args.draft, "command": command_line(argv),
        "runs": [], "ceiling": None, "parity": None,
        "settings": {"prompts": args.prompts, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                     "near_tie_nats": args.near_tie_nats, "configs": args.configs,
                     "extra_flags": args.extra_flags, "spec_flags": args.spec_flags},
        "levels": [], "configs": {}, "errors": [],
    }


def speedups(results: dict) -> dict[str, dict[int, float]]:
    """Throughput over AR's at the same concurrency, per speculative algorithm."""
    ar = {r["concurrency"]: r["output_tok_per_s"] for r in results["runs"] if r["algorithm"] == "AR"}
    out: dict[str, dict[int, float]] = {}
    for r in results["runs"]:
        if r["algorithm"] != "AR" and r["concurrency"] in ar:
            out.setdefault(r["algorithm"], {})[r["concurrency"]] = r["output_tok_per_s"] / ar[r["concurrency"]]
    return out


def plot(results: dict, out_dir: Path, stem: str = RESULTS_NAME) -> Path | None:
    """`stem`.png: speedup over AR vs concurrency; None (with a note) without matplotlib."""
    plt = pyplot("run `--plot-only` where it is installed")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in speedups(results).items():
        xs = sorted(curve)
        ax.plot(xs, [curve[x] for x in xs], marker="o", label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="AR")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s over AR")
    ax.set_title(f"{Path(results['target']).name} on {results['device']} (SGLang {results['sglang']})")
    ax.legend()
    return save_figure(fig, out_dir / f"{stem}.png", dpi=120)


def level_prompts(args: argparse.Namespace, concurrency: int) -> int:
    """Prompts sent at one concurrency level: at least --prompts, and --waves full waves."""
    return max(args.prompts, args.waves * concurrency)


def estimate_s(args: argparse.Namespace, n_configs: int, managed: bool) -> float:
    """Rough wall time: server starts/stops plus decode at an assumed `--assume-tok-per-s` per
    stream, concurrency c running c streams at once (an optimistic lower bound at high c)."""
    levels = sum(level_prompts(args, c) * args.max_tokens / (args.assume_tok_per_s * c) for c in args.concurrency)
    per_config = levels + args.prompts * args.max_tokens / args.assume_tok_per_s  # + the concurrency-1 parity pass
    return n_configs * (per_config + (SERVER_START_S + SERVER_STOP_S if managed else 0.0))


def measure_config(name: str, base: str, prompts: list[dict], args: argparse.Namespace, results: dict,
                   out_dir: Path) -> tuple[list[Reply], list[Reply]]:
    """Levels, then the parity pass, for one running server; results written after each level.
    Returns the parity replies and the concurrency-1 level's non-streamed replies."""
    info = HttpClient(base, timeout=10.0, retries=0).get_or_none("/server_info") or {}
    results["configs"].setdefault(name, {}).update(url=base, server_version=info.get("version"))
    if info.get("version"):
        results["sglang"] = info["version"]
    if results["device"] == "unknown":
        results["device"] = detect_device(info)
    bodies = [chat_body(p, args.served_model, args.max_tokens) for p in prompts]
    send_with_meta(base, bodies[0], args.request_timeout)  # warm-up: first-request costs
    c1: list[Reply] = []
    for c in args.concurrency:
        level, with_meta = run_level(base, bodies[:level_prompts(args, c)], c, args.request_timeout)
        c1 = with_meta if c == 1 else c1
        results["levels"].append({"algorithm": name, **level})
        results["runs"].append({"algorithm": name, "concurrency": c, "output_tok_per_s": level["output_tok_per_s"],
                                "accept_len": level["accept_len"], "ttft_ms": level["ttft_ms"]})
        write_results(results, out_dir, args.results_name)
        print(f"[{name}] c={c}: {level['output_tok_per_s']:.0f} tok/s, TTFT {level['ttft_ms']:.0f} ms "
              f"(p50 {level['ttft_p50_ms']:.0f}), accept {level['accept_len']:.2f}, {level['wall_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    replies = parity_pass(base, bodies[:args.prompts], args.request_timeout, logprobs=name == "AR")
    print(f"[{name}] parity pass: {len(replies)} prompts in {time.perf_counter() - t0:.1f} s", flush=True)
    if name == "AR" and args.ar_control > 1:
        control = parity_pass(base, bodies[:args.prompts], args.request_timeout, logprobs=False,
                              concurrency=args.ar_control)
        results["parity_ar_control"] = {**parity_summary(replies, control, prompts[:args.prompts], args.near_tie_nats),
                                        "concurrency": args.ar_control}
        summary = results["parity_ar_control"]
        print(f"[AR] control at concurrency {args.ar_control}: {summary['identical']} of {summary['prompts']} "
              f"identical to the serial pass, gaps {summary['gap_histogram']}", flush=True)
        if args.prefill_check:
            prefill_check(base, replies, control, summary, prompts[:args.prompts], args.request_timeout)
    return replies, c1


def run_prefill_checks(base: str, results: dict, passes: dict[str, list[Reply]], prompts: list[dict],
                       args: argparse.Namespace) -> None:
    """--prefill-check on the running AR server, for the DSPINE and DSPINE-ablation parity blocks."""
    for key, name in (("parity", "DSPINE"), ("parity_ablation", "DSPINE-ablation")):
        if results.get(key) and name in passes:
            block = prefill_check(base, passes["AR"], passes[name], results[key], prompts[:args.prompts],
                                  args.request_timeout)
            print(f"[AR] prefill check of {name}'s divergences: {block['prefill_picks']}", flush=True)


def finish_comparison(results: dict, passes: dict[str, list[Reply]], c1: dict[str, list[Reply]],
                      prompts: list[dict], args) -> None:
    """Parity and ceiling once the AR and DSPINE measurements are both in."""
    if "AR" not in passes or "DSPINE" not in passes:
        return
    parity_prompts = prompts[:args.prompts]
    results["parity"] = parity_summary(passes["AR"], passes["DSPINE"], parity_prompts, args.near_tie_nats)
    if "DSPINE-ablation" in passes:
        results["parity_ablation"] = parity_summary(passes["AR"], passes["DSPINE-ablation"], parity_prompts,
                                                    args.near_tie_nats)
    try:
        if not c1["AR"] or not c1["DSPINE"]:
            raise BenchError("the ceiling needs concurrency 1 among --concurrency")
        results["ceiling"] = ceiling(c1["AR"], c1["DSPINE"])
    except BenchError as e:
        if f"ceiling: {e}" not in results["errors"]:  # called again after the ablation
            results["errors"].append(f"ceiling: {e}")
        return
    c1 = speedups(results).get("DSPINE", {}).get(1)
    if c1 is not None:
        results["ceiling"]["achieved_speedup"] = c1
        results["ceiling"]["achieved_fraction"] = c1 / results["ceiling"]["speedup"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_arguments(p, configs=ALGORITHMS, default_configs=ALGORITHMS, extra_flags="--cuda-graph-max-bs-decode 64",
                         url_help="running server(s): URL for every config, or NAME=URL (repeatable); no server is "
                                  "started")
    p.add_argument("--ablation-draft", default=None, help="drafter for DSPINE-ablation (skipped without it)")
    p.add_argument("--spec-flags", default="",
                   help="sglang flags added to the speculative configs only (DSPINE, DSPINE-ablation), e.g. "
                        "\"--enable-linear-replayssm-spec --linear-replayssm-cache-len 32\" on a hybrid GDN target")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompts-dir", type=Path, default=None,
                   help="read the evaluation prompts from the exports eval-<set>.jsonl in this folder "
                        "(default: the evaluation sets themselves)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--waves", type=int, default=4,
                   help="each level sends at least waves x concurrency prompts (and at least --prompts)")
    p.add_argument("--ar-control", type=int, default=0, metavar="C",
                   help="after its parity pass, the AR server answers the parity prompts again with C in flight; "
                        "`parity_ar_control` compares the two AR passes like a DSPINE one (plain decoding against "
                        "itself at another batch size: the divergences and gaps bf16 alone produces on this server)")
    p.add_argument("--prefill-check", action="store_true",
                   help="measure the AR server last and, at every divergence, ask it for its greedy next token "
                        "after a one-pass prefill of prompt + common prefix (radix cache flushed): does the "
                        "target's own multi-token forward take the speculative server's token?")
    p.add_argument("--near-tie-nats", type=float, default=NEAR_TIE_NATS,
                   help="largest AR top-2 logprob gap (nats) at which a divergence counts as a bf16 near-tie")
    p.add_argument("--assume-tok-per-s", type=float, default=500.0, help="per-stream decode rate for the estimate")
    p.add_argument("--results-name", default=RESULTS_NAME,
                   help="stem of the results files in --out-dir (NAME.json, NAME.png), e.g. serving_hybrid_h200")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON in --out-dir")
    p.add_argument("--reclassify", action="store_true",
                   help="re-judge the parity of the JSON in --out-dir at --near-tie-nats (stored gaps; no server)")
    args = p.parse_args(argv)
    check_server_arguments(p, args, ALGORITHMS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        print(plot(json.loads((args.out_dir / f"{args.results_name}.json").read_text()), args.out_dir,
                   args.results_name))
        return 0
    if args.reclassify:
        results = reclassify(json.loads((args.out_dir / f"{args.results_name}.json").read_text()),
                             args.near_tie_nats)
        path = write_results(results, args.out_dir, args.results_name)
        print(json.dumps({k: {n: v for n, v in results[k].items() if n != "divergences"}
                          for k in PARITY_KEYS if k in results}, indent=2))
        print(f"wrote {path}")
        return 0
    configs = server_configs(args)
    if args.prefill_check and "AR" in configs:  # AR last: it answers for the divergences of the others
        configs = {**{n: f for n, f in configs.items() if n != "AR"}, "AR": configs["AR"]}
    if "DSPINE-ablation" in args.configs and "DSPINE-ablation" not in configs:
        print("DSPINE-ablation skipped: no --ablation-draft given", flush=True)
    prompts = load_prompt_mix(max(level_prompts(args, c) for c in [*args.concurrency, 1]), args.prompts_dir)
    launcher = launcher_for(args)
    est = estimate_s(args, len(configs), isinstance(launcher, ServeShLauncher))
    print(f"{len(configs)} config(s) x {args.prompts} prompts x {args.max_tokens} tokens at concurrency "
          f"{args.concurrency}: ~{est:.0f} s estimated (at {args.assume_tok_per_s:.0f} tok/s per stream)", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)  # the managed servers' logs go there from the start
    results = new_results(args, argv)
    passes: dict[str, list[Reply]] = {}
    c1: dict[str, list[Reply]] = {}
    for name, flags in configs.items():
        results["configs"][name] = {"flags": flags}
        try:
            t0 = time.perf_counter()
            base = launcher.start(name, flags)
            results["configs"][name]["start_s"] = time.perf_counter() - t0
            passes[name], c1[name] = measure_config(name, base, prompts, args, results, args.out_dir)
            if name == "AR" and args.prefill_check:  # the AR server is measured last: both passes are in
                finish_comparison(results, passes, c1, prompts, args)
                run_prefill_checks(base, results, passes, prompts, args)
        except (BenchError, HttpError, OSError) as e:
            results["errors"].append(f"{name}: {e}")
            print(f"[{name}] FAILED: {e}", flush=True)
        finally:
            launcher.stop(name)
        if not (name == "AR" and args.prefill_check):  # done above, before the prefill check annotated it
            finish_comparison(results, passes, c1, prompts, args)
        write_results(results, args.out_dir, args.results_name)
    path = write_results(results, args.out_dir, args.results_name)
    plot(results, args.out_dir, args.results_name)
    print(json.dumps({k: results[k] for k in ("ceiling", "parity")}, indent=2, default=str))
    print(f"wrote {path}", flush=True)
    if results["errors"]:
        print("errors:\n  " + "\n  ".join(results["errors"]), file=sys.stderr)
        return 1
    if {"AR", "DSPINE"} <= set(configs):  # ceiling and parity need both
        check_schema(results, RESULTS_SCHEMA)
    else:
        print("no AR + DSPINE pair in this run: ceiling and parity stay null", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
