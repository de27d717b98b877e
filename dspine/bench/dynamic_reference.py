"""Dynamic verification on the reference engine: AR vs DSPINE static vs DSPINE dynamic, tuned on traces.

The reference engine (`dspine.engine.generate`) verifies a batch as one padded `[bs, 1 + w]` forward.
On a CPU that forward is compute-bound: its time grows with every verify token, as a GPU's does at
high concurrency. That is the regime dynamic verification is for, so this benchmark measures the
whole loop there, with no server:

1. **Tune** (the traces' `tune` split only). Fit the per-position calibration (affine) of the
   drafter's confidence head from verify-all rounds; measure the drafting round's time at every
   concurrency c and pinned verify width w (`RoundTiming`: c rows, c·(1+w) verify tokens) and fit
   SGLang's additive SPS table T(bs, M) on those cells (`dspine.serve.sps_fit.fit_additive`); measure
   the plain decoding step at every c (T_plain, piecewise linear in c).
2. **Held-out workload**, never tuned on: the traces' `heldout` split plus opening turns of the
   ShareGPT held-out split (`dspine.data.eval_sets`, also never in the drafter's training data). At each
   concurrency: AR (plain decoding), DSPINE-static (verify every proposal) and DSPINE-dynamic
   (`DynamicVerifier`: `VerifyPlanner(table, layout="padded")` on the calibrated confidences, and
   plain decoding while the best plan is slower than T_plain: a losing probe buys as many plain
   rounds as keep probes at `--probe-share` of the time, and the tune split's observed survival
   decides the first round before any draft). Greedy;
   every speculative output is compared with AR's token by token (fp32: they must be identical).
3. The calibration is checked on the held-out rounds of the static run (survival ECE, and the
   largest gap per position between predicted and observed acceptance).

The engine runs static batches of c prompts (no continuous batching): rows leave as they finish, so
a batch's concurrency decays; `mean_rows` reports the average rows per round.

    python scripts/bench_dynamic_reference.py --out benchmarks/results/dynamic_reference_cpu.json

Writes the JSON (the schema of `dynamic_h200.json` plus the table, calibration and parity) and a
plot beside it (`.png`: speedup over AR vs concurrency; round time vs verify tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch

from dspine.bench.accept import device_name
from dspine.bench.results import command_line
from dspine.data.dev_traces import heldout_workload
from dspine.data.traces import TraceRequest, load_traces
from dspine.dynamic.calibration import PositionCalibration
from dspine.dynamic.cost_tables import SpsAdditiveCostTable, sps_table_to_json
from dspine.dynamic.planner import DynamicVerifier, VerifyPlanner
from dspine.dynamic.recording import ConfidenceRecorder
from dspine.engine.generate import generate
from dspine.engine.targets import load_target, stop_token_ids
from dspine.model.checkpoint import default_drafter_dir, load_checkpoint
from dspine.serve.sps_fit import fit_additive, fit_diagonal
from dspine.serve.sps_measure import render_prompt
from dspine.utils.atomic import write_json_atomic
from dspine.utils.plot import pyplot, save_figure

DEV_TRACES = ["benchmarks/traces/sharegpt_dev.jsonl", "benchmarks/traces/tooltalk_dev.jsonl",
              "benchmarks/traces/bfcl_multiturn_dev.jsonl"]


def encode(tokenizer, requests: list[TraceRequest], max_prompt_tokens: int) -> list[list[int]]:
    """Rendered as `dspine tune-sps` sends them; long prompts keep their last max_prompt_tokens."""
    return [tokenizer.encode(render_prompt(r), add_special_tokens=False)[-max_prompt_tokens:] for r in requests]


def heldout_sources(requests: list[TraceRequest]) -> dict[str, int]:
    """Requests per origin: a dev-trace file (its held-out split) or `sharegpt-heldout`."""
    counts: dict[str, int] = {}
    for r in requests:
        origin = r.source.split(":")[0] if ":" in r.source else "sharegpt-heldout"
        counts[origin] = counts.get(origin, 0) + 1
    return counts


def fixed_width(width: int):
    """A verify budget that verifies `width` proposals in every row."""
    return lambda prop: torch.full((prop.tokens.shape[0],), width, dtype=torch.long, device=prop.tokens.device)


def median_round_seconds(target, proposer, prompts, c: int, rounds: int, width: int = 0,
                         verify_budget=None) -> tuple[float, int]:
    """Median wall time of a round with all c rows present and the number of rounds timed. Stop
    tokens are off and every row has room for `rounds` + 2 rounds of up to 1 + width tokens, so
    no row leaves early; the first round, the warm-up, is dropped."""
    batch = (prompts * (c // len(prompts) + 1))[:c]
    out = generate(target, proposer, batch, max_new_tokens=(rounds + 2) * (1 + width), stop_token_ids=[],
                   verify_budget=verify_budget)
    times = [t.seconds for t in out.stats.round_timings[1:rounds + 1] if t.rows == c]
    return statistics.median(times), len(times)


def measure_cells(target, drafter, prompts, concurrencies, widths, rounds: int) -> tuple[list[dict], list[dict]]:
    """SGLang `rounds.jsonl`-style rows: the drafting round at c rows and c·(1+w) verify tokens,
    and the plain decoding step at c rows."""
    n = drafter.config.block_size - 1
    cells, plain = [], []
    for c in concurrencies:
        seconds, timed = median_round_seconds(target, None, prompts, c, rounds)
        plain.append({"batch_size_per_rank": c, "batch_tokens": c, "steps_per_sec": 1.0 / seconds,
                      "rounds_timed": timed})
        print(f"  plain c={c:>3}:      {1000 * seconds:8.1f} ms per step  ({timed} steps)", flush=True)
        for w in widths:
            seconds, timed = median_round_seconds(target, drafter, prompts, c, rounds, w, fixed_width(w))
            cells.append({"batch_size_per_rank": c, "batch_tokens": c * (1 + w), "steps_per_sec": 1.0 / seconds,
                          "frac": w / n, "rounds_timed": timed})
            print(f"  draft c={c:>3} w={w:>2}: {1000 * seconds:8.1f} ms per round ({timed} rounds)", flush=True)
    return cells, plain


def plain_step_table(plain: list[dict]) -> SpsAdditiveCostTable:
    """T_plain(n): the measured plain step times, piecewise linear in the rows n (additive form,
    no M term): bias = the smallest level's time, alpha(n) = the rest."""
    seconds = [1.0 / row["steps_per_sec"] for row in plain]
    return SpsAdditiveCostTable(bias_seconds=seconds[0], bs_probes=tuple(row["batch_size_per_rank"] for row in plain),
                                alpha_seconds=tuple(t - seconds[0] for t in seconds), m_probes=(1,),
                                theta_seconds=(0.0,))


