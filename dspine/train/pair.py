"""Train the DSpine drafter and its DFlash-style ablation with the same data, steps and seed.

The step count is what the DSpine drafter reaches in `--dspine-seconds` (measured with a short
probe run), so one device call of at most 10 minutes can hold a training run; the ablation then
trains for exactly as many steps in a later call. Each phase writes its log
(`train_log_<run>.json`: device, command, config, wall time, the trainer's log) and its exported
checkpoint (`ckpt_<run>`: the final one, or the weights so far after a `--time-limit` stop) to
`--out-dir`. Both runs use the packaged SmolLM2 training
configs (`dspine/train/configs/smollm2-{dspine,ablation}.yaml`).

  python scripts/train_pair.py probe-and-train-dspine --data D --work W --out-dir O --dspine-seconds 300
  python scripts/train_pair.py train-ablation --data D --work W --out-dir O [--steps N]

With a fixed step count both can train at once, one process each (resumable, `--time-limit`):

  python scripts/train_pair.py train-dspine --steps N --data D --work W --out-dir O --time-limit 540 &
  python scripts/train_pair.py train-ablation --steps N --data D --work W --out-dir O --time-limit 540

A campaign's settings apply to both runs alike (`--set KEY=VALUE`, top-level config fields only, so
the two drafters still differ in nothing but their `drafter` switches), e.g. long multi-turn data:

  python scripts/train_pair.py train-dspine --steps N ... --set max_len=8192 --set blocks_per_seq=64

A DSpine variant against the same ablation (same data, steps, seed; only the named fields differ),
e.g. a wider injection, writes train_log_dspine-top16.json and ckpt_dspine-top16:

  python scripts/train_pair.py train-dspine --steps N ... --variant top16 --drafter-set injection_top_k=16
"""

from __future__ import annotations

import argparse
import datetime
import importlib.resources
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from dspine.train.cli import add_resume_modes
from dspine.train.trainer import TrainConfig, train
from dspine.utils.atomic import write_json_atomic

CONFIG_FILES = {"dspine": "smollm2-dspine.yaml", "ablation": "smollm2-ablation.yaml"}


def config_path(name: str) -> Path:
    """The packaged training config of run `name` ("dspine" or "ablation")."""
    return Path(str(importlib.resources.files("dspine.train") / "configs" / CONFIG_FILES[name]))


def drafter_settings(pairs: list[str]) -> dict:
    """`KEY=JSON` strings -> {KEY: value} for the drafter block, e.g. layer_loss_weights=[0.5,0.4,0.3,0.2,0.1]."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--drafter-set {pair!r}: expected KEY=JSON, e.g. injection_top_k=16")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--drafter-set {pair!r}: the value is not JSON ({e}); quote strings: "
                             f'selection="argmax"') from None
    return out


def build_config(name: str, args, steps: int) -> tuple[str, TrainConfig]:
    """(run name, config): the DSpine run takes `--variant`/`--drafter-set` (a variant trains in
    WORK/dspine-VARIANT and reports as dspine-VARIANT, beside the unchanged pair)."""
    run = f"{name}-{args.variant}" if args.variant else name
    cfg = TrainConfig.from_yaml(config_path(name), args.set, data=args.data, run_dir=str(Path(args.work) / run),
                                steps=steps)
    cfg.drafter.update(drafter_settings(args.drafter_set))
    return run, cfg


def _run(name: str, args, steps: int) -> Path | None:
    name, cfg = build_config(name, args, steps)
    t0 = time.perf_counter()
    export = train(cfg, device="cuda", time_limit_s=args.time_limit, progress=False, warm_start=args.warm_start,
                   new_data=args.new_data)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = json.loads((Path(cfg.run_dir) / "log.json").read_text())
    record = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "command": " ".join(sys.argv), "torch": torch.__version__,
              "config": vars(cfg), "wall_seconds": time.perf_counter() - t0, "log": log}
    write_json_atomic(out / f"train_log_{name}.json", record, indent=1)
    # the weights so far (a time-limited stop exports them too); the ablation's come back as well,
    # for serving; they stay out of git
    weights = Path(cfg.run_dir) / "checkpoint"
    if weights.is_dir():
        dest = out / f"ckpt_{name}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(weights, dest)
    return export


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["probe-and-train-dspine", "train-dspine", "train-ablation"])
    p.add_argument("--data", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--dspine-seconds", type=float, default=300)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--time-limit", type=float, default=None, help="hard stop (s); the run resumes when re-run")
    add_resume_modes(p)  # for both runs' states in --work, as `dspine train` takes them
    p.add_argument("--variant", default=None,
                   help="train-dspine: name of a variant run (e.g. top16), kept apart from the pair's")
    p.add_argument("--drafter-set", action="append", default=[], metavar="KEY=JSON",
                   help="train-dspine with --variant: override a drafter config field (repeatable), e.g. "
                        "injection_top_k=16 or transfer_rank=128")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a top-level training config field for this run, given to both runs of a pair alike "
                        "(repeatable), e.g. max_len=8192 or blocks_per_seq=64; drafter fields: --drafter-set")
    p.add_argument("--steps", type=int, default=None,
                   help="train-dspine: required; train-ablation: the DSpine run's step count (default: the "
                        "probe's, from --work/steps.json)")
    args = p.parse_args(argv)
    if (args.variant or args.drafter_set) and args.phase != "train-dspine":
        p.error("--variant and --drafter-set belong to train-dspine (the ablation and the probe stay as configured)")
    if args.drafter_set and not args.variant:
        p.error("--drafter-set needs --variant NAME, so the changed drafter does not overwrite the pair's")
    for item in args.set:
        key = item.partition("=")[0]
        if key.startswith("drafter"):
            p.error(f"--set {item}: --set is for top-level fields, which both runs share; a drafter field "
                    f"belongs to a DSpine variant: --variant NAME --drafter-set KEY=JSON")
        if key in ("steps", "data", "run_dir"):
            p.error(f"--set {item}: give {key} as --{key.replace('_', '-') if key != 'run_dir' else 'work'}")
    steps_file = Path(args.work) / "steps.json"
    if args.phase == "probe-and-train-dspine":
        probe = TrainConfig.from_yaml(config_path("dspine"), args.set, data=args.data,
                                      run_dir=str(Path(args.work) / "probe"))
        probe.steps, probe.log_every, probe.eval_every, probe.save_every = 25, 5, 1000, 1000
        train(probe, device="cuda", progress=False)
        log = json.loads((Path(probe.run_dir) / "log.json").read_text())
        step_s = sorted(e["step_seconds"] for e in log[1:])[len(log[1:]) // 2]
        steps = int(min(args.max_steps, args.dspine_seconds / (step_s * 1.12)))  # 12%: held-out evals, saves
        write_json_atomic(steps_file, {"steps": steps, "probe_step_seconds": step_s}, indent=None)
        print(f"probe: {step_s:.3f} s/step -> {steps} steps", flush=True)
        torch.cuda.empty_cache()
        _run("dspine", args, steps)
    elif args.phase == "train-dspine":
        if args.steps is None:
            p.error("train-dspine needs --steps (probe-and-train-dspine picks them from a timed probe)")
        _run("dspine", args, args.steps)
    else:
        if args.steps is None and not steps_file.is_file():
            p.error(f"{steps_file} is missing (the probe ran on another host?): pass --steps, the DSpine run's count")
        steps = args.steps if args.steps is not None else json.loads(steps_file.read_text())["steps"]
        _run("ablation", args, steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
