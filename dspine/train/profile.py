"""Where a training step's time goes: `dspine train --profile-steps N`.

`profile_training` builds the same target, drafter and batches as `dspine train` (nothing is
saved, the run directory is not touched), runs a few warm-up steps, then N steps under
`torch.profiler`, and returns the operator table sorted by device time (CPU time where there is
no GPU) plus the mean step time: `train_step` = one `dspine.train.trainer.train_step`.
"""

from __future__ import annotations

import random
import time

import torch


def profile_training(cfg, *, device: str, steps: int = 10, warmup: int = 3, rows: int = 30) -> str:
    """The profiler's table for `steps` training steps of `cfg` (after `warmup`), as text."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from dspine.train.blocks import make_block_batch
    from dspine.train.trainer import build_training, load_records, make_objective, train_step

    torch.manual_seed(cfg.seed)
    target, model, opt = build_training(cfg, device)
    objective = make_objective(model, cfg)
    records = load_records(cfg.data)
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    dc = model.config
    use_amp = device.startswith("cuda")

    def batches():
        return [make_block_batch(rng.sample(records, min(cfg.batch_size, len(records))), block_size=dc.block_size,
                                 blocks_per_seq=cfg.blocks_per_seq, window=dc.sliding_window, max_len=cfg.max_len,
                                 generator=gen).to(device) for _ in range(cfg.grad_accum_steps)]

    def sync():
        if use_amp:
            torch.cuda.synchronize()

    for _ in range(warmup):
        train_step(objective, target, batches(), opt, cfg, use_amp=use_amp)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_amp else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("train_step"):
                train_step(objective, target, batches(), opt, cfg, use_amp=use_amp)
        sync()
    step_s = (time.perf_counter() - started) / steps
    key = "self_cuda_time_total" if use_amp else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    return (f"dspine train --profile-steps {steps}: {step_s * 1e3:.1f} ms per step (profiled, batch "
            f"{cfg.batch_size} x {cfg.blocks_per_seq} blocks x {cfg.grad_accum_steps} micro-batches, "
            f"device {device})\n{table}")
