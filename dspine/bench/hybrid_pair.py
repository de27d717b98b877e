"""Write a random-weight hybrid Gated-DeltaNet target and a random DSpine drafter for it.

Purpose: exercise SGLang's hybrid GDN path (`Qwen3NextForCausalLM`: 3 linear-attention layers to 1
full-attention layer, as in Qwen3-Next) with `--speculative-algorithm DSPINE
--enable-linear-replayssm-spec --linear-replayssm-cache-len 32` on a host without network or hub
weights, and measure greedy parity and tokens/s AR vs DSPINE (`dspine.bench.serving`). The
weights are random: the answers are gibberish and the drafter's proposals are (almost) never
accepted, so the run tests plumbing, losslessness and speed, not drafting quality.

  python3 scripts/make_hybrid_sglang_pair.py TOKENIZER_DIR OUT_DIR [--hidden 1024 --layers 8 ...]

writes
  OUT_DIR/target   config.json (architectures ["Qwen3NextForCausalLM"], the key layout of the
                   published Qwen3-Next configs: `full_attention_interval` for SGLang, `layer_types`
                   for transformers), model.safetensors (bf16, the Qwen3-Next checkpoint tensor
                   names, experts one by one), and the tokenizer files + chat template of
                   TOKENIZER_DIR (e.g. the SmolLM2-135M-Instruct folder, vocab 49152);
  OUT_DIR/drafter  a DSpine checkpoint (dspine.model.checkpoint.save_checkpoint: `dspine_config` plus the
                   `dflash_config` mirror SGLang reads), shaped for that target, block 16.

SGLang 0.5.17 builds every Qwen3-Next MLP as a sparse MoE block (no dense layers), so the target
has the smallest conventional MoE: 8 experts, top-2, expert width 512, plus one shared expert of the
same width (which SGLang fuses into the expert kernel on CUDA, as for the real model). The routed
experts of a layer share one set of weights unless --distinct-experts: the router still runs and
picks two, but with normalised top-k weights the output no longer depends on which. With distinct
random experts, bf16 differences between a 16-token verify forward and single-token decodes flip
routing decisions, and the flips blow up into logit differences of 3-19 nats: greedy parity then
fails for every speculative server alike, SGLang's own DFLASH included
(benchmarks/results/hybrid_parity_diagnosis_h200.json; `--check-gaps` measures it on the CPU).

Weights: N(0, --init-std) for every projection and the embedding; the head N(0, --lm-head-std)
with row norms scaled by exp(--lm-head-row-sigma x N(0, 1)): a heavy-tailed head makes the top
logit stand out, so fewer greedy steps are bf16 near-ties (i.i.d. rows give ~20 % of steps within
two bf16 steps of the runner-up, the defaults ~2 %). The default head scale keeps the top logit at
3-27, a trained model's range: bf16 noise in the logits grows with their size, and parity judges
divergences in absolute nats (at a 5x larger scale, top logits reach 134 and a one-pass forward
departs from decoding by up to 2.5 nats, 4 argmax flips in 768 steps above 0.25 nats; at the
default, at most 0.5 and none). Zero-centred (1 + w)
RMSNorms at zero, gated-norm weights at one, dt_bias at one, A = exp(A_log) ~ U[--a-min, --a-max]
per value head (the recurrent state remembers a few to a few dozen tokens: forgetting it changes
the very first greedy token). Deterministic for a given --seed (the same bytes under torch 2.13
and 2.14). `--check-gaps` then runs the written target with transformers on the CPU (greedy,
chat-templated prompts, bf16) and prints the distribution of the top-2 logit gap, and how far one
forward over each prompt + answer (the chunked GDN path, as a verify step) departs from the decode
steps' logits: argmax flips and their decode-side gaps.

Needs torch, safetensors, transformers (only for --check-gaps) and dspine.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

# Tokenizer and template files copied from TOKENIZER_DIR when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "vocab.json")
MADE_BY = "dspine.bench.hybrid_pair"
GAP_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
               "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether?", "Explain RoPE in two sentences.",
               "List three prime numbers.", "Tell me a short story about a robot.",
               "How do I sort a list of dictionaries by a key in Python?", "What causes the seasons on Earth?",
               "Translate 'good morning' into French and Spanish.", "Give two tips for writing clear emails.",
               "What is 17 times 23?", "Summarise the plot of Romeo and Juliet in one sentence.")


class PairError(RuntimeError):
    """An input this module cannot use; the message says which and how to fix it."""


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def tokenizer_info(tok_dir: Path, vocab_size: int | None = None) -> dict:
    """vocab size and special token ids of TOKENIZER_DIR, and the files to copy."""
    if not tok_dir.is_dir():
        raise PairError(f"TOKENIZER_DIR {tok_dir} is not a directory. Pass a Hugging Face model folder with the "
                        "tokenizer files (on the GPU host: \"$SMOLLM2\" after `source scripts/gpu_host_sglang.sh`; "
                        "locally: python -c 'from dspine.engine.targets import smollm2_dir; print(smollm2_dir())').")
    if not any((tok_dir / f).is_file() for f in TOKENIZER_MODELS):
        raise PairError(f"TOKENIZER_DIR {tok_dir} holds none of {', '.join(TOKENIZER_MODELS)}: not a tokenizer folder.")
    config = {}
    if (tok_dir / "config.json").is_file():
        config = json.loads((tok_dir / "config.json").read_text())
    vocab = vocab_size or config.get("vocab_size") or _vocab_from_tokenizer_json(tok_dir / "tokenizer.json")
    if not vocab:
        raise PairError(f"cannot tell the vocabulary size of {tok_dir}: no config.json vocab_size and no "
                        "tokenizer.json. Pass --vocab-size.")
    return {"vocab_size": int(vocab), "bos_token_id": config.get("bos_token_id"),
            "eos_token_id": config.get("eos_token_id"), "pad_token_id": config.get("pad_token_id"),
            "files": [f for f in TOKENIZER_FILES if (tok_dir / f).is_file()]}


def _vocab_from_tokenizer_json(path: Path) -> int | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    ids = list(((data.get("model") or {}).get("vocab") or {}).values())
    ids += [t["id"] for t in data.get("added_tokens") or []]
    ids = [i for i in ids if isinstance(i, int)]
    return max(ids) + 1 if ids else None


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------

def target_config(args: argparse.Namespace, tok: dict) -> dict:
    """config.json in the key layout of the published Qwen3-Next configs."""
    if args.layers % args.full_attention_interval:
        raise PairError(f"--layers {args.layers} is not a multiple of --full-attention-interval "
                        f"{args.full_attention_interval}: SGLang places a full-attention layer at every "
                        "interval-th layer, so the pattern must tile the model.")
    layer_types = ["full_attention" if (i + 1) % args.full_attention_interval == 0 else "linear_attention"
                   for i in range(args.layers)]
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "full_attention_interval": args.full_attention_interval,  # SGLang's layer pattern
        "layer_types": layer_types,  # transformers' layer pattern (the same)
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "hidden_size": args.hidden,
        "initializer_range": args.init_std,
        "intermediate_size": args.intermediate,  # dense MLP width: no layer uses it (all sparse); the drafter's MLP
        "linear_conv_kernel_dim": args.conv_kernel,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_value_head_dim": args.linear_value_head_dim,
        "max_position_embeddings": args.max_position_embeddings,
        "mlp_only_layers": [],
        "moe_intermediate_size": args.moe_intermediate,
        "norm_topk_prob": True,
        "num_attention_heads": args.heads,
        "num_experts": args.experts,
        "num_experts_per_tok": args.experts_per_token,
        "num_hidden_layers": args.layers,
        "num_key_value_heads": args.kv_heads,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": args.rope_theta,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": args.moe_intermediate,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": tok["vocab_size"],
        "dspine_random_target": {"seed": args.seed, "init_std": args.init_std, "lm_head_std": args.lm_head_std,
                                 "a_range": [args.a_min, args.a_max], "tied_experts": not args.distinct_experts,
                                 "made_by": MADE_BY},
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if tok.get(key) is not None:
            cfg[key] = tok[key]
    if args.heads % args.kv_heads or args.linear_value_heads % args.linear_key_heads:
        raise PairError("--heads must be a multiple of --kv-heads and --linear-value-heads of --linear-key-heads")
    return cfg


def target_weights(cfg: dict, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Every tensor of a Qwen3-Next checkpoint (HF names; experts one by one), bf16, seeded."""
    g = torch.Generator().manual_seed(args.seed)
    bf16 = torch.bfloat16

    def normal(*shape, std=args.init_std):
        return (torch.randn(*shape, generator=g) * std).to(bf16)

    def const(n, value):
        return torch.full((n,), float(value), dtype=bf16)

    h, v = cfg["hidden_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    hv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    key_dim, value_dim = hk * dk, hv * dv
    e, im = cfg["num_experts"], cfg["moe_intermediate_size"]
    w = {"model.embed_tokens.weight": normal(v, h)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = const(h, 0)  # (1 + w) RMSNorm
        w[p + "post_attention_layernorm.weight"] = const(h, 0)
        if kind == "linear_attention":
            a = torch.empty(hv).uniform_(args.a_min, args.a_max, generator=g)
            w.update({
                p + "linear_attn.in_proj_qkvz.weight": normal(2 * key_dim + 2 * value_dim, h),
                p + "linear_attn.in_proj_ba.weight": normal(2 * hv, h),
                p + "linear_attn.conv1d.weight": normal(2 * key_dim + value_dim, 1, cfg["linear_conv_kernel_dim"],
                                                        std=1.0 / math.sqrt(cfg["linear_conv_kernel_dim"])),
                p + "linear_attn.dt_bias": const(hv, 1),
                p + "linear_attn.A_log": a.log().to(bf16),
                p + "linear_attn.norm.weight": const(dv, 1),  # gated RMSNorm: plain weight
                p + "linear_attn.out_proj.weight": normal(h, value_dim),
            })
        else:
            w.update({
                p + "self_attn.q_proj.weight": normal(2 * nq * d, h),  # query and output gate
                p + "self_attn.k_proj.weight": normal(nkv * d, h),
                p + "self_attn.v_proj.weight": normal(nkv * d, h),
                p + "self_attn.o_proj.weight": normal(h, nq * d),
                p + "self_attn.q_norm.weight": const(d, 0),
                p + "self_attn.k_norm.weight": const(d, 0),
            })
        w[p + "mlp.gate.weight"] = normal(e, h)
        for j in range(e):
            q = f"{p}mlp.experts.{j}."
            if j and not args.distinct_experts:  # every routed expert equals expert 0 (see the module docstring)
                w.update({q + n: w[f"{p}mlp.experts.0.{n}"].clone() for n in ("gate_proj.weight", "up_proj.weight",
                                                                               "down_proj.weight")})
                continue
            w.update({q + "gate_proj.weight": normal(im, h), q + "up_proj.weight": normal(im, h),
                      q + "down_proj.weight": normal(h, im)})
        w.update({p + "mlp.shared_expert.gate_proj.weight": normal(cfg["shared_expert_intermediate_size"], h),
                  p + "mlp.shared_expert.up_proj.weight": normal(cfg["shared_expert_intermediate_size"], h),
                  p + "mlp.shared_expert.down_proj.weight": normal(h, cfg["shared_expert_intermediate_size"]),
                  p + "mlp.shared_expert_gate.weight": normal(1, h)})
    w["model.norm.weight"] = const(h, 0)
    # Row scales exp(sigma * N(0, 1)): a heavy-tailed head makes the top logit stand out more often, so
    # fewer greedy steps are bf16 near-ties than with i.i.d. rows (which give ~20% at <= 2 bf16 steps).
    row_scale = torch.exp(args.lm_head_row_sigma * torch.randn(v, 1, generator=g))
    w["lm_head.weight"] = (torch.randn(v, h, generator=g) * args.lm_head_std * row_scale).to(bf16)
    return w


def write_target(out: Path, cfg: dict, weights: dict[str, torch.Tensor], tok_dir: Path, tok: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in tok["files"]:
        shutil.copyfile(tok_dir / name, out / name)


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------

def write_drafter(out: Path, cfg: dict, args: argparse.Namespace):
    """A random DSpine drafter for `cfg`, checked against it, saved with dspine's checkpoint writer."""
    from dspine import DSpineConfig, DSpineDrafter
    from dspine.model.checkpoint import check_target_compatible, save_checkpoint

    target = SimpleNamespace(**cfg)
    dcfg = DSpineConfig.for_target(target, mask_token_id=args.mask_token_id, block_size=args.block,
                                   intermediate_size=args.intermediate)
    check_target_compatible(dcfg, target)
    torch.manual_seed(args.seed + 1)
    model = DSpineDrafter(dcfg).eval()
    with torch.no_grad():
        model.mask_embedding.normal_(0, 0.02)  # not all-zero: the mask slots get a real input
    save_checkpoint(model, out, dtype=torch.bfloat16,
                    extra_config={"dspine_training": {"random": True, "seed": args.seed + 1,
                                                      "made_by": MADE_BY}})
    return dcfg


# ---------------------------------------------------------------------------------------------
# Top-2 gap check (transformers, CPU)
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def check_gaps(target_dir: Path, prompts: int, tokens: int, threshold: float) -> dict:
    """Greedy decode `prompts` chat prompts for `tokens` steps with transformers in bf16 on the CPU,
    and summarise the top-2 logit gap (= logprob gap, nats) at every generated position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model, info = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise PairError(f"transformers does not load {target_dir} cleanly: {bad}")
    model.eval()
    gaps, tops, distinct, flip_gaps, diffs = [], [], [], [], []
    for text in (GAP_PROMPTS * (prompts // len(GAP_PROMPTS) + 1))[:prompts]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
            decoded = torch.stack(out.logits, 1)[0].float()                                 # [tokens, V]
            one_pass = model(out.sequences).logits[0, ids.shape[1] - 1:-1].float()          # same positions
        distinct.append(len(set(out.sequences[0, ids.shape[1]:].tolist())))
        top2 = decoded.topk(2, -1).values
        flips = decoded.argmax(-1) != one_pass.argmax(-1)
        flip_gaps += (top2[:, 0] - top2[:, 1])[flips].tolist()
        diffs.append(float((decoded - one_pass).abs().amax()))
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
        tops += top2[:, 0].tolist()
    g, t = torch.tensor(gaps), torch.tensor(tops)
    steps = g / 2.0 ** (torch.floor(torch.log2(t.abs().clamp_min(1e-3))) - 7)  # gap in bf16 steps of the top logit
    q = torch.tensor([0.01, 0.05, 0.1, 0.25, 0.5, 0.9])
    names = ["p1", "p5", "p10", "p25", "p50", "p90"]
    return {"positions": len(gaps), "prompts": prompts, "tokens_per_prompt": tokens,
            "gap_nats_quantiles": dict(zip(names, [round(x, 4) for x in g.quantile(q).tolist()])),
            "gap_bf16_steps_quantiles": dict(zip(names, [round(x, 2) for x in steps.quantile(q).tolist()])),
            "exact_ties": int((g == 0).sum()),
            f"frac_gap_le_{threshold}_nats": round(float((g <= threshold + 1e-9).float().mean()), 4),
            "frac_gap_le_2_bf16_steps": round(float((steps <= 2).float().mean()), 4),
            "top_logit_range": [round(min(tops), 3), round(max(tops), 3)],
            "distinct_tokens_per_answer": distinct,
            "one_pass_vs_decode": {"argmax_flips": len(flip_gaps), f"flips_above_{threshold}_nats":
                                   sum(x > threshold + 1e-9 for x in flip_gaps),
                                   "flip_gaps_nats": [round(x, 3) for x in sorted(flip_gaps)],
                                   "max_logit_diff_per_prompt": [round(x, 2) for x in diffs]}}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

# The pair's shape and initialisation options: flag -> (default, help); each flag's type is its default's.
SHAPE_OPTIONS: dict[str, tuple[int | float, str | None]] = {
    "hidden": (1024, None), "layers": (8, None), "full-attention-interval": (4, "every N-th layer is full attention"),
    "heads": (8, "full-attention query heads"), "kv-heads": (2, None), "head-dim": (128, None),
    "linear-key-heads": (4, None), "linear-key-head-dim": (128, None), "linear-value-heads": (8, None),
    "linear-value-head-dim": (128, None), "conv-kernel": (4, None), "experts": (8, None), "experts-per-token": (2, None),
    "moe-intermediate": (512, "routed and shared expert width"),
    "intermediate": (3072, "the drafter's MLP width (config intermediate_size)"),
    "max-position-embeddings": (8192, None), "rope-theta": (10000000.0, None),
    "init-std": (0.05, "std of every projection and the embedding"),
    "lm-head-std": (0.002, "std of lm_head before the row scales: the logit scale (top logits ~3-27 at the defaults)"),
    "lm-head-row-sigma": (1.0, "lm_head row norms are exp(sigma x N(0,1)) (0: i.i.d. rows, many bf16 near-ties)"),
    "a-min": (0.05, "GDN decay rate A = exp(A_log) ~ U[a_min, a_max]"), "a-max": (2.0, None),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tokenizer_dir", type=Path, help="HF folder with the tokenizer (e.g. SmolLM2-135M-Instruct)")
    p.add_argument("out_dir", type=Path, help="writes OUT_DIR/target and OUT_DIR/drafter (replaced if present)")
    for name, (default, help_text) in SHAPE_OPTIONS.items():
        p.add_argument(f"--{name}", type=type(default), default=default, help=help_text)
    p.add_argument("--distinct-experts", action="store_true",
                   help="independent random routed experts (default: all equal, so routing flips change nothing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None, help="override the tokenizer folder's vocab size")
    p.add_argument("--mask-token-id", type=int, default=16, help="drafter mask token (16 for SmolLM2)")
    p.add_argument("--block", type=int, default=16, help="drafter block = --speculative-num-draft-tokens")
    p.add_argument("--check-gaps", action="store_true",
                   help="after writing, greedy-decode with transformers on the CPU and print top-2 gap stats")
    p.add_argument("--gap-prompts", type=int, default=12)
    p.add_argument("--gap-tokens", type=int, default=64)
    p.add_argument("--gap-threshold", type=float, default=0.25, help="nats (the serving benchmark's --near-tie-nats)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        tok = tokenizer_info(args.tokenizer_dir, args.vocab_size)
        if not 0 <= args.mask_token_id < tok["vocab_size"]:
            raise PairError(f"--mask-token-id {args.mask_token_id} is outside the vocabulary ({tok['vocab_size']})")
        cfg = target_config(args, tok)
    except PairError as e:
        print(f"make_hybrid_sglang_pair: {e}", file=sys.stderr)
        return 2
    target_dir, drafter_dir = args.out_dir / "target", args.out_dir / "drafter"
    shutil.rmtree(target_dir, ignore_errors=True)
    weights = target_weights(cfg, args)
    write_target(target_dir, cfg, weights, args.tokenizer_dir, tok)
    dcfg = write_drafter(drafter_dir, cfg, args)
    n_params = sum(t.numel() for t in weights.values())
    print(f"{target_dir}: Qwen3NextForCausalLM, {n_params / 1e6:.1f} M parameters (bf16), layers "
          f"{''.join('F' if t == 'full_attention' else 'L' for t in cfg['layer_types'])}, vocab {cfg['vocab_size']}, "
          f"{cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} + shared; tokenizer files: "
          f"{', '.join(tok['files'])}")
    print(f"{drafter_dir}: DSpine drafter, block {dcfg.block_size}, target layers {dcfg.target_layer_ids}, "
          f"mask token {dcfg.mask_token_id} ({time.perf_counter() - t0:.1f} s)")
    if args.check_gaps:
        try:
            stats = check_gaps(target_dir, args.gap_prompts, args.gap_tokens, args.gap_threshold)
        except PairError as e:
            print(f"make_hybrid_sglang_pair: {e}", file=sys.stderr)
            return 1
        print(json.dumps({"top2_gap_bf16_cpu": stats}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