def run_level(target, drafter, prompts, stops, c: int, max_new: int, verifier: DynamicVerifier) -> dict:
    """AR, DSPINE-static (recording confidences) and DSPINE-dynamic at concurrency c."""
    runs, tokens = {}, {}
    static_recorder = ConfidenceRecorder(drafter)
    for name, proposer, verify_budget in (("AR", None, None), ("DSPINE-static", static_recorder, None),
                                          ("DSPINE-dynamic", drafter, verifier)):
        out = generate(target, proposer, prompts, max_new_tokens=max_new, stop_token_ids=stops, batch_size=c,
                       verify_budget=verify_budget)
        s = out.stats
        runs[name] = {"algorithm": name, "concurrency": c, "output_tok_per_s": s.tokens_per_s,
                      "mean_verify_tokens": s.mean_verify_tokens, "accept_len": s.tau,
                      "mean_rows": s.row_rounds / max(s.rounds, 1), "decode_seconds": s.decode_seconds,
                      "emitted_tokens": s.emitted}
        tokens[name] = out.tokens
        print(f"  c={c:>3} {name:<15} {s.tokens_per_s:8.1f} tok/s  accept {s.tau:5.2f}  verify tokens "
              f"{s.mean_verify_tokens:5.2f}  rows {runs[name]['mean_rows']:5.1f}", flush=True)
    for name in ("DSPINE-static", "DSPINE-dynamic"):
        runs[name]["identical_to_ar"] = sum(a == b for a, b in zip(tokens[name], tokens["AR"]))
    runs["DSPINE-dynamic"]["plain_round_share"] = verifier.plain_rounds / max(verifier.plain_rounds + verifier.plans, 1)
    return {"runs": list(runs.values()), "recorder": static_recorder}


