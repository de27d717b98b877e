"""Calibrate the drafter's confidence head on traces with the reference engine, and check it on held-out traces.

Dynamic verification reads per-position acceptance estimates: p_j = sigmoid(logit_j / T_j + b_j) from
the confidence head (`PositionCalibration`): temperature scaling fits T_j alone (b_j = 0, SGLang's STS
format), the affine fit T_j and b_j. This benchmark fits both on the traces' `tune` split and reports,
for each, on their `heldout` split, for
every proposal position j: the predicted probability that a round gets past j (the calibrated
survival, mean over rounds), the observed rate, their gap in points, and the survival ECE before
and after calibration. No server: the reference engine (`dspine.engine.generate.generate` with
`ConfidenceRecorder`, every round verifying the whole block) on CPU or GPU. Prompts are rendered as
`dspine tune-sps` sends them to `/generate` (`role: content` lines), decoding greedy.

  python scripts/calibrate_reference.py --traces benchmarks/traces/sharegpt_dev.jsonl \\
      benchmarks/traces/tooltalk_dev.jsonl --max-new-tokens 64 --out calibration.json [--sts-out sts.json]

The served drafter runs in bf16 with SGLang's kernels: for a deployment, calibrate on what the
server records (`dspine tune-sps`); this is the same fit on the reference path, for development.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from dspine.bench.accept import device_name
from dspine.bench.results import command_line
from dspine.data.traces import load_traces
from dspine.dynamic.calibration import PositionCalibration
from dspine.dynamic.recording import ConfidenceRecorder
from dspine.engine.generate import generate
from dspine.engine.targets import load_target, stop_token_ids
from dspine.model.checkpoint import default_drafter_dir, load_checkpoint
from dspine.serve.sps_measure import render_prompt
from dspine.utils.atomic import write_json_atomic, write_text_atomic


def record(target, tokenizer, drafter, requests, *, max_new_tokens: int, batch_size: int) -> ConfidenceRecorder:
    """Greedy rounds over `requests`, each verifying the whole block, with their confidence logits."""
    recorder = ConfidenceRecorder(drafter)
    ids = [tokenizer.encode(render_prompt(r), add_special_tokens=False) for r in requests]
    generate(target, recorder, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer, target),
             batch_size=batch_size)
    return recorder


def heldout_report(fit: PositionCalibration, held: ConfidenceRecorder, ece_before: list[float]) -> dict:
    """Print and return one fit's held-out table: per position predicted vs observed, gap, ECE
    before (raw head) and after; plus the overall survival ECE after and the largest gap."""
    after, after_all = fit.calibration_error(held.logits, held.accept_len)
    rows = fit.survival_gaps(held.logits, held.accept_len)
    for row, b, a in zip(rows, ece_before, after):
        row.update(ece_before=b, ece_after=a)
    print(f"{'pos':>4} {'predicted':>10} {'observed':>9} {'gap pts':>8} {'ECE before':>11} {'ECE after':>10}")
    for r in rows:
        print(f"{r['position']:>4} {r['predicted']:>10.3f} {r['observed']:>9.3f} {r['gap_points']:>8.2f} "
              f"{r['ece_before']:>11.4f} {r['ece_after']:>10.4f}")
    return {"ece_after": after_all, "largest_gap_points": max(abs(r["gap_points"]) for r in rows), "positions": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", nargs="+", required=True, help="trace files (OpenAI-request JSONL or ShareGPT)")
    p.add_argument("--drafter", default=None, help="DSpine checkpoint (default: the shipped one)")
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, required=True, help="report JSON")
    p.add_argument("--sts-out", type=Path, default=None,
                   help="also write the temperature-only fit (SGLang's STS JSON)")
    p.add_argument("--affine-out", type=Path, default=None,
                   help="also write the affine fit (STS JSON plus `biases`; DSpine's planner only)")
    args = p.parse_args(argv)
    tune, heldout = load_traces(args.traces, "tune"), load_traces(args.traces, "heldout")
    target, tokenizer = load_target(args.target, dtype=torch.float32, device=args.device)
    drafter_dir = args.drafter or default_drafter_dir()
    drafter = load_checkpoint(drafter_dir, target=target, device=args.device, dtype=torch.float32)
    common = {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}
    print(f"tune: {len(tune)} requests ...", flush=True)
    tuned = record(target, tokenizer, drafter, tune, **common)
    dataset = ",".join(map(str, args.traces))
    fits = {"temperature": tuned.fit(dataset=dataset), "affine": tuned.fit(dataset=dataset, affine=True)}
    print(f"heldout: {len(heldout)} requests ...", flush=True)
    held = record(target, tokenizer, drafter, heldout, **common)
    identity = PositionCalibration.identity(len(fits["temperature"].temperatures))
    before, before_all = identity.calibration_error(held.logits, held.accept_len)
    reports = {name: heldout_report(fit, held, before) for name, fit in fits.items()}
    for name, rep in reports.items():
        print(f"[{name}] held-out rounds {held.logits.shape[0]}: largest gap {rep['largest_gap_points']:.2f} points; "
              f"survival ECE {before_all:.4f} -> {rep['ece_after']:.4f}")
    fitted, rows = fits["temperature"], reports["temperature"]["positions"]
    result = {"command": command_line(argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_name(args.device),
              "torch": torch.__version__, "target": args.target or "smollm2-135m-instruct",
              "drafter": str(drafter_dir), "traces": [str(t) for t in args.traces],
              "max_new_tokens": args.max_new_tokens, "tune_requests": len(tune), "heldout_requests": len(heldout),
              "tune_rounds": fitted.num_samples, "heldout_rounds": int(held.logits.shape[0]),
              "temperatures": list(fitted.temperatures), "ece_before": before_all,
              "ece_after": reports["temperature"]["ece_after"],
              "largest_gap_points": reports["temperature"]["largest_gap_points"], "positions": rows,
              "affine": {"temperatures": list(fits["affine"].temperatures), "biases": list(fits["affine"].biases),
                         **reports["affine"]}}
    write_json_atomic(args.out, result)
    if args.sts_out:
        write_text_atomic(args.sts_out, fitted.to_json() + "\n")
    if args.affine_out:
        write_text_atomic(args.affine_out, fits["affine"].to_json() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
