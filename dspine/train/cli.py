"""`dspine gen-data`, `dspine train` and `dspine bench-accept` subcommands."""

from __future__ import annotations

import argparse


def cmd_train(args) -> int:
    import torch

    from dspine.train.trainer import TrainConfig, train

    cfg = TrainConfig.from_yaml(args.config, data=args.data, run_dir=args.run_dir, steps=args.steps,
                                batch_size=args.batch_size)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.profile_steps:
        from dspine.train.profile import profile_training

        print(profile_training(cfg, device=device, steps=args.profile_steps))
        return 0
    limit = args.time_limit_minutes * 60 if args.time_limit_minutes else None
    export = train(cfg, device=device, time_limit_s=limit, progress=not args.quiet)
    return 0 if export is not None else 3


def cmd_gen_data(args) -> int:
    import sys

    from dspine.train.gen_data import GenDataError, run_gen_data

    try:
        return run_gen_data(args)
    except GenDataError as exc:
        print(f"dspine gen-data: error: {exc}", file=sys.stderr)
        return 2


def add_command(sub) -> None:
    from dspine.bench import accept as bench_accept
    from dspine.train import gen_data

    raw = argparse.RawDescriptionHelpFormatter
    g = sub.add_parser("gen-data", help="regenerate training answers with the target itself", formatter_class=raw,
                       description="Target-regenerated training data (ShareGPT + synthetic code/math prompts, none "
                                   "from an evaluation set).\n\nExample:\n"
                                   "  dspine gen-data --out runs/data/smollm2.jsonl --num-prompts 8000 --batch-size 512\n"
                                   "  dspine gen-data --out runs/data/smollm2-x4.jsonl --server http://127.0.0.1:30000 \\\n"
                                   "      --batch-size 64 --concurrency 8 --temperature 0.8 --samples-per-prompt 4")
    gen_data.add_arguments(g)
    g.set_defaults(func=cmd_gen_data)

    t = sub.add_parser("train", help="train a drafter online (frozen target in the loop)", formatter_class=raw,
                       description="Online training with checkpoint/resume. A run stopped by --time-limit-minutes "
                                   "exits with code 3 and continues where it stopped when started again.\n\n"
                                   "Examples:\n"
                                   "  dspine train dspine/train/configs/smollm2-dspine.yaml --data runs/data/smollm2.jsonl\n"
                                   "  dspine train dspine/train/configs/smollm2-ablation.yaml --data ... --time-limit-minutes 8")
    t.add_argument("config", help="YAML training config (dspine/train/configs/*.yaml)")
    t.add_argument("--data", help="JSONL from `dspine gen-data` (overrides the config)")
    t.add_argument("--run-dir", help="where state, log and the exported checkpoint go (overrides the config)")
    t.add_argument("--steps", type=int)
    t.add_argument("--batch-size", type=int)
    t.add_argument("--device", default=None)
    t.add_argument("--time-limit-minutes", type=float, default=None)
    t.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="profile N steps (after 3 warm-up steps) and print where the time goes; trains nothing")
    t.add_argument("-q", "--quiet", action="store_true")
    t.set_defaults(func=cmd_train)

    b = sub.add_parser("bench-accept", help="τ and per-position acceptance on the evaluation sets",
                       formatter_class=raw,
                       description="Example:\n  dspine bench-accept --drafter dspine=dspine/checkpoints/dspine-smollm2-135m-instruct"
                                   " \\\n      --drafter ablation=runs/ablation/checkpoint --num-prompts 64\n"
                                   "One drafter per GPU, then one file:\n"
                                   "  CUDA_VISIBLE_DEVICES=1 dspine bench-accept --drafter ablation=... --out abl.json &\n"
                                   "  dspine bench-accept --drafter dspine=... --out dsp.json; wait\n"
                                   "  dspine bench-accept --merge dsp.json abl.json --out acceptance.json")
    bench_accept.add_arguments(b)
    b.set_defaults(func=bench_accept.run_bench_accept)
