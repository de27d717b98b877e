"""Split-KV block attention for a DSPINE server's verify and draft forwards (on unless `DSPINE_VERIFY_SPLITKV=0`).

SGLang's triton backend runs every TARGET_VERIFY forward (the target's verify and, in the DFlash
family, the drafter's block) through its prefill kernel `extend_attention_fwd`, whose programs are
(request, query head, query block): each walks its request's whole prefix alone, so at one request
the target's verify is Hq programs on a 132-SM GPU (SmolLM2 on an H200: 13-17 us a layer; the
draft's layers longer). `TritonAttnBackend.forward_extend` has one seam before that call: when the
backend's `use_verify_splitkv` is set, it first calls `self.verify_splitkv_fwd(...)` with the
prefill kernel's arguments, and uses the result when that returns True. SGLang sets it only on AMD
gfx95, with its own kernel, which on an H200 is slower than the prefill kernel (its merge stage
alone ~23 us a layer, `benchmarks/results/round_cost_h200.json`). DSpine's kernel, on an H200:
1.4-58x faster than the prefill kernel per call over SmolLM2 / Qwen3-8B / Qwen3.8-27B heads, batches
1-32 and 512-32k-token prefixes (`verify_attention_h200.json`); a Qwen3-8B-shaped verify at one
request and a 1.7k-token prompt 9.3 -> 5.4 ms, the whole round 12.0 -> 7.6 ms (`round_cost_h200.json`).

`install_from_environment()` (the plugin calls it) registers an AFTER hook on
`TritonAttnBackend.__init__` through SGLang's `HookRegistry`: on every triton backend of a DSPINE
server at speculative top-k 1 (a chain, both runners) it sets `use_verify_splitkv` and points
`verify_splitkv_fwd` at `verify_attention_fwd`, which runs `dspine.kernels.verify_attention`
(the prefix split across programs, all query heads of a KV head and all block tokens in one tile,
then an LSE merge) for the cases that kernel computes exactly as the prefill kernel defines them,
and returns False for every other (custom masks, sliding windows, logit caps, sinks, scaled or
other-dtype KV caches, ragged blocks), which SGLang then runs on its prefill kernel. The hook runs
before SGLang captures its graphs, so the captured forwards record this path.
"""

from __future__ import annotations

import logging

import torch

from dspine import env
from dspine.serve.flags import ALGORITHM

logger = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"
_logged = False


@torch.compiler.disable   # as SGLang wraps its own kernel here: dynamo never traces into the launches
def verify_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                         kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                         sm_scale=None, logit_cap=0.0, sliding_window_size=-1, sinks=None, window_kv_offsets=None,
                         xai_temperature_len=-1, max_bs=None, **_) -> bool:
    """`extend_attention_fwd`'s arguments (SGLang's `verify_splitkv_fwd` seam) -> True when it wrote
    o_extend [bs*N, Hq, D] with `verify_attention`, False (nothing written) for a case it leaves to
    the prefill kernel. Only host-side shapes and Python values are read: no device sync."""
    del mask_indptr, max_bs
    if custom_mask is not None or sinks is not None or window_kv_offsets is not None:
        return False
    if (sliding_window_size or -1) > 0 or (logit_cap or 0) > 0 or (xai_temperature_len or -1) > 0:
        return False
    if float(k_scale) != 1.0 or float(v_scale) != 1.0 or k_buffer.dtype != q_extend.dtype:
        return False
    bs, block = qo_indptr.shape[0] - 1, int(max_len_extend)
    tokens, hq, d = q_extend.shape
    hkv = k_extend.shape[1]
    if bs < 1 or block < 1 or tokens != bs * block or hq % hkv or d & (d - 1) or not 16 <= d <= 256:
        return False
    if v_extend.shape[-1] != d or k_buffer.shape[1:] != (hkv, d) or v_buffer.shape[1:] != (hkv, d):
        return False
    from dspine.kernels.verify_attention import verify_attention

    verify_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, kv_indptr, kv_indices, block=block,
                     causal=bool(is_causal), scale=float(sm_scale) if sm_scale is not None else d ** -0.5)
    return True


def enable_split_kv_verify(result, backend, model_runner, *args, **kwargs):
    """AFTER hook on `TritonAttnBackend.__init__(self, model_runner, ...)`: route a DSPINE chain
    server's TARGET_VERIFY attention to `verify_attention_fwd` (returns None: the constructor's
    result is kept)."""
    global _logged
    server_args = getattr(model_runner, "server_args", None)
    algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
    if algorithm != ALGORITHM or getattr(backend, "topk", None) != 1 or not hasattr(backend, "use_verify_splitkv"):
        return None
    backend.use_verify_splitkv = True
    backend.verify_splitkv_fwd = verify_attention_fwd
    if not _logged:
        logger.info("DSPINE: verify and draft attention run through DSpine's split-KV block kernel (%s=0 "
                    "turns it off).", env.DSPINE_VERIFY_SPLITKV.name)
        _logged = True
    return None


def install_from_environment(environ=None) -> bool:
    """Register the hook unless `DSPINE_VERIFY_SPLITKV=0` (then False). SGLang's `load_plugins`
    applies registered hooks right after the plugins' `register()`."""
    if not env.DSPINE_VERIFY_SPLITKV.get(environ):
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(registered is enable_split_kv_verify for _, registered, _ in HookRegistry._hooks.get(HOOK_TARGET, [])):
        HookRegistry.register(HOOK_TARGET, enable_split_kv_verify, HookType.AFTER)
    return True
