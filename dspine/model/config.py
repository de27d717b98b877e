"""`DSpineConfig`: every shape and switch of a DSpine drafter, validated once.

The config is data: it round-trips through the `dspine_config` block of a checkpoint's
`config.json` (`to_dict` / `from_dict`), and `__post_init__` rejects impossible values with a
message that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SELECTION_MODES = ("transition", "argmax")
INJECTION_CANDIDATE_MODES = ("per_layer", "first_layer")


class ConfigError(ValueError):
    """A drafter config field holds an impossible value; the message names the field and the fix."""


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Up to `num_ids` distinct, evenly spaced target layers from 1 to `num_target_layers - 3`
    (HF "output of layer i"); fewer when the target is too shallow to space them apart.

    The same spacing rule DFlash uses; the last layers are left out because they specialise on
    the target's own next-token head.
    """
    if num_target_layers < 4:
        return list(range(min(num_ids, num_target_layers)))
    start, end = 1, num_target_layers - 3
    if num_ids == 1:
        return [(start + end) // 2]
    return sorted({round(start + i * (end - start) / (num_ids - 1)) for i in range(num_ids)})


@dataclass
class DSpineConfig:
    """Shapes of the drafter (target-sized attention/MLP) and the DSpine-specific switches.

    Invariants: `num_attention_heads % num_key_value_heads == 0`; `block_size >= 2` (anchor +
    at least one proposal); every `target_layer_ids` entry < `num_target_layers`;
    `mask_token_id < vocab_size`; `injection_top_k <= vocab_size`; `selection_top_k >= 1`.
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_target_layers: int
    mask_token_id: int
    num_hidden_layers: int = 5
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    sliding_window: int = 2048
    transfer_rank: int = 256
    injection: bool = True
    injection_top_k: int = 8
    # "per_layer": every layer scores the whole vocabulary for its top-k; "first_layer": layer 1 does,
    # layers 2.. re-weight layer 1's k candidates with their own scores (one vocabulary scan a round).
    injection_candidates: str = "first_layer"  # what the shipped drafter and the training configs use
    selection: str = "transition"
    selection_top_k: int = 8
    transition_lambda: float = 1.0
    successor_table_size: int = 32
    # λ_l of the layer-wise transfer-space losses. Light: with [0.5, 0.4, 0.3, 0.2, 0.1] they outweighed
    # the final CE about 2:1 and cost position-1 acceptance (docs/training.md).
    layer_loss_weights: list[float] = field(default_factory=lambda: [0.1, 0.08, 0.06, 0.04, 0.02])
    confidence_head: bool = True

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self._check()

    def _check(self) -> None:
        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"dspine_config.{name} = {getattr(self, name)!r}: {fix}")

        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "num_target_layers", "num_hidden_layers", "transfer_rank",
                     "sliding_window", "selection_top_k"):
            need(getattr(self, name) > 0, name, "must be a positive integer")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             "must divide num_attention_heads (grouped-query attention)")
        need(self.block_size >= 2, "block_size", "must be >= 2: one anchor plus at least one proposal")
        need(0 <= self.mask_token_id < self.vocab_size, "mask_token_id",
             f"must be a token id below vocab_size={self.vocab_size}")
        need(all(0 <= i < self.num_target_layers for i in self.target_layer_ids), "target_layer_ids",
             f"every id must lie in [0, num_target_layers={self.num_target_layers})")
        need(len(set(self.target_layer_ids)) == len(self.target_layer_ids), "target_layer_ids",
             "ids must be distinct")
        need(1 <= self.injection_top_k <= self.vocab_size, "injection_top_k", "must lie in [1, vocab_size]")
        need(1 <= self.selection_top_k <= self.vocab_size, "selection_top_k", "must lie in [1, vocab_size]")
        need(1 <= self.successor_table_size <= self.vocab_size, "successor_table_size", "must lie in [1, vocab_size]")
        need(self.selection in SELECTION_MODES, "selection", f"must be one of {SELECTION_MODES}")
        need(self.injection_candidates in INJECTION_CANDIDATE_MODES, "injection_candidates",
             f"must be one of {INJECTION_CANDIDATE_MODES}")
        need(self.sliding_window >= self.block_size, "sliding_window",
             f"must be >= block_size={self.block_size}: the window has to hold a whole block")
        need(len(self.layer_loss_weights) == self.num_hidden_layers, "layer_loss_weights",
             f"needs one weight per draft layer ({self.num_hidden_layers})")

    @property
    def num_context_features(self) -> int:
        """K: how many target layers feed the context projection `fc` (input width K·H)."""
        return len(self.target_layer_ids)

    @property
    def num_proposals(self) -> int:
        """Tokens proposed per round: the block minus its anchor (15 for a block of 16)."""
        return self.block_size - 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DSpineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"dspine_config has unknown fields {unknown}: remove them, or upgrade dspine "
                              f"if the checkpoint was written by a newer version")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"dspine_config lacks required fields {missing}")
        return cls(**data)

    def replace(self, **changes) -> "DSpineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target_config, *, mask_token_id: int, **overrides) -> "DSpineConfig":
        """A drafter shaped like a transformers target config (Llama / Qwen2 / Qwen3 families)."""
        tc = target_config
        base = dict(
            hidden_size=tc.hidden_size,
            vocab_size=tc.vocab_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            intermediate_size=tc.intermediate_size,
            num_target_layers=tc.num_hidden_layers,
            head_dim=getattr(tc, "head_dim", None),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(tc),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            mask_token_id=mask_token_id,
        )
        base.update(overrides)
        return cls(**base)


def _rope_theta(target_config) -> float:
    theta = getattr(target_config, "rope_theta", None)
    if theta is None:
        params = getattr(target_config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)
