"""Qwen3/Llama-style building blocks of the draft decoder layers.

A draft layer's queries are the block positions; its keys/values are the (windowed) target
context followed by the block itself. Context keys/values come from the projected target hidden
states through the same `k_proj`/`v_proj` (DFlash's `kv_proj_only` path), so they can be cached
once per verified token.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspine.model.config import DSpineConfig


class RMSNorm(nn.Module):
    """x [..., dim] -> x / rms(x) · weight, in x's dtype. One fused kernel on CUDA (forward and
    backward): the weight takes x's dtype, since under autocast a bf16 input with a float32 weight
    would fall back to the unfused chain (about 12 % of a training step at SmolLM2's shape)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotate-half RoPE's (cos, sin) for `positions` [bs, T]: each [bs, 1, T, head_dim], float32.
    Every layer rotates the same positions, so a forward computes them once and shares them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [bs, T, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]       # [bs, 1, T, d]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """x [bs, heads, T, d] rotated by `rope_tables` (cast to x's dtype, as the rotation is applied)."""
    cos, sin = (t.to(x.dtype) for t in rope)
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, block_mask) -> Tensor:
    """FlexAttention under a `BlockMask`: q [bs, heads, Q, d], k/v [bs, kv_heads, K, d] -> [bs, heads, Q, d].
    Compiled on CUDA (only the tiles the mask lists). Elsewhere FlexAttention's unfused reference,
    or, where gradients are wanted (it has no CPU backward), the mask materialised through SDPA."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


class DraftAttention(nn.Module):
    """GQA attention with per-head q/k RMSNorm (Qwen3). Queries: block; keys: context + block."""

    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """`rope_tables` of `positions` [bs, T] at this attention's head size and theta."""
        return rope_tables(positions, self.head_dim, self.rope_theta)

    def key_values(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """x: [bs, T, H], rope: `self.rope(positions)` -> (k, v) each [bs, kv_heads, T, head_dim], k rotated."""
        bs, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bs, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bs, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, rope), v

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx_k: Tensor, ctx_v: Tensor, mask) -> Tensor:
        """x: [bs, Q, H] block queries (already normed); rope: `self.rope` of their positions [bs, Q];
        ctx_k/ctx_v: [bs, kv_heads, Lc, d];
        mask: [bs, Q, Lc + Q] bool, True where a query may attend, or the same as a FlexAttention
        `BlockMask` (training's `flex_attention`). Returns [bs, Q, H]."""
        bs, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bs, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, rope)
        k_blk, v_blk = self.key_values(x, rope)
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=2)
        if not isinstance(mask, Tensor):
            out = block_sparse_attention(q, k, v, mask)
            return self.o_proj(out.transpose(1, 2).reshape(bs, q_len, -1))
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(bs, q_len, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, residual around each."""

    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx_k: Tensor, ctx_v: Tensor, mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
