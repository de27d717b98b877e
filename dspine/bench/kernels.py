"""Fused injection and selection kernels vs eager and torch.compile references; the draft round.

Measures, at Qwen3-8B and SmolLM2-135M shapes and bs 1/8/32: the fused adjacent injection (one
layer, five layers, and variants that change or drop a stage; with injection_candidates
"first_layer", one later layer and the five-layer chain), the transition-path kernel, the top-k of
the draft logits (`kernels.logits_topk` vs torch.topk; its knobs swept) and the whole
`select_tokens` (whose Triton path takes its candidates from that top-k), each against the eager
PyTorch reference and `torch.compile` of it (CUDA-graph replays, median of >= 50); a full draft
round (`DSpineProposer.propose`, context 1024) of DSpine vs the ablation (no injection, argmax
selection); and a 16-token verify of a target of the same shape (lean Llama-style layers + SDPA, a
lower bound) for the verify-inclusive ratio. Achieved GB/s are against the fewest bytes each case
must move, next to a measured device copy.

GPU host:  python scripts/bench_kernels.py --out-dir OUT                (< 5 min on an H200)
           python scripts/bench_kernels.py --out-dir OUT --only suffix_match   (one kernel, < 1 min)
           python scripts/bench_kernels.py --out-dir OUT --only cross_entropy  (the trainer's loss chunk)
CPU check: TRITON_INTERPRET=1 python scripts/bench_kernels.py --cpu-smoke (tiny shapes, interpreter)

Writes kernels_<device>.json (schema in `Run`; <device> e.g. h200, h100, or cpu for --cpu-smoke),
kernels_<device>.png and kernels_<device>_details.json (config
sweep, correctness checks, compile times, errors) to --out-dir (default benchmarks/results; a
temporary folder with --cpu-smoke), rewriting them after every measurement so a timeout still
leaves results. Modules: kernels_harness (settings, timing, result files), kernels_injection,
kernels_selection, kernels_round (draft round, verify), kernels_training (the loss chunk),
kernels_report (targets, table, plot).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

from dspine import env
from dspine.bench.kernels_harness import Run, Settings
from dspine.bench.kernels_injection import injection_bytes, injection_cases
from dspine.bench.kernels_report import plot, print_table, targets
from dspine.bench.kernels_round import round_section, verify_section
from dspine.bench.kernels_selection import selection_cases, suffix_match_case
from dspine.bench.kernels_training import cross_entropy_case
from dspine.bench.results import command_line
from dspine.kernels import dispatch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the JSON/PNG go (default benchmarks/results; a temp dir with --cpu-smoke)")
    p.add_argument("--quick", action="store_true", help="bs 1 and 32 only, smaller config sweep")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU through the Triton interpreter (needs TRITON_INTERPRET=1)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting optional work after this many seconds (default 270, quick 150)")
    p.add_argument("--reps", type=int, default=None, help="timed samples per case (median; default 50)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines (compile_ms null)")
    p.add_argument("--only", choices=["suffix_match", "cross_entropy"], default=None,
                   help="time only this kernel, at every shape (suffix_match: and batch size; cross_entropy: the "
                        "trainer's loss chunk of one and two levels); no sweep, round or verify")
    return p.parse_args(argv)


def shape_sections(run: Run, name: str, shape: dict, best: dict) -> None:
    """Kernels at every batch size (the launch configuration swept once per size class, then
    reused), then the draft round and the verify, at one shape."""
    cfg = run.cfg
    run.log(f"== injection / selection kernels: {name}")
    for bs in cfg.batches:
        if run.remaining() < 60 and bs != cfg.batches[0]:
            run.details["notes"].append(f"kernels {name} bs={bs} skipped: out of budget")
            continue
        if bw := run.results["copy_bandwidth_gbs"]:
            run.details["floors_ms"][f"{name}/bs{bs}/injection_5layers"] = round(
                cfg.draft_layers * injection_bytes(cfg, shape["hidden"], shape["vocab"], bs) / (bw * 1e9) * 1e3, 4)
        size_class = "large" if bs * (cfg.block - 2) > 64 else "small"
        try:
            best[size_class] = injection_cases(run, name, shape, bs, best.get(size_class))
        except Exception as exc:  # noqa: BLE001
            run.record_error(f"injection {name} bs={bs}", exc)
        try:
            selection_cases(run, name, shape, bs)
        except Exception as exc:  # noqa: BLE001
            run.record_error(f"selection {name} bs={bs}", exc)
        run.empty_cache()
    run.log(f"== draft round: {name}")
    rounds = round_section(run, name, shape)
    run.empty_cache()
    run.log(f"== verify: {name}")
    verify_section(run, name, shape, rounds)
    run.empty_cache()
    targets(run)


def missing_requirement(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the requested mode, or None."""
    if args.cpu_smoke:
        return None if env.TRITON_INTERPRET.get() else (
            "--cpu-smoke needs the Triton interpreter, which is chosen before the kernels load: "
            "TRITON_INTERPRET=1 python scripts/bench_kernels.py --cpu-smoke")
    return None if torch.cuda.is_available() else "no CUDA device: run on the GPU host, or use --cpu-smoke here"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := missing_requirement(args):
        print(problem, file=sys.stderr)
        return 2
    run = Run(Settings.from_args(args), command_line(argv))
    cfg = run.cfg
    torch.manual_seed(0)
    if cfg.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    run.log(f"DSpine kernel bench on {run.results['device']}; torch {run.results['torch']}, triton "
            f"{run.results['triton']}; budget {cfg.budget_s:.0f} s; out {cfg.out_dir}")
    # The smoke run's CPU tensors reach the kernels only when forced (the interpreter runs them).
    with dispatch.forced("triton") if cfg.smoke else contextlib.nullcontext():
        run.results["copy_bandwidth_gbs"] = round(run.copy_bandwidth_gbs(), 1)
        run.log(f"copy bandwidth {run.results['copy_bandwidth_gbs']} GB/s")
        run.save()
        if args.only == "suffix_match":
            for name in cfg.shapes:
                for bs in cfg.batches:
                    suffix_match_case(run, name, bs)
        elif args.only == "cross_entropy":
            for name, shape in cfg.shapes.items():
                for levels in (1, 2):
                    cross_entropy_case(run, name, shape, levels)
            run.run_compiles()
        else:
            best: dict = {}
            for name, shape in cfg.shapes.items():
                shape_sections(run, name, shape, best)
            run.log("== torch.compile baselines")
            run.run_compiles()
    targets(run)
    plot(run)
    run.save()
    print_table(run)
    run.log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
