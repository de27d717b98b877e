"""Kernels SGLang builds on first use, built while the DSPINE worker starts instead.

flashinfer compiles its sampling module (nvcc through ninja) the first time any of its sampling
functions runs. Without a warm JIT cache that took 110 s on the H200 host, and in a DSPINE server
the first request with a top-p or top-k filter hit it inside a decode step: SGLang's DFlash verify
renormalises the target's probabilities through `sgl_kernel.top_p_renorm_prob` → flashinfer, so
every request in flight waited and `/health` timed out. `warm_sampling_kernels` calls each such
function once on a dummy distribution at start-up, where the compile belongs.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def sampling_warmups(vocab_size: int, device) -> list[tuple[str, Callable[[], object]]]:
    """(name, call) for every sampling function SGLang's sampled verify and sampler may reach here:
    the renormalisations DFlash's verify imports, and flashinfer's samplers SGLang's `Sampler`
    imports (its flashinfer backend). Functions this SGLang build lacks (None) are left out."""
    from sglang.srt.layers import sampler
    from sglang.srt.speculative import dflash_utils

    probs = torch.full((2, int(vocab_size)), 1.0 / vocab_size, dtype=torch.float32, device=device)
    top_k = torch.tensor([1, int(vocab_size)], dtype=torch.int32, device=device)
    top_p = torch.tensor([0.5, 1.0], dtype=torch.float32, device=device)
    min_p = torch.tensor([0.1, 0.0], dtype=torch.float32, device=device)
    calls = {
        "top_k_renorm_prob": (getattr(dflash_utils, "top_k_renorm_prob", None), (probs, top_k), {}),
        "top_p_renorm_prob": (getattr(dflash_utils, "top_p_renorm_prob", None), (probs, top_p), {}),
        "top_k_top_p_sampling_from_probs": (getattr(sampler, "top_k_top_p_sampling_from_probs", None),
                                            (probs, top_k, top_p), {"filter_apply_order": "joint"}),
        "min_p_sampling_from_probs": (getattr(sampler, "min_p_sampling_from_probs", None), (probs, min_p), {}),
    }
    return [(name, lambda fn=fn, a=args, k=kwargs: fn(*a, **k)) for name, (fn, args, kwargs) in calls.items()
            if fn is not None]


def warm_sampling_kernels(vocab_size: int, device) -> float:
    """Run every `sampling_warmups` call once (a failure is logged, not raised: the server works,
    only its first such request pays the build); returns the seconds spent."""
    started = time.perf_counter()
    for name, call in sampling_warmups(vocab_size, device):
        try:
            call()
        except Exception as exc:
            logger.warning("DSPINE: warming SGLang's %s failed (%s: %s); the first request that needs it will "
                           "build it.", name, type(exc).__name__, exc)
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started
