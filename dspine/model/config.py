"""`DSpineConfig`: every shape and switch of a DSpine drafter, validated once.

The config is data: it round-trips through the `dspine_config` block of a checkpoint's
`config.json` (`to_dict` / `from_dict`), and `__post_init__` rejects impossible values with a
message that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

SELECTION_MODES = ("transition", "argmax")
INJECTION_CANDIDATE_MODES = ("per_layer", "first_layer")
COPY_SCORE_MODES = ("mixture", "logit")  # how a copy token's log-odds enter its score (`selection.copy_scores`)
# Copy-score tables (`dspine.model.copy_candidates`): log-odds that a copy token is the target's next
# token, by match-length bucket (rows; lower edges below) and slot (columns; the last serves later
# slots). Fitted with `python -m dspine.model.copy_candidates --recorded` (prior 8) on 1,064 recorded
# assistant messages (258k tokens, SmolLM2 tokenizer, window 8192, matches counted up to 32): all
# ToolTalk conversations (`data.dev_traces.tooltalk_requests`), the first 400 ShareGPT conversations
# (`sharegpt_requests(iter_sharegpt())`) and the BFCL dev traces.
DEFAULT_COPY_MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_COPY_FOLLOW_LOG_ODDS = (
    (-1.36, -0.18, 0.22, 0.55, 0.67, 0.89, 1.08, 1.13, 1.37, 1.50, 1.50, 1.55, 1.49, 1.23, 2.02),
    (-0.29, 0.14, 0.55, 0.72, 0.98, 1.16, 1.25, 1.51, 1.61, 1.64, 1.76, 1.66, 1.52, 1.88, 2.13),
    (0.17, 0.47, 0.75, 0.99, 1.18, 1.24, 1.51, 1.67, 1.63, 1.80, 1.81, 1.75, 2.09, 2.17, 1.94),
    (0.54, 0.83, 1.05, 1.23, 1.39, 1.60, 1.68, 1.73, 1.86, 1.83, 1.91, 2.12, 2.04, 1.94, 2.00),
    (0.99, 1.16, 1.37, 1.60, 1.65, 1.74, 1.84, 1.80, 1.90, 2.10, 2.05, 1.98, 2.06, 2.28, 2.39),
    (1.41, 1.60, 1.71, 1.74, 1.86, 1.93, 1.96, 2.04, 2.06, 2.11, 2.20, 2.29, 2.51, 2.52, 2.63),
    (1.82, 1.89, 1.93, 2.04, 2.05, 2.11, 2.20, 2.31, 2.46, 2.48, 2.58, 2.48, 2.50, 2.56, 2.56),
    (2.13, 2.20, 2.29, 2.35, 2.46, 2.46, 2.54, 2.62, 2.62, 2.67, 2.70, 2.86, 2.92, 2.97, 3.00),
    (2.48, 2.56, 2.60, 2.80, 2.83, 2.91, 2.93, 2.83, 2.85, 2.87, 2.85, 2.92, 2.86, 2.90, 2.91),
    (3.52, 3.56, 3.60, 3.63, 3.63, 3.67, 3.71, 3.79, 3.82, 3.85, 3.90, 3.90, 3.92, 3.95, 3.99),
)
DEFAULT_COPY_REENTER_LOG_ODDS = (
    (-1.36, -2.97, -3.48, -3.61, -3.78, -3.91, -3.96, -4.06, -4.13, -4.13, -4.10, -4.15, -4.18, -4.19, -4.17),
    (-0.29, -2.20, -2.84, -3.08, -3.32, -3.48, -3.62, -3.60, -3.78, -3.83, -3.86, -3.84, -3.89, -3.95, -3.98),
    (0.17, -2.02, -2.51, -2.85, -3.11, -3.28, -3.31, -3.45, -3.55, -3.55, -3.59, -3.62, -3.73, -3.81, -3.78),
    (0.54, -1.71, -2.34, -2.68, -2.87, -3.04, -3.17, -3.25, -3.37, -3.37, -3.41, -3.48, -3.57, -3.60, -3.65),
    (0.99, -1.58, -2.11, -2.31, -2.60, -2.82, -2.97, -3.02, -3.08, -3.06, -3.25, -3.25, -3.33, -3.48, -3.58),
    (1.41, -1.43, -1.98, -2.28, -2.51, -2.65, -2.72, -2.84, -2.86, -3.00, -3.07, -3.10, -3.27, -3.25, -3.36),
    (1.82, -1.24, -1.61, -1.96, -2.10, -2.38, -2.42, -2.56, -2.80, -2.84, -2.93, -3.18, -3.27, -3.33, -3.39),
    (2.13, -0.96, -1.46, -1.96, -2.25, -2.33, -2.50, -2.78, -2.95, -3.00, -3.16, -3.25, -3.29, -3.42, -3.50),
    (2.48, -1.46, -2.08, -2.17, -2.51, -2.79, -3.07, -3.03, -3.00, -2.84, -2.93, -2.98, -2.97, -2.94, -3.03),
    (3.52, -1.46, -1.79, -2.05, -2.20, -2.25, -2.46, -2.64, -2.77, -2.85, -2.95, -3.10, -3.19, -3.25, -3.31),
)


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


def text_config(target_config):
    """The language-model part of a target config: `get_text_config()` of a combined text + vision
    config (e.g. Qwen3.5-class targets nest their shape under `text_config`), the config itself
    otherwise. Every shape read and every target fingerprint goes through it, so a checkpoint trained
    on the combined config matches the text config SGLang serves."""
    get = getattr(target_config, "get_text_config", None)
    return get() if callable(get) else target_config


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
    # Copy candidates (dspine.model.copy_candidates): the continuation of the longest earlier match of
    # the history's suffix (>= copy_min_match tokens, counted up to copy_max_match, in the last
    # copy_history_window tokens) joins each slot's candidates, for up to copy_max_span slots (None:
    # every proposal slot). Off until measured on the serving workloads. copy_rematch adds a second
    # chain, matched again after the drafter's first-slot choice (`copy_candidates.copy_candidates`).
    copy_candidates: bool = False
    copy_rematch: bool = True
    copy_min_match: int = 2
    copy_max_match: int = 32
    copy_max_span: int | None = None
    copy_history_window: int = 8192
    copy_score: str = "mixture"
    copy_match_buckets: list[int] = field(default_factory=lambda: list(DEFAULT_COPY_MATCH_BUCKETS))
    copy_follow_log_odds: list[list[float]] = field(
        default_factory=lambda: [list(row) for row in DEFAULT_COPY_FOLLOW_LOG_ODDS])
    copy_reenter_log_odds: list[list[float]] = field(
        default_factory=lambda: [list(row) for row in DEFAULT_COPY_REENTER_LOG_ODDS])

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
        self._check_copy(need)

    def _check_copy(self, need) -> None:
        need(self.copy_min_match >= 1, "copy_min_match", "must be >= 1 (the anchor alone is a 1-token match)")
        need(self.copy_max_match >= self.copy_min_match, "copy_max_match",
             f"must be >= copy_min_match={self.copy_min_match}")
        need(self.copy_max_span is None or 1 <= self.copy_max_span <= self.block_size - 1, "copy_max_span",
             f"must lie in [1, block_size - 1 = {self.block_size - 1}] (or be None: every proposal slot)")
        need(self.copy_history_window > self.copy_min_match, "copy_history_window",
             f"must exceed copy_min_match={self.copy_min_match}: the suffix and an earlier match need room")
        need(self.copy_score in COPY_SCORE_MODES, "copy_score", f"must be one of {COPY_SCORE_MODES}")
        edges = self.copy_match_buckets
        need(len(edges) >= 1 and all(isinstance(e, int) and e >= 1 for e in edges)
             and all(a < b for a, b in zip(edges, edges[1:])), "copy_match_buckets",
             "must be ascending positive integers (the lower edges of the match-length buckets)")
        for name in ("copy_follow_log_odds", "copy_reenter_log_odds"):
            table = getattr(self, name)
            need(len(table) == len(edges) and all(len(row) == len(table[0]) >= 1 for row in table), name,
                 f"must be a table of {len(edges)} rows (one per copy_match_buckets entry) of equal length >= 1")
            need(all(isinstance(v, (int, float)) and math.isfinite(v) for row in table for v in row), name,
                 "must hold finite numbers (log-odds)")
        if self.copy_candidates:
            need(self.selection == "transition", "copy_candidates",
                 "needs selection = 'transition': copy tokens join the transition lattice")
            need(self.selection_top_k + 2 * self.copy_chains <= self.vocab_size, "selection_top_k",
                 f"must be <= vocab_size - 2C = {self.vocab_size - 2 * self.copy_chains} with copy_candidates "
                 f"({self.copy_chains} copy chains: the lattice ranks K+2C ids a slot)")

    @property
    def copy_chains(self) -> int:
        """C: copy chains a round adds to the lattice when copy candidates run, one column each."""
        return 1 + int(self.copy_rematch)

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
        """A drafter shaped like a transformers target config (Llama / Qwen2 / Qwen3 families; of a
        combined text + vision config, its text part)."""
        tc = text_config(target_config)
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
