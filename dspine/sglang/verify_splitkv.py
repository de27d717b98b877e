"""Split-KV verify attention for the target on CUDA (`DSPINE_VERIFY_SPLITKV=1`).

SGLang's triton backend runs a TARGET_VERIFY forward (16 query tokens per request) through its
prefill kernel `extend_attention_fwd`, whose programs are (request, head, query block): each walks
its request's whole prefix alone, so at one request a 3k-token context is ~9 programs on a
132-SM GPU, each looping ~50 key blocks. SGLang (0.5.17 to 0.5.23) also ships a split-KV verify
kernel (`sglang.kernels.ops.attention.verify_splitkv`: the prefix split across programs
flash-decode style, an LSE merge, then the causal draft block), but `TritonAttnBackend.__init__`
turns it on (`use_verify_splitkv`) only on AMD gfx95. On an H200 it does not pay at the shapes
measured (its merge stage costs more than the prefill kernel's whole layer at SmolLM2 shapes; 3 %
off the verify at Qwen3-8B shapes with 2,000-token prompts), so it is opt-in.

`install_from_environment()` (the plugin calls it) registers an AFTER hook on that `__init__`
through SGLang's `HookRegistry`; `enable_split_kv_verify` then sets `use_verify_splitkv` on every
triton backend of a DSPINE server whose speculative top-k is 1 (a DFlash-style chain, the only
case the kernel is exact for). The hook runs before SGLang captures the target's verify graphs, so
the graphs record the split-KV path. Per call, the kernel's own `can_handle` keeps every case it
cannot serve exactly on `extend_attention_fwd`: the drafter's non-causal layers, sliding windows,
ragged verify widths, logit caps, sinks.

One fix rides along. The kernel's first stage leaves a split with no keys (a prefix shorter than
`N_SPLITS` x 32 tokens has some) unwritten in its partial-output scratch, marked only by a -inf LSE,
and the second stage weights that partial by exp(-inf) = 0. The scratch comes from `torch.empty`,
and 0 x NaN is NaN: uninitialised memory holding a NaN pattern would poison that request's
attention output. A second AFTER hook, on `VerifySplitKV._alloc`, zeroes the scratch once when it is
allocated (`zero_split_partials`). After that an unwritten split holds 0 or a finite partial from an
earlier call, and either weighs 0.
"""

from __future__ import annotations

import logging

from dspine import env
from dspine.serve.flags import ALGORITHM

logger = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"
SCRATCH_HOOK_TARGET = "sglang.kernels.ops.attention.verify_splitkv.VerifySplitKV._alloc"
_logged = False


def enable_split_kv_verify(result, backend, model_runner, *args, **kwargs):
    """AFTER hook on `TritonAttnBackend.__init__(self, model_runner, ...)`: turn the split-KV verify
    path on for a DSPINE server at speculative top-k 1 (returns None: the constructor's result is
    kept)."""
    global _logged
    server_args = getattr(model_runner, "server_args", None)
    algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
    if algorithm != ALGORITHM or getattr(backend, "topk", None) != 1 \
            or not callable(getattr(backend, "verify_splitkv_fwd", None)):
        return None
    backend.use_verify_splitkv = True
    if not _logged:
        logger.info("DSPINE: the target's verify attention runs through SGLang's split-KV verify kernel "
                    "(%s=1).", env.DSPINE_VERIFY_SPLITKV.name)
        _logged = True
    return None


def zero_split_partials(result, kernel, *args, **kwargs):
    """AFTER hook on `VerifySplitKV._alloc(self, max_bs)`: the fresh partial-output scratch
    `att_out` [max_bs, H_q, N_SPLITS, L_pad, Dv] fp32 zeroed (see the module docstring)."""
    kernel.att_out.zero_()
    return None


def install_from_environment(environ=None) -> bool:
    """Register the hook when `DSPINE_VERIFY_SPLITKV=1` (False otherwise). SGLang's `load_plugins`
    applies registered hooks right after the plugins' `register()`."""
    if not env.DSPINE_VERIFY_SPLITKV.get(environ):
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in ((HOOK_TARGET, enable_split_kv_verify), (SCRATCH_HOOK_TARGET, zero_split_partials)):
        if not any(registered is hook for _, registered, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, HookType.AFTER)
    return True
