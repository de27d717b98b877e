"""Model FLOPs of a training micro-batch and model-FLOPs utilisation.

`batch_flops` counts the model FLOPs of one micro-batch (multiply-add = 2 FLOPs):
* the target forward over the layers the drafter reads (0..max(target_layer_ids)) for every
  position of the padded batch: projections, MLP and causal attention (half the keys on average);
* the drafter forward and backward (backward = 2 × forward): context projection and keys/values
  of every position, the draft layers on the nb·B block slots (attention over the L context keys
  plus the nb·B slot keys, as the masked attention computes them), the injections with the first
  layer's vocabulary scan (every layer's with `injection_candidates = "per_layer"`), the transfer
  table U = E_out·P twice (the drafter's and the loss's);
* the vocabulary losses on the n·(B-1) label rows: final CE (forward and the hidden-state
  gradient; E_out is frozen), transition CE, the layer-wise CE (forward, both gradients).
`mfu` divides FLOPs per second by the device's peak dense bf16 rate (`PEAK_BF16_FLOPS`, matched
on `torch.cuda.get_device_name`); None on a CPU or an unknown device.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (vendor datasheets, SXM parts), matched as substrings of the device name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device) -> float | None:
    """The peak dense bf16 FLOP/s of CUDA `device` from `PEAK_BF16_FLOPS`; None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0]))
                 if key in name), None)


def mfu(flops: float, seconds: float, device, world: int = 1) -> float | None:
    """Model FLOPs utilisation of `world` devices like `device` that did `flops` in `seconds`."""
    peak = peak_flops(device)
    return None if peak is None or seconds <= 0 else flops / (seconds * peak * world)


def _layer_flops(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Per position, one decoder layer's projections and MLP (attention scores excluded)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return 2 * hidden * (2 * q + 2 * kv) + 6 * hidden * intermediate


def batch_flops(target_config, dc, bs: int, length: int, nb: int) -> float:
    """Model FLOPs of one micro-batch: bs sequences padded to `length`, nb blocks each (module
    docstring); `dc` is the drafter's DSpineConfig."""
    tc = target_config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    tokens, layers_run = bs * length, max(dc.target_layer_ids) + 1
    target = layers_run * tokens * (_layer_flops(tc.hidden_size, tc.num_attention_heads, kv_heads, head_dim,
                                                 tc.intermediate_size)
                                     + 2 * length * tc.num_attention_heads * head_dim)
    h, r, v, block = dc.hidden_size, dc.transfer_rank, dc.vocab_size, dc.block_size
    slots, rows = bs * nb * block, bs * nb * (block - 1)
    q, kv = dc.num_attention_heads * dc.head_dim, dc.num_key_value_heads * dc.head_dim
    draft = tokens * 2 * h * (dc.num_context_features * h + dc.num_hidden_layers * 2 * kv)
    draft += slots * dc.num_hidden_layers * (_layer_flops(h, dc.num_attention_heads, dc.num_key_value_heads,
                                                          dc.head_dim, dc.intermediate_size)
                                             + 4 * (length + nb * block) * q)
    if dc.injection:
        scans = dc.num_hidden_layers if dc.injection_candidates == "per_layer" else 1
        draft += slots * (dc.num_hidden_layers * 2 * (h * r + (h + r) * h + r * h) + scans * 2 * r * v)
    uses_table = dc.injection or dc.selection == "transition"
    draft += 2 * (2 * v * h * r) if uses_table else 0
    losses = rows * 4 * v * h
    if dc.selection == "transition":
        losses += rows * 6 * v * r
    if dc.injection:
        losses += rows * dc.num_hidden_layers * 6 * v * r
    return float(target + 3 * draft + losses)
