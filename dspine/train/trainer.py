"""Online drafter training: the frozen target runs in the loop, no hidden-state cache on disk.

Each step: a batch of target-regenerated sequences goes through the frozen target (hidden states
at `target_layer_ids`), random anchors are drawn in the answers, the drafter drafts every block in
one pass, and the loss is
  Σ_j w_j · CE(final logits_j)                       final prediction (target lm_head)
+ Σ_j w_j · CE(final logits_j + T(label_{j-1}, ·))    transition scores (DSpine selection only)
+ Σ_l λ_l Σ_j w_j · CE(layer-l transfer scores_j)   layer-wise supervision (injection only)
+ 0.1 · BCE(confidence_j, [selected_j == label_j])    confidence head
with position weights w_j = exp(-(j-1)/γ). bf16 autocast, AdamW, warm-up + cosine schedule,
gradient clipping. `state.pt` in the run directory holds everything needed to resume; a time
limit stops a run cleanly so it continues in the next command.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from dspine.model.checkpoint import save_checkpoint
from dspine.model.config import DSpineConfig
from dspine.model.drafter import DSpineDrafter
from dspine.train.blocks import BlockBatch, make_block_batch
from dspine.model.transition import select_tokens


@dataclass
class TrainConfig:
    """A training run. `drafter` holds DSpineConfig overrides (shapes come from the target)."""

    data: str
    run_dir: str
    target: str | None = None
    drafter: dict = field(default_factory=dict)
    seed: int = 0
    steps: int = 1000
    batch_size: int = 32
    blocks_per_seq: int = 16
    max_len: int = 1024
    lr: float = 6e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    position_decay: float = 7.0
    confidence_weight: float = 0.1
    heldout_sequences: int = 64
    eval_every: int = 100
    save_every: int = 200
    log_every: int = 10
    export_shard_bytes: int = 15 << 20

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides) -> "TrainConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{path}: unknown training config keys {unknown}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


def load_records(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if len(r["ids"]) - r["answer_start"] >= 2]


def target_hidden(target, input_ids, valid, layer_ids) -> torch.Tensor:
    """Frozen target forward -> [bs, L, K·H] hidden states at layer_ids (HF "output of layer i")."""
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=valid.long(), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def block_losses(model: DSpineDrafter, target, batch: BlockBatch, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """All loss terms of one batch (scalars); `total` is what is optimised."""
    dc = model.config
    hidden = target_hidden(target, batch.input_ids, batch.valid, dc.target_layer_ids)
    bs, length = batch.input_ids.shape
    features = model.project_context(hidden)
    kv = model.context_key_values(features, torch.arange(length, device=hidden.device)[None].expand(bs, -1))
    out = model(batch.anchor_ids, batch.block_positions, kv, batch.mask, need_layer_scores=True)
    labels = batch.labels                                                                  # [n, B-1]
    n, slots = labels.shape
    weights = torch.exp(-torch.arange(slots, device=labels.device) / cfg.position_decay)
    valid = labels >= 0
    w = (weights[None] * valid).float()
    norm = w.sum().clamp(min=1)

    def weighted_ce(logits: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1),
                             reduction="none").view(n, slots)
        return (ce * w).sum() / norm

    logits = model.logits(out.hidden[:, 1:])                                                # [n, B-1, V]
    terms = {"final": weighted_ce(logits)}
    select_logits = logits
    if model.transition is not None:
        prev = torch.cat([batch.anchor_ids.reshape(-1, 1), labels[:, :-1].clamp(min=0)], dim=1)   # [n, B-1]
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


@torch.no_grad()
def heldout_tau(model: DSpineDrafter, target, records: list[dict], cfg: TrainConfig, device) -> float:
    """Teacher-forced acceptance estimate: per block, 1 + the number of leading slots whose selected
    token equals the target's answer token (greedy answers, so equal to the target's argmax). Slots
    past the end of the sequence end the count (they are not free acceptances)."""
    model.eval()
    dc = model.config
    gen = torch.Generator().manual_seed(1234)
    total, blocks = 0.0, 0
    for start in range(0, len(records), cfg.batch_size):
        batch = make_block_batch(records[start:start + cfg.batch_size], block_size=dc.block_size,
                                 blocks_per_seq=cfg.blocks_per_seq, window=dc.sliding_window, max_len=cfg.max_len,
                                 generator=gen).to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                            enabled=torch.device(device).type == "cuda"):
            hidden = target_hidden(target, batch.input_ids, batch.valid, dc.target_layer_ids)
            bs, length = batch.input_ids.shape
            kv = model.context_key_values(model.project_context(hidden),
                                          torch.arange(length, device=device)[None].expand(bs, -1))
            out = model(batch.anchor_ids, batch.block_positions, kv, batch.mask)
            logits = model.logits(out.hidden[:, 1:]).float()
        n = logits.shape[0]
        sel = select_tokens(logits, batch.anchor_ids.reshape(-1), torch.zeros(n, device=device), mode=dc.selection,
                            top_k=dc.selection_top_k, lam=dc.transition_lambda, scorer=model.transition,
                            table=model.transfer_table())
        ok = sel.tokens == batch.labels
        total += float((ok.long().cumprod(-1).sum(-1) + 1).sum())
        blocks += n
    model.train()
    return total / max(blocks, 1)


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def build_training(cfg: TrainConfig, device: str) -> tuple[torch.nn.Module, DSpineDrafter, torch.optim.Optimizer]:
    """`(frozen target, drafter in train mode attached to it, AdamW)` for `cfg` on `device`
    (bf16 target on CUDA, fp32 elsewhere)."""
    from dspine.engine.targets import load_target, mask_token_candidate

    target, tokenizer = load_target(cfg.target, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32,
                                    device=device)
    dcfg = DSpineConfig.for_target(target.config, mask_token_id=mask_token_candidate(tokenizer), **cfg.drafter)
    model = DSpineDrafter(dcfg).to(device)
    model.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    return target, model, opt


def train_step(model: DSpineDrafter, target, batch: BlockBatch, opt: torch.optim.Optimizer, cfg: TrainConfig,
               *, use_amp: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One optimisation step (bf16 autocast when `use_amp`, gradient clipping): `(terms, grad_norm)`."""
    with torch.autocast(device_type="cuda" if use_amp else "cpu", dtype=torch.bfloat16, enabled=use_amp):
        terms = block_losses(model, target, batch, cfg)
    opt.zero_grad(set_to_none=True)
    terms["total"].backward()
    grad_norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
    opt.step()
    return terms, grad_norm


