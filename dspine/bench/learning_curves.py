"""Learning curves of training runs: held-out τ against label tokens seen, read from the trainer's
logs, the DSpine drafter beside its ablation, and what more compute would buy at the curves' recent
slope.

    python -m dspine.bench.learning_curves --run dspine=benchmarks/results/train_log_smollm2_dspine.json \\
        --run ablation=benchmarks/results/train_log_smollm2_ablation.json

A log is `scripts/train_pair.py`'s `train_log_<run>.json` (`{"device", "config", "log": [...]}`) or
a run directory's `log.json` (the list alone: no device, no config). Each evaluated entry
(`heldout_tau`: the trainer's teacher-forced τ on its held-out sequences) is a point at the entry's
`labels_seen`. Logs written before the trainer counted labels give `step x batch_size x
grad_accum_steps x blocks_per_seq x (block_size - 1)` instead, marked `labels_estimated`: an upper
bound (an answer with fewer positions than blocks_per_seq repeats anchors that carry no labels).

Writes NAME.json (`{"device", "date", "command", "runs": [{"name", "log", "device",
"labels_estimated", "points": [{"step", "labels_seen", "heldout_tau"}], "per_decade", "tau_at_10x"}]}`)
and NAME.png. `per_decade` is the least-squares slope of τ against log10(labels seen) over the later
half of a run's points (at least two); `tau_at_10x` is the last τ plus one such decade: the recent
slope carried forward, an extrapolation and not a measurement (a cosine schedule's last steps steepen
it; a curve that bends flattens it). Both are null for a run with fewer than two points.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

from dspine.bench.results import DEFAULT_OUT_DIR, command_line, write_results
from dspine.utils.plot import pyplot, save_figure

RESULTS_NAME = "learning_curves_smollm2"


class CurveError(ValueError):
    """A log cannot give a learning curve; the message names the file and why."""


def read_log(path: Path) -> tuple[list[dict], dict | None, str | None]:
    """`(entries, config or None, device or None)` of a train_pair log or a run's log.json."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CurveError(f"{path}: not a readable JSON log ({exc})") from exc
    if isinstance(data, list):
        return data, None, None
    if isinstance(data, dict) and isinstance(data.get("log"), list):
        return data["log"], data.get("config"), data.get("device")
    raise CurveError(f"{path}: neither a trainer log (a list) nor a train_pair log (an object with `log`)")


def labels_per_step(config: dict) -> int:
    """Label tokens a step draws at most: sequences x blocks x (block size - 1)."""
    block = int((config.get("drafter") or {}).get("block_size", 16))
    return (int(config["batch_size"]) * int(config.get("grad_accum_steps") or 1) * int(config["blocks_per_seq"])
            * (block - 1))


def curve_points(entries: list[dict], config: dict | None, path: Path) -> tuple[list[dict], bool]:
    """`(points, labels_estimated)`: one point per entry with `heldout_tau`, in step order."""
    evaluated = sorted((e for e in entries if "heldout_tau" in e), key=lambda e: e["step"])
    if not evaluated:
        raise CurveError(f"{path}: no entry has `heldout_tau` (the trainer evaluates every `eval_every` steps)")
    estimated = any("labels_seen" not in e for e in evaluated)
    if estimated and config is None:
        raise CurveError(f"{path}: entries without `labels_seen` and no config to estimate them from")
    points = [{"step": int(e["step"]),
               "labels_seen": int(e["step"] * labels_per_step(config) if estimated else e["labels_seen"]),
               "heldout_tau": float(e["heldout_tau"])} for e in evaluated]
    return points, estimated


def recent_slope(points: list[dict]) -> float | None:
    """Least-squares d τ / d log10(labels seen) over the later half of `points` (at least two)."""
    tail = points[len(points) // 2:] if len(points) >= 4 else points
    if len(tail) < 2:
        return None
    xs = [math.log10(p["labels_seen"]) for p in tail]
    ys = [p["heldout_tau"] for p in tail]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return None if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def curve(name: str, path: Path) -> dict:
    """One run's entry of the results (module docstring)."""
    entries, config, device = read_log(path)
    points, estimated = curve_points(entries, config, path)
    slope = recent_slope(points)
    return {"name": name, "log": str(path), "device": device, "labels_estimated": estimated, "points": points,
            "per_decade": None if slope is None else round(slope, 4),
            "tau_at_10x": None if slope is None else round(points[-1]["heldout_tau"] + slope, 4)}


def plot(results: dict, out_dir: Path, name: str) -> Path | None:
    plt = pyplot("rerun with matplotlib installed to draw it")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for run in results["runs"]:
        xs = [p["labels_seen"] for p in run["points"]]
        line, = ax.plot(xs, [p["heldout_tau"] for p in run["points"]], marker="o",
                        label=run["name"] + (" (labels estimated)" if run["labels_estimated"] else ""))
        if run["tau_at_10x"] is not None:
            ax.plot([xs[-1], xs[-1] * 10], [run["points"][-1]["heldout_tau"], run["tau_at_10x"]], ":",
                    color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("label tokens seen")
    ax.set_ylabel("held-out τ (teacher-forced)")
    ax.set_title("Learning curves; dotted: the recent slope carried one decade further (extrapolation)", fontsize=8)
    ax.legend(fontsize=7)
    return save_figure(fig, out_dir / f"{name}.png")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dspine.bench.learning_curves",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--run", action="append", required=True, metavar="NAME=LOG",
                   help="a run's name and its log (repeatable; the plot draws them in this order)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--name", default=RESULTS_NAME, help=f"results file stem (default {RESULTS_NAME})")
    args = p.parse_args(argv)
    for spec in args.run:
        if "=" not in spec or not spec.split("=", 1)[0]:
            p.error(f"--run {spec!r}: give NAME=LOG, e.g. dspine=benchmarks/results/train_log_smollm2_dspine.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = [curve(name, Path(path)) for name, path in (spec.split("=", 1) for spec in args.run)]
    except CurveError as exc:
        print(f"learning_curves: {exc}")
        return 2
    devices = sorted({r["device"] for r in runs if r["device"]})
    results = {"device": "; ".join(devices) or "unknown (the logs name no device)",
               "date": datetime.date.today().isoformat(), "command": command_line(argv), "runs": runs}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_results(results, args.out_dir, args.name)
    plot(results, args.out_dir, args.name)
    for run in runs:
        last = run["points"][-1]
        extra = "" if run["per_decade"] is None else \
            f"; {run['per_decade']:+.2f} a decade -> {run['tau_at_10x']:.2f} at 10x (extrapolated)"
        print(f"{run['name']:<12} {len(run['points'])} points, last tau {last['heldout_tau']:.3f} at "
              f"{last['labels_seen']:,} labels{' (estimated)' if run['labels_estimated'] else ''}{extra}")
    print(f"wrote {args.out_dir / args.name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