def plot(path: Path, result: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = result["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ar = {r["concurrency"]: r["output_tok_per_s"] for r in runs if r["algorithm"] == "AR"}
    for name, style in (("DSPINE-static", "s--"), ("DSPINE-dynamic", "o-")):
        xs = sorted(r["concurrency"] for r in runs if r["algorithm"] == name)
        ys = [next(r["output_tok_per_s"] for r in runs if r["algorithm"] == name and r["concurrency"] == x) / ar[x]
              for x in xs]
        ax1.plot(xs, ys, style, label=name)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set(xscale="log", xlabel="concurrency (batch size)", ylabel="output tok/s ÷ AR",
            title="Reference engine, held-out workload")
    ax1.set_xticks(sorted(ar), [str(c) for c in sorted(ar)])
    ax1.minorticks_off()
    ax1.legend()
    for c in sorted({cell["batch_size_per_rank"] for cell in result["cells"]}):
        pts = sorted((cell["batch_tokens"], 1000 / cell["steps_per_sec"]) for cell in result["cells"]
                     if cell["batch_size_per_rank"] == c)
        ax2.plot(*zip(*pts), "o-", label=f"draft + verify, c={c}")
    ax2.plot([cell["batch_tokens"] for cell in result["plain_cells"]],
             [1000 / cell["steps_per_sec"] for cell in result["plain_cells"]], "kx", ms=9, label="plain step")
    ax2.set(xscale="log", yscale="log", xlabel="verify tokens per round", ylabel="round time (ms)",
            title="Measured round time (tune split)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['target']} on {result['device']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=None, help="DSpine checkpoint (default: the shipped one)")
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--traces", nargs="+", default=DEV_TRACES,
                   help="trace files: tuned on their `tune` split, measured on their `heldout` split")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated batch sizes")
    p.add_argument("--widths", default="0,1,3,7,15", help="verify widths whose round time is measured")
    p.add_argument("--cell-rounds", type=int, default=4, help="rounds timed per (concurrency, width) cell")
    p.add_argument("--tune-requests", type=int, default=None, help="use only the first N tune requests")
    p.add_argument("--heldout-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--probe-share", type=float, default=0.02,
                   help="share of decoding time the speculation switch may spend on losing probes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True, help="result JSON (the plot goes beside it)")
    args = p.parse_args(argv)
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    torch.manual_seed(0)

    target, tokenizer = load_target(args.target, dtype=torch.float32, device=args.device)
    drafter_dir = args.drafter or default_drafter_dir()
    drafter = load_checkpoint(drafter_dir, target=target, device=args.device, dtype=torch.float32)
    stops = stop_token_ids(tokenizer, target)
    tune = encode(tokenizer, load_traces(args.traces, "tune")[:args.tune_requests], args.max_prompt_tokens)
    held_requests = heldout_workload(args.traces, args.heldout_requests)  # then ShareGPT held-out openers
    held = encode(tokenizer, held_requests, args.max_prompt_tokens)
    print(f"tune: {len(tune)} trace requests; held out: {len(held)} requests", flush=True)

    print("tune 1/2: calibration from verify-all rounds", flush=True)
    recorder = ConfidenceRecorder(drafter)
    generate(target, recorder, tune, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, batch_size=16)
    calibration = recorder.fit(dataset="dev traces, tune split", affine=True)
    prior = recorder.observed_survival
    print("tune 2/2: round time per (concurrency, verify width)", flush=True)
    cells, plain = measure_cells(target, drafter, tune, concurrencies, widths, args.cell_rounds)
    table, plain_table = fit_additive(cells) or fit_diagonal(cells), plain_step_table(plain)
    planner = VerifyPlanner(table, layout="padded")

    print("held out: AR vs DSPINE-static vs DSPINE-dynamic", flush=True)
    runs, logits, accepts = [], [], []
    for c in concurrencies:
        level = run_level(target, drafter, held, stops, c, args.max_new_tokens,
                          DynamicVerifier(planner, calibration, plain_table, probe_share=args.probe_share,
                                          prior_survival=prior))
        runs += level["runs"]
        logits.append(level["recorder"].logits)
        accepts.append(level["recorder"].accept_len)
    held_logits, held_accept = torch.cat(logits), torch.cat(accepts)
    ece_before = PositionCalibration.identity(held_logits.shape[1]).calibration_error(held_logits, held_accept)[1]
    ece_after = calibration.calibration_error(held_logits, held_accept)[1]
    gaps = calibration.survival_gaps(held_logits, held_accept)

    result = {"command": command_line(argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_name(args.device), "torch": torch.__version__, "sglang": None,
              "engine": "dspine reference engine (fp32, padded verify)",
              "target": args.target or "smollm2-135m-instruct",
              "drafter": str(drafter_dir),
              "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
              "tune_requests": len(tune), "heldout_requests": len(held),
              "heldout_sources": heldout_sources(held_requests),
              "runs": runs, "cells": cells, "plain_cells": plain, "sps_table": json.loads(sps_table_to_json(table)),
              "plain_step_table": json.loads(sps_table_to_json(plain_table)),
              "calibration": json.loads(calibration.to_json()),
              "switch": {"probe_share": args.probe_share, "prior_survival": prior.tolist()},
              "heldout_calibration": {"rounds": int(held_logits.shape[0]), "survival_ece_raw": ece_before,
                                      "survival_ece": ece_after,
                                      "largest_gap_points": max(abs(g["gap_points"]) for g in gaps),
                                      "positions": gaps}}
    write_json_atomic(args.out, result)
    plot(args.out.with_suffix(".png"), result)
    print(f"\n{'concurrency':>11} {'AR tok/s':>9} {'static':>9} {'dynamic':>9} {'dyn÷AR':>7} {'dyn÷static':>10} "
          f"{'verify tok':>10} {'plain share':>11}")
    for c in concurrencies:
        r = {x["algorithm"]: x for x in runs if x["concurrency"] == c}
        ar, st, dy = (r[k]["output_tok_per_s"] for k in ("AR", "DSPINE-static", "DSPINE-dynamic"))
        print(f"{c:>11} {ar:>9.1f} {st:>9.1f} {dy:>9.1f} {dy / ar:>7.2f} {dy / st:>10.2f} "
              f"{r['DSPINE-dynamic']['mean_verify_tokens']:>10.2f} {r['DSPINE-dynamic']['plain_round_share']:>11.2f}")
    print(f"held-out calibration: {held_logits.shape[0]} rounds, survival ECE {ece_before:.4f} -> {ece_after:.4f}, "
          f"largest gap {result['heldout_calibration']['largest_gap_points']:.1f} points")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
