"""`DSpineDrafter`: the five-layer parallel drafter.

One forward drafts whole blocks. Context: the hidden states of K target layers, concatenated
([.., K·H]), projected by `fc` and normalised, serve as keys/values of every draft layer. Queries:
the block's B positions — the anchor's target input embedding, then the learned mask embedding.
The block attends to its (windowed) context and bidirectionally within itself. After every layer,
gated adjacent injection passes each position's transfer-space guess to its successor
(`injection=False` builds the DFlash-style ablation: no injection modules at all). The final
hidden states predict through the target's frozen `lm_head`; a small confidence head estimates each
position's acceptance probability.

The target's embedding and `lm_head` weights are attached by reference (`attach_target`) and are
never part of the drafter's state dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dspine.model.config import DSpineConfig
from dspine.model.layers import DraftDecoderLayer, RMSNorm
from dspine.model.transfer import AdjacentInjection, TransferSpace
from dspine.model.transition import TransitionScorer


@dataclass
class DraftOutput:
    """hidden: [n, B, H] final normalised hidden states of n blocks; layer_scores: per-layer
    transfer-space scores [n, B, V] (only when asked for, and only with injection)."""

    hidden: Tensor
    layer_scores: list[Tensor] | None = None


class DSpineDrafter(nn.Module):
    def __init__(self, config: DSpineConfig):
        super().__init__()
        self.config = cfg = config
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(DraftDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        uses_transfer = cfg.injection or cfg.selection == "transition"
        self.transfer = TransferSpace(h, cfg.transfer_rank) if uses_transfer else None
        self.injections = (nn.ModuleList(AdjacentInjection(h, cfg.transfer_rank, cfg.injection_top_k)
                                         for _ in range(cfg.num_hidden_layers)) if cfg.injection else None)
        self.transition = TransitionScorer(cfg.transfer_rank) if cfg.selection == "transition" else None
        self.confidence = nn.Linear(h, 1) if cfg.confidence_head else None
        self._target: dict[str, Tensor] = {}
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # ----------------------------------------------------------------------------- target tensors
    def attach_target(self, input_embeddings: Tensor, output_embeddings: Tensor) -> None:
        """Reference the target's frozen input embeddings [V, H] and `lm_head.weight` [V, H]."""
        cfg = self.config
        for name, w in (("input_embeddings", input_embeddings), ("output_embeddings", output_embeddings)):
            if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(f"target {name} have shape {tuple(w.shape)}, the drafter expects "
                                 f"[vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}]: "
                                 f"this drafter was trained for another target")
        self._target = {"input_embeddings": input_embeddings.detach(), "output_embeddings": output_embeddings.detach()}
        if self.transfer is not None:
            self.transfer.invalidate()

    def target_tensor(self, name: str) -> Tensor:
        if name not in self._target:
            raise RuntimeError("call attach_target(target_input_embeddings, target_lm_head_weight) first")
        t = self._target[name]
        w = self.fc.weight
        if t.device != w.device or t.dtype != w.dtype:
            t = self._target[name] = t.to(device=w.device, dtype=w.dtype)
        return t

    def transfer_table(self) -> Tensor | None:
        """U = E_out·P [V, r], or None when neither injection nor transition selection is on."""
        if self.transfer is None:
            return None
        return self.transfer.table(self.target_tensor("output_embeddings"))

    # ----------------------------------------------------------------------------------- context
    def project_context(self, target_hidden: Tensor) -> Tensor:
        """target_hidden: [bs, L, K·H] -> context features [bs, L, H]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def context_key_values(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """features: [bs, L, H], positions: [bs, L] -> per layer (k, v), each [bs, kv_heads, L, d]."""
        rope = self.layers[0].self_attn.rope(positions)   # the same tables for every layer
        return [layer.self_attn.key_values(features, rope) for layer in self.layers]

    # ----------------------------------------------------------------------------------- forward
    def embed_blocks(self, anchor_ids: Tensor) -> Tensor:
        """anchor_ids: [bs, nb] -> block inputs [bs, nb·B, H]: anchor embedding, then mask embeddings."""
        bs, nb = anchor_ids.shape
        emb = self.target_tensor("input_embeddings")[anchor_ids]                # [bs, nb, H]
        masks = self.mask_embedding.to(emb.dtype).expand(bs, nb, self.config.block_size - 1, -1)
        return torch.cat([emb[:, :, None], masks], dim=2).reshape(bs, nb * self.config.block_size, -1)

    def forward(self, anchor_ids: Tensor, positions: Tensor, context_kv: list[tuple[Tensor, Tensor]],
                mask: Tensor, need_layer_scores: bool = False) -> DraftOutput:
        """Draft nb blocks per row in one pass.

        anchor_ids: [bs, nb]; positions: [bs, nb·B] absolute positions of the block slots;
        context_kv: per layer (k, v) [bs, kv_heads, Lc, d]; mask: [bs, nb·B, Lc + nb·B] bool (or that mask
        as a FlexAttention `BlockMask`, `BlockBatch.block_mask`)
        (context window/validity, then within-block bidirectional and no cross-block attention).
        Returns hidden [bs·nb, B, H] (final norm applied).
        """
        cfg = self.config
        bs, nb = anchor_ids.shape
        x = self.embed_blocks(anchor_ids)
        table = self.transfer_table() if self.injections is not None else None
        flat_anchor = anchor_ids.reshape(-1)
        scores = [] if need_layer_scores and self.injections is not None else None
        candidates = None  # injection_candidates == "first_layer": layer 1's top-k ids, reused by later layers
        rope = self.layers[0].self_attn.rope(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, context_kv[i][0], context_kv[i][1], mask)
            if self.injections is not None:
                blocks = x.view(bs * nb, cfg.block_size, -1)
                if cfg.injection_candidates == "first_layer":
                    blocks, s, candidates = self.injections[i].forward_with_candidates(
                        blocks, table, flat_anchor, need_scores=scores is not None, candidates=candidates)
                else:
                    blocks, s = self.injections[i](blocks, table, flat_anchor, need_scores=scores is not None)
                x = blocks.view(bs, nb * cfg.block_size, -1)
                if scores is not None:
                    scores.append(s)
        return DraftOutput(hidden=self.norm(x).view(bs * nb, cfg.block_size, -1), layer_scores=scores)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> draft logits [..., V] through the target's frozen lm_head."""
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1]).contiguous()  # one pass over the vocab matrix
        return (flat @ self.target_tensor("output_embeddings").T).view(*shape[:-1], -1)

    def confidence_logits(self, hidden: Tensor) -> Tensor | None:
        """hidden [..., H] -> raw per-position acceptance logits [...] (sigmoid = estimate)."""
        return None if self.confidence is None else self.confidence(hidden).squeeze(-1)
