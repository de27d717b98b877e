"""The verifier interface of the reference engine (`TargetRunner`, `TargetStep`) and
`TransformersTargetRunner`, a transformers causal LM behind it.

Keeps one KV cache for a ragged batch: row b holds `lengths[b]` committed tokens in a right-padded
slot layout (attention mask marks valid slots; position ids are each row's own). `verify` feeds q
tokens after every row's prefix; `commit(keep)` keeps the first keep[b] of them and compacts the
holes away, so the cache afterwards equals that of a model that only ever saw the kept tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dspine.engine.slots import compact_order, gather_slots


@dataclass
class TargetStep:
    logits: Tensor   # [bs, q, V] float32: logits at every fed position
    hidden: Tensor   # [bs, q, K*H]: target hidden states at layer_ids (HF "output of layer i")


class TargetRunner(Protocol):
    """A target that verifies drafted tokens for a ragged batch of rows.

    `prefill(prompts)` commits every prompt; `verify(tokens [bs, q])` feeds q tokens after each
    row's committed prefix and commits nothing; `commit(keep [bs])` keeps the first keep[b] of them
    (1 <= keep[b] <= q) so the state equals that of a model that only ever saw the kept tokens;
    `select(rows)` keeps only those batch rows."""

    batch_size: int

    def prefill(self, prompts: list[list[int]]) -> TargetStep: ...

    def verify(self, tokens: Tensor) -> TargetStep: ...

    def commit(self, keep: Tensor) -> None: ...

    def select(self, rows: Tensor) -> None: ...


class TransformersTargetRunner:
    def __init__(self, model, layer_ids: list[int]):
        from transformers import DynamicCache

        self.model, self.layer_ids = model, list(layer_ids)
        self.device = next(model.parameters()).device
        self._new_cache = DynamicCache
        # transformers >= 5.24 renamed the forward argument `past_key_values` to `cache`.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache = None
        self.valid: Tensor | None = None      # [bs, S] bool
        self.lengths: Tensor | None = None    # [bs] committed tokens
        self._pending = 0                      # tokens fed by the last verify, not yet committed

    @property
    def batch_size(self) -> int:
        return 0 if self.lengths is None else int(self.lengths.shape[0])

    def _forward(self, ids: Tensor, attention_mask: Tensor, positions: Tensor) -> TargetStep:
        out = self.model(input_ids=ids, attention_mask=attention_mask.long(), position_ids=positions,
                         use_cache=True, output_hidden_states=True, **{self._cache_arg: self.cache})
        hidden = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        return TargetStep(logits=out.logits.float(), hidden=hidden)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> TargetStep:
        """Right-padded prompts -> logits/hidden [bs, Lmax, ...]; commits each full prompt."""
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lens.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, device=self.device)
        valid = torch.arange(width, device=self.device)[None] < lens[:, None]
        positions = torch.arange(width, device=self.device)[None].expand(len(prompts), -1)
        self.cache, self._pending = self._new_cache(), 0
        step = self._forward(ids, valid, positions)
        self.valid, self.lengths = valid, lens
        self._compact()
        return step

    @torch.no_grad()
    def verify(self, tokens: Tensor) -> TargetStep:
        """tokens [bs, q] fed after each row's committed prefix; nothing is committed yet."""
        q = tokens.shape[1]
        mask = torch.cat([self.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
        positions = self.lengths[:, None] + torch.arange(q, device=self.device)[None]
        step = self._forward(tokens, mask, positions)
        self._pending = q
        return step

    def commit(self, keep: Tensor) -> None:
        """keep [bs] in 1..q: keep the first keep[b] tokens fed by the last verify."""
        fed = torch.arange(self._pending, device=self.device)[None] < keep[:, None]
        self.valid = torch.cat([self.valid, fed], dim=1)
        self.lengths = self.lengths + keep
        self._pending = 0
        self._compact()

    def select(self, rows: Tensor) -> None:
        """Keep only these batch rows."""
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        self.valid, self.lengths = self.valid[rows], self.lengths[rows]
        self._compact()

    def _compact(self) -> None:
        if bool(self.valid.all()):
            return
        index, self.valid = compact_order(self.valid)
        for layer in self.cache.layers:
            layer.keys = gather_slots(layer.keys, index, dim=2)
            layer.values = gather_slots(layer.values, index, dim=2)