def train(cfg: TrainConfig, *, device: str, time_limit_s: float | None = None, progress: bool = True) -> Path | None:
    """Run (or resume) training. Returns the exported checkpoint dir when `cfg.steps` is reached,
    None when the time limit stopped it first (run again to resume)."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    torch.manual_seed(cfg.seed)
    target, model, opt = build_training(cfg, device)
    dcfg = model.config
    records = load_records(cfg.data)
    random.Random(cfg.seed).shuffle(records)
    heldout, records = records[: cfg.heldout_sequences], records[cfg.heldout_sequences:]
    step, log = 0, []
    state_file = run_dir / "state.pt"
    if state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]
        print(f"dspine train: resumed {run_dir} at step {step}")
    gen = torch.Generator().manual_seed(cfg.seed + step)
    order = random.Random(cfg.seed + step)
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {run_dir.name}", unit="step", disable=not progress)
    tokens_seen, t_last = 0, time.perf_counter()
    use_amp = device.startswith("cuda")

    def save_state() -> None:
        tmp = run_dir / "state.pt.partial"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "log": log}, tmp)
        os.replace(tmp, state_file)
        (run_dir / "log.json").write_text(json.dumps(log, indent=1))

    while step < cfg.steps:
        if time_limit_s is not None and time.perf_counter() - started > time_limit_s:
            save_state()
            bar.close()
            print(f"dspine train: time limit reached at step {step}; state saved, run again to resume")
            return None
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        batch = make_block_batch(order.sample(records, cfg.batch_size), block_size=dcfg.block_size,
                                 blocks_per_seq=cfg.blocks_per_seq, window=dcfg.sliding_window, max_len=cfg.max_len,
                                 generator=gen)
        tokens_seen += int((batch.labels >= 0).sum())  # on the host copy: no device sync in the loop
        terms, grad_norm = train_step(model, target, batch.to(device), opt, cfg, use_amp=use_amp)
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            now = time.perf_counter()
            entry = {"step": step, "lr": _lr(step - 1, cfg), "grad_norm": float(grad_norm),
                     "label_tokens_per_s": tokens_seen / (now - t_last),
                     "step_seconds": (now - t_last) / cfg.log_every,
                     **{k: float(v.detach()) for k, v in terms.items()}}
            tokens_seen, t_last = 0, now
            if step % cfg.eval_every == 0 or step == cfg.steps:
                entry["heldout_tau"] = heldout_tau(model, target, heldout, cfg, device)
            log.append(entry)
            bar.set_postfix(loss=f"{entry['total']:.3f}", acc1=f"{entry['acc1']:.2f}",
                            tau=f"{entry.get('heldout_tau', float('nan')):.2f}")
        if step % cfg.save_every == 0:
            save_state()
    bar.close()
    save_state()
    model.eval()
    export = run_dir / "checkpoint"
    save_checkpoint(model, export, dtype=torch.bfloat16, max_shard_bytes=cfg.export_shard_bytes,
                    extra_config={"dspine_training": {"data": str(cfg.data), "steps": cfg.steps,
                                                      "batch_size": cfg.batch_size,
                                                      "blocks_per_seq": cfg.blocks_per_seq, "seed": cfg.seed}})
    print(f"dspine train: exported {export}")
    return export
