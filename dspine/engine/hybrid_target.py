"""`HybridTargetRunner`: a transformers Qwen3-Next hybrid (Gated DeltaNet + attention) as verifier.

Drives the model's own submodules layer by layer (embedding, per layer: norm, token mixer,
residual, norm, MLP/MoE, residual; final norm, lm_head) and replaces only the stateful parts:

- GDN layers: `verify` computes the fed tokens' outputs from the pre-round checkpoint with a
  running state only and records their (k, v, g, beta, conv inputs) in a `ReplaySSMState`;
  `commit` replays the kept tokens into the checkpoint and rolls the conv window.
- Attention layers: a per-row KV cache in slots [bs, Hkv, S, D]; row b's token at position p sits
  in slot p. `verify` writes slots lengths[b]..lengths[b]+q-1 and masks every slot beyond the query's
  own position, so rejected tokens' slots are invisible and overwritten later: commit is a length
  move.

Implements `dspine.engine.target_runner.TargetRunner`. Numerics follow
transformers' token-by-token decode path (`torch_recurrent_gated_delta_rule`, eager attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.activations import ACT2FN
from transformers.models.qwen3_next.modeling_qwen3_next import (
    apply_rotary_pos_emb,
    eager_attention_forward,
    l2norm,
)

from dspine.kernels.dispatch import use_triton
from dspine.kernels.gated_delta_replay import gated_delta_verify_outputs, gated_delta_verify_outputs_reference
from dspine.engine.replay_ssm import ReplaySSMState
from dspine.engine.target_runner import TargetStep


class HybridTargetRunner:
    def __init__(self, model, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.device = next(model.parameters()).device
        types = model.config.layer_types
        self._slot = {i: j for j, i in enumerate(i for i, t in enumerate(types) if t == "linear_attention")}
        self.lengths: Tensor | None = None  # [bs] committed tokens
        self.ssm: ReplaySSMState | None = None
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}  # attention layer -> (k, v) [bs, Hkv, S, D]

    @property
    def batch_size(self) -> int:
        return 0 if self.lengths is None else int(self.lengths.shape[0])

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> TargetStep:
        """Right-padded prompts -> logits/hidden [bs, Lmax, ...]; commits each full prompt."""
        bs, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(bs, width, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, device=self.device)
        la = next(layer.linear_attn for layer in self.model.model.layers if hasattr(layer, "linear_attn"))
        self.ssm = ReplaySSMState(
            len(self._slot), bs, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_dim, la.conv_kernel_size,
            device=self.device,
        )
        self.kv = {}
        self.lengths = torch.zeros(bs, dtype=torch.long, device=self.device)
        step = self.verify(ids)
        self.commit(torch.tensor([len(p) for p in prompts], device=self.device))
        return step

    @torch.no_grad()
    def verify(self, tokens: Tensor) -> TargetStep:
        """tokens [bs, q] fed after each row's committed prefix; nothing is committed yet."""
        inner = self.model.model
        positions = self.lengths[:, None] + torch.arange(tokens.shape[1], device=self.device)  # [bs, q]
        self.ssm.begin(tokens.shape[1])
        h = inner.embed_tokens(tokens)
        cos_sin = inner.rotary_emb(h, positions)
        outputs = []
        for i, layer in enumerate(inner.layers):
            x = layer.input_layernorm(h)
            if i in self._slot:
                h = h + self._gdn(self._slot[i], layer.linear_attn, x)
            else:
                h = h + self._attention(i, layer.self_attn, x, cos_sin, positions)
            mlp = layer.mlp(layer.post_attention_layernorm(h))
            h = h + (mlp[0] if isinstance(mlp, tuple) else mlp)
            outputs.append(h)
        h = inner.norm(h)
        outputs[-1] = h  # HF's last hidden state is the normed one
        hidden = torch.cat([outputs[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        return TargetStep(logits=self.model.lm_head(h).float(), hidden=hidden)

    def commit(self, keep: Tensor) -> None:
        """keep [bs] in 1..q: keep the first keep[b] tokens fed by the last verify."""
        self.ssm.commit(keep)
        self.lengths = self.lengths + keep.to(self.device)

    def select(self, rows: Tensor) -> None:
        """Keep only these batch rows."""
        self.ssm.select(rows)
        self.kv = {i: (k[rows], v[rows]) for i, (k, v) in self.kv.items()}
        self.lengths = self.lengths[rows]

    def _gdn(self, slot: int, la, x: Tensor) -> Tensor:
        """One Gated DeltaNet mixer over the fed tokens. x: [bs, q, H] -> [bs, q, H]."""
        bs, q, _ = x.shape
        ql, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
        conv_in = torch.cat([t.reshape(bs, q, -1) for t in (ql, k, v)], dim=-1).transpose(1, 2)  # [bs, C, q]
        window = torch.cat([self.ssm.conv[slot], conv_in.to(self.ssm.conv.dtype)], dim=-1)  # [bs, C, W-1+q]
        mixed = ACT2FN[la.activation](F.conv1d(window, la.conv1d.weight, la.conv1d.bias, groups=la.conv_dim))
        ql, k, v = mixed.transpose(1, 2).split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        rep = la.num_v_heads // la.num_k_heads
        ql, k = (t.reshape(bs, q, -1, la.head_k_dim).repeat_interleave(rep, dim=2).float() for t in (ql, k))
        ql = l2norm(ql, dim=-1, eps=1e-6) / la.head_k_dim**0.5  # [bs, q, HV, K]
        k = l2norm(k, dim=-1, eps=1e-6)  # [bs, q, HV, K]
        v = v.reshape(bs, q, -1, la.head_v_dim).float().contiguous()  # [bs, q, HV, V]
        beta = b.sigmoid().float()  # [bs, q, HV]
        g = -la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias)  # [bs, q, HV]
        self.ssm.record_layer(slot, k, v, g, beta, conv_in)
        verify = gated_delta_verify_outputs if use_triton(x) else gated_delta_verify_outputs_reference
        o = verify(self.ssm.state[slot], ql.contiguous(), k.contiguous(), v, g.contiguous(), beta.contiguous())
        o = la.norm(o.reshape(-1, la.head_v_dim).to(x.dtype), z.reshape(-1, la.head_v_dim))
        return la.out_proj(o.reshape(bs, q, -1))

    def _attention(self, i: int, at, x: Tensor, cos_sin: tuple[Tensor, Tensor], positions: Tensor) -> Tensor:
        """One gated attention mixer over the fed tokens. x: [bs, q, H]; positions: [bs, q]."""
        bs, q, _ = x.shape
        shape = (bs, q, -1, at.head_dim)
        query, gate = torch.chunk(at.q_proj(x).view(bs, q, -1, at.head_dim * 2), 2, dim=-1)
        query = at.q_norm(query.reshape(shape)).transpose(1, 2)  # [bs, Hq, q, D]
        key = at.k_norm(at.k_proj(x).view(shape)).transpose(1, 2)  # [bs, Hkv, q, D]
        value = at.v_proj(x).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *cos_sin)
        ck, cv = self._slots(i, key, int(positions.max()) + 1)
        rows = torch.arange(bs, device=x.device)[:, None]
        ck[rows, :, positions] = key.transpose(1, 2)  # slot p of row b <- token at position p
        cv[rows, :, positions] = value.transpose(1, 2)
        visible = torch.arange(ck.shape[2], device=x.device) <= positions[..., None]  # [bs, q, S]
        mask = torch.zeros(visible.shape, dtype=query.dtype, device=x.device)
        mask = mask.masked_fill(~visible, torch.finfo(query.dtype).min)[:, None]  # [bs, 1, q, S]
        out, _ = eager_attention_forward(at, query, ck, cv, mask, scaling=at.scaling)
        out = out.reshape(bs, q, -1) * torch.sigmoid(gate.reshape(bs, q, -1))
        return at.o_proj(out)

    def _slots(self, i: int, like: Tensor, need: int) -> tuple[Tensor, Tensor]:
        """Layer i's (k, v) slot caches [bs, Hkv, S, D], grown (doubling) to hold `need` slots."""
        bs, hkv, _, d = like.shape
        k, v = self.kv.get(i, (like.new_zeros(bs, hkv, 0, d), like.new_zeros(bs, hkv, 0, d)))
        if k.shape[2] < need:
            grow = like.new_zeros(bs, hkv, max(need, 2 * k.shape[2]) - k.shape[2], d)
            k, v = torch.cat([k, grow], dim=2), torch.cat([v, grow], dim=2)
            self.kv[i] = (k, v)
        return k, v
