"""Kernel-vs-reference choice: Triton on CUDA tensors, PyTorch elsewhere.

`DSPINE_KERNELS=auto` (default) | `triton` | `torch`. Forcing `triton` on CPU tensors only works
under `TRITON_INTERPRET=1` (the CPU test mode). Under autocast the references run in every mode.
"""

from __future__ import annotations

import os

import torch

MODES = ("auto", "triton", "torch")


def kernel_mode() -> str:
    mode = os.environ.get("DSPINE_KERNELS", "auto").lower()
    if mode not in MODES:
        raise ValueError(f"DSPINE_KERNELS={mode!r}: use one of {MODES}")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    """True when the fused Triton kernel should run on tensors living where `t` lives. Never under
    autocast (e.g. the trainer's held-out evaluation), in any mode: the fused kernels take one dtype
    for activations and weights, while the PyTorch references follow autocast's casts."""
    mode = kernel_mode()
    if mode == "torch" or torch.is_autocast_enabled(t.device.type):
        return False
    return mode == "triton" or t.is_cuda
