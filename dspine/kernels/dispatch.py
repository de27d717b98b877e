"""Kernel-vs-reference choice: Triton on CUDA tensors, PyTorch elsewhere.

`DSPINE_KERNELS=auto` (default) | `triton` | `torch` (declared in `dspine.env`); `forced(mode)`
overrides it within a block (the kernel benchmark compares both paths in one process). Forcing
`triton` on CPU tensors only works under `TRITON_INTERPRET=1` (the CPU test mode). Under autocast
the references run in every mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from dspine import env

MODES = ("auto", "triton", "torch")
_forced_mode: ContextVar[str | None] = ContextVar("dspine_forced_kernel_mode", default=None)


def kernel_mode() -> str:
    """The mode in force: `forced`'s, else DSPINE_KERNELS's (env.EnvError when that is not a mode)."""
    return _forced_mode.get() or env.DSPINE_KERNELS.get()


@contextlib.contextmanager
def forced(mode: str) -> Iterator[None]:
    """Within the block, `use_triton` decides as under DSPINE_KERNELS=mode; the previous mode after it."""
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}: use one of {', '.join(MODES)}")
    token = _forced_mode.set(mode)
    try:
        yield
    finally:
        _forced_mode.reset(token)


def use_triton(t: torch.Tensor, casts_inputs: bool = False) -> bool:
    """True when the fused Triton kernel should run on tensors living where `t` lives. Under
    autocast (the trainer's steps and held-out evaluation) never, in any mode, unless the caller
    `casts_inputs` to autocast's dtype itself: the fused kernels take one dtype for activations and
    weights, while the PyTorch references follow autocast's casts."""
    mode = kernel_mode()
    if mode == "torch" or (torch.is_autocast_enabled(t.device.type) and not casts_inputs):
        return False
    return mode == "triton" or t.is_cuda
