"""`dspine train --profile-steps N`: where a training step's time goes, before a long run.

Builds the same target, drafter and batches as `dspine train` (nothing is saved, the run directory
is not touched), runs a few warm-up steps, then N steps under `torch.profiler`, and returns the
operator table sorted by device time (CPU time where there is no GPU) plus the mean step time:
`train_step` = one `dspine.train.trainer.train_step`, the wall time the optimiser loop pays.
"""

from __future__ import annotations

import random
import time

import torch

from dspine.train.blocks import make_block_batch
from dspine.train.trainer import TrainConfig, build_training, load_records, train_step


def profile_training(cfg: TrainConfig, *, device: str, steps: int = 10, warmup: int = 3, rows: int = 30) -> str:
    """The profiler's table for `steps` training steps of `cfg` (after `warmup`), as text."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(cfg.seed)
    target, model, opt = build_training(cfg, device)
    records = load_records(cfg.data)
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    dc = model.config
    use_amp = device.startswith("cuda")

    def batch():
        return make_block_batch(rng.sample(records, min(cfg.batch_size, len(records))), block_size=dc.block_size,
                                blocks_per_seq=cfg.blocks_per_seq, window=dc.sliding_window, max_len=cfg.max_len,
                                generator=gen).to(device)

    def sync():
        if use_amp:
            torch.cuda.synchronize()

    for _ in range(warmup):
        train_step(model, target, batch(), opt, cfg, use_amp=use_amp)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_amp else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("train_step"):
                train_step(model, target, batch(), opt, cfg, use_amp=use_amp)
        sync()
    step_s = (time.perf_counter() - started) / steps
    key = "self_cuda_time_total" if use_amp else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    return (f"dspine train --profile-steps {steps}: {step_s * 1e3:.1f} ms per step (profiled, batch "
            f"{cfg.batch_size} x {cfg.blocks_per_seq} blocks, device {device})\n{table}")
