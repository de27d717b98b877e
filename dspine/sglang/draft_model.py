"""`DSpineDraftModel` for SGLang's model registry: a DFlash draft model plus DSpine's extras.

SGLang builds the draft of `--speculative-draft-model-path` as `cls(config=hf_config,
quant_config=...)` from `config.json` `architectures[0]` and loads it with `load_weights`. The
class subclasses SGLang's `DFlashDraftModel` (`models/dflash.py`), so every attribute the DFlash
worker reads is inherited and identical in 0.5.17 and 0.5.22: per layer `self_attn.{kv_proj_only,
apply_k_norm, apply_k_rope, num_kv_heads, head_dim, attn, qkv_proj, rotary_emb}`, and on the model
`project_target_hidden`, `prepare_context_hidden_for_kv`, `supports_fused_context_kv`,
`get_input_embeddings`, `block_size` (0.5.22 also `set_block_size`, `candidate_selector`,
`lilicorr`, `is_nemotron_35_draft`). The Qwen3-style layers, `fc`, `hidden_norm` and `norm` are
DFlash's own modules, so the target-hidden KV materialisation (fused or per layer) runs unchanged.

What DSpine adds, and only here:

- **Forward** (re-implemented, it is DFlash's 15-line loop plus two lines): the block rows arrive as
  `bs x N` row-major (padded to the graph batch). Slots 1..N-1 get the learned `mask_embedding`
  instead of the target embedding of `mask_token_id` the worker looked up (slot 0, the anchor,
  keeps the target embedding, as in training). After every layer the gated adjacent injection
  runs on `hidden.view(-1, N, H)` with the anchors `input_ids.view(-1, N)[:, 0]`: both SGLang
  versions hand the draft forward the block ids (`forward_batch.input_ids`, a static buffer in the
  graph, copied on replay) next to `input_embeds`, so nothing has to be stashed. DFlash's fused
  residual is unfolded to the full hidden state around the injection (DSpine's layer is
  `x += attn(norm(x)); x += mlp(norm(x)); x = inject(x)`).
- **Layer attention**: every layer is built bidirectional over the compact draft cache's window
  (`bidirectional_layers`), also from configs that list `sliding_attention` layers.
- **Transfer table** U = E_out P^T ([V, r]) from the TARGET's `lm_head`, attached by the worker
  (`attach_target_head`) before graph capture. U lives in one persistent buffer (the captured
  graphs read its address); it is (re)computed outside graphs: at attach time, on the first real
  decode step (weights are final by then, also with `--startup-weight-load-mode overlap`) and when
  the head's storage or version changes. Under TP the vocab-sharded head gives each rank its rows of
  U, which are all-gathered into a full replicated table (candidate ids are global).
- **Selection**: `candidate_selector` + `compute_candidates` implement SGLang's DFlash selector
  seam (0.5.20+: folded into the draft graph, eager fallback, and sampled verification with the
  proposal q). Candidates, lattice scores and the walk are `dspine.model.selection`'s, the
  functions the reference drafter's `select_tokens` runs, so tokens and q equal it. SGLang 0.5.17
  has no seam: the worker folds the same functions into the draft graph through its own sampler
  (`dspine_worker_v2.py`).
- **Copy candidates** (`dspine_config.copy_candidates`; TP 1): with the worker's
  `SlotTokenHistory` attached, each slot also holds the tokens that copying the request's own
  context predicts there (`model.copy_candidates`: C chains of suffix matches, calibrated scores),
  and the walk runs over the K+C-candidate lattice of `selection.lattice_with_copies`, in the draft
  graph like the rest. 0.5.17: `propose`. 0.5.20+: through the selector seam (`compute_candidates` returns the
  K+C candidates and keeps the lattice's pair scores for the `build_lattice` call that follows;
  `candidate_selector.top_k` is K+C, so SGLang sizes its buffers for them).
- **Strict weights**: `load_weights` maps and loads every tensor of the checkpoint
  (`draft_weights.py`: Qwen3-style names, q/k/v and gate/up stacked) and raises naming every
  unexpected tensor and every parameter left unloaded.
- **Confidence**: the confidence head's per-position logits are written, next to the candidates
  (`compute_candidates`, so in the draft graph in every SGLang version), into a static buffer the
  worker allocates with `enable_confidence_record` when `DSPINE_RECORD_CONFIDENCE=1`; the worker
  returns them per request in `meta_info` for `dspine tune-sps`'s calibration.

`config.json` must mirror `block_size`, `target_layer_ids`, `num_target_layers` and
`mask_token_id` into a `dflash_config` block: SGLang reads those (also for the target's hidden-state
capture), never `dspine_config`. A checkpoint without it fails at construction, before serving.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.models.dflash import DFlashDraftModel as _DFlashDraftModel
from torch import Tensor, nn

from dspine.model.config import ConfigError
from dspine.model.copy_candidates import CopyTables, copy_candidates
from dspine.model.selection import candidate_topk, lattice_scores, lattice_with_copies, walk_lattice
from dspine.model.transfer import AdjacentInjection, TransferSpace
from dspine.model.transition import TransitionScorer
from dspine.sglang import compat
from dspine.sglang.draft_weights import check_dflash_mirror, dspine_config_of, load_strict

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ pure helpers
def block_inputs(input_embeds: Tensor, mask_embedding: Tensor, block_size: int) -> Tensor:
    """[n*N, H] worker embeddings -> [n*N, H]: slot 0 (anchor) kept, slots 1..N-1 = the learned
    mask embedding (the worker put the target embedding of `mask_token_id` there)."""
    hidden = input_embeds.shape[-1]
    blocks = input_embeds.reshape(-1, block_size, hidden)
    masks = mask_embedding.to(blocks.dtype).expand(blocks.shape[0], block_size - 1, hidden)
    return torch.cat([blocks[:, :1], masks], dim=1).reshape(-1, hidden)


def bidirectional_layers(config) -> None:
    """Make SGLang build every draft layer as DSpine trained it: the block attending to its context
    window and bidirectionally within itself (DFlash's `full_attention` + `is_causal: false`, i.e.
    ENCODER_ONLY), with no per-layer sliding window. Sets `config.layer_types` to `full_attention`
    (and `is_causal` to False) in place. The context window is SGLang's compact draft cache, sized by
    `--speculative-draft-window-size` (the plugin sets it from `dspine_config.sliding_window`): every
    query of a block sees the same last `window` committed tokens, as in training.

    Why: SGLang 0.5.17 builds a `sliding_attention` layer as DECODER attention, causal inside the
    block whatever `is_causal` says, with a per-query window (0.5.20+ honour `is_causal`). A config.json
    that lists `sliding_attention` layers is served the same way as one that lists `full_attention`."""
    config.layer_types = ["full_attention"] * int(config.num_hidden_layers)
    config.is_causal = False
    config.use_sliding_window = False


def transfer_table_from_head(head_weight: Tensor, proj_weight: Tensor, vocab_size: int, *, shard=None,
                             tp_size: int = 1, all_gather: Callable[[Tensor, int], Tensor] | None = None) -> Tensor:
    """U = E_out P^T [vocab_size, r] in P's dtype, from this rank's (possibly vocab-sharded) head.

    TP: rank i holds padded vocab rows [i*P, (i+1)*P) of the head (SGLang's VocabParallelEmbedding
    layout, `shard.num_org_elements_padded` = P, padding rows after `num_org_elements`); each rank
    projects its P rows and the all-gather concatenates them in rank order, so the first
    `vocab_size` rows are the full table."""
    if shard is not None and int(getattr(shard, "num_added_elements", 0)) != 0:
        raise NotImplementedError("DSpine does not support a target lm_head with added (LoRA) vocabulary")
    if tp_size == 1:
        rows = head_weight[:vocab_size]
        if rows.shape[0] != vocab_size:
            raise ValueError(f"target lm_head has {head_weight.shape[0]} rows, the drafter needs "
                             f"vocab_size={vocab_size}")
        return rows.to(proj_weight.dtype) @ proj_weight.T
    if shard is None or all_gather is None:
        raise RuntimeError("tp > 1 needs the lm_head's shard_indices and the TP all-gather")
    local = head_weight[: int(shard.num_org_elements_padded)].to(proj_weight.dtype) @ proj_weight.T
    full = all_gather(local.contiguous(), 0)
    if full.shape[0] < vocab_size:
        raise ValueError(f"gathered {full.shape[0]} transfer rows, the drafter needs vocab_size={vocab_size}")
    return full[:vocab_size]


def global_topk(hidden: Tensor, head_weight: Tensor, k: int, *, num_org: int, org_start: int = 0,
                tp_size: int = 1, all_gather: Callable[[Tensor, int], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Top-k draft candidates through the target head: hidden [M, H] -> (global ids [M, k] int64,
    logits [M, k] fp32). TP: local top-k per vocab shard, all-gather k values/ids per rank (not the
    vocabulary), then a global top-k: the same candidates as a full-vocabulary top-k. The local top-k
    is `selection.candidate_topk`, the reference drafter's."""
    vals, ids = candidate_topk(hidden.to(head_weight.dtype) @ head_weight[:num_org].T, k)
    ids = ids + org_start
    if tp_size == 1:
        return ids, vals
    all_vals, all_ids = all_gather(vals.contiguous(), -1), all_gather(ids.contiguous(), -1)  # [M, tp*k]
    vals, pick = all_vals.topk(k, dim=-1)
    return all_ids.gather(-1, pick), vals


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _weight_key(weight: Tensor) -> tuple:
    try:
        version = weight._version
    except RuntimeError:  # inference tensors track no version
        version = None
    return weight.data_ptr(), version, tuple(weight.shape)


# ---------------------------------------------------------------------------------- selector
class DSpineCandidateSelector:
    """SGLang's DFlash `candidate_selector` seam (0.5.20+) with DSpine's transition scores.

    Not an `nn.Module`: its only weight, W_T, is the model's `transition.weight` (checkpoint name
    kept), and the table is the model's transfer table. With copy candidates (a token history
    attached to the model) the lattice has K+C candidates a slot, built by `compute_candidates`."""

    def __init__(self, model: "DSpineDraftModel"):
        self._model = model
        self.lam = float(model.dspine_config.transition_lambda)

    @property
    def top_k(self) -> int:
        """Candidates a slot: `selection_top_k`, plus one per copy chain while a token history is
        attached. SGLang sizes its in-graph sampler's candidate and q buffers with it when it builds
        the draft graph (the DSPINE worker attaches the history before that)."""
        model = self._model
        cfg = model.dspine_config
        return int(cfg.selection_top_k) + (cfg.copy_chains if model._history is not None else 0)

    def build_lattice(self, *, candidate_ids: Tensor, unary_logits: Tensor, hidden_states: Tensor,
                      anchor_token_ids: Tensor) -> Tensor:
        """candidate_ids / unary_logits [n, N-1, top_k] (what `compute_candidates` returned),
        hidden_states [n, N-1, H], anchor_token_ids [n] -> scores [n, N-1, top_k, top_k] fp32.
        With copy candidates: the lattice `compute_candidates` built (`model.copy_lattice_scores`)."""
        del hidden_states  # DSpine's transitions depend on the token pair only
        model = self._model
        if model._history is not None:
            return model.copy_lattice_scores(candidate_ids, unary_logits)
        return lattice_scores(model.transition, model.transfer_table(), candidate_ids, unary_logits,
                              anchor_token_ids, self.lam)

    def sample_path(self, *, candidate_ids: Tensor, scores: Tensor, uniforms: Tensor, temperatures: Tensor,
                    greedy_mask: Tensor) -> tuple[Tensor, Tensor]:
        temperature = torch.where(greedy_mask, torch.zeros_like(temperatures, dtype=torch.float32),
                                  temperatures.float())
        return walk_lattice(candidate_ids, scores, temperature, uniforms)


# ------------------------------------------------------------------------------------- model
class DSpineDraftModel(_DFlashDraftModel):
    """DSpine drafter in SGLang (see the module docstring)."""

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs) -> None:
        cfg = dspine_config_of(config)
        check_dflash_mirror(config, cfg)
        if quant_config is not None:  # SGLang hands the draft the target's --quantization by default
            logger.warning("DSPINE: the draft runs unquantized (%s ignored; --speculative-draft-model-quantization "
                           "unquant silences this).", type(quant_config).__name__)
        bidirectional_layers(config)
        super().__init__(config=config, quant_config=None, prefix=prefix)
        self.dspine_config = cfg
        if int(self.num_context_features) != cfg.num_context_features:
            raise ConfigError(f"SGLang sized fc for {self.num_context_features} target layers, dspine_config has "
                              f"{cfg.target_layer_ids}: fix dflash_config.target_layer_ids")
        self.block_size = cfg.block_size
        h, r = cfg.hidden_size, cfg.transfer_rank
        self.mask_embedding = nn.Parameter(torch.empty(h), requires_grad=False)
        uses_transfer = cfg.injection or cfg.selection == "transition"
        self.transfer = TransferSpace(h, r) if uses_transfer else None
        self.injections = (nn.ModuleList(AdjacentInjection(h, r, cfg.injection_top_k)
                                         for _ in range(cfg.num_hidden_layers)) if cfg.injection else None)
        self.transition = TransitionScorer(r) if cfg.selection == "transition" else None
        self.confidence = nn.Linear(h, 1) if cfg.confidence_head else None
        for module in (self.transfer, self.injections, self.transition, self.confidence):
            if module is not None:
                module.requires_grad_(False)
        # SGLang's selector seam (0.5.20+); None = independent argmax (the ablation), which
        # DFlash's own greedy head serves in every version.
        self.candidate_selector = DSpineCandidateSelector(self) if self.transition is not None else None
        self.lm_head = None  # 0.5.22's worker points it at the target head before capture
        # Target tensors are referenced, never registered (not part of this model's weights).
        self.__dict__.update(_target_head=None, _tp_group=None, _table=None, _table_key=None, _served=False,
                             _weights_loaded=False, _sglang_candidate_topk=compat.sglang_candidate_topk(),
                             _confidence_buf=None, _history=None, _copy_tables=None, _copy_pair=None,
                             _copy_pending=None)
        self._warn_if_window_differs()

    # ------------------------------------------------------------------------ block size
    def set_block_size(self, block_size: int) -> None:
        """0.5.22's worker passes the resolved `--speculative-num-draft-tokens` (0.5.17 never calls)."""
        if int(block_size) != self.dspine_config.block_size:
            raise ValueError(f"--speculative-num-draft-tokens {block_size}: this DSpine drafter was trained for blocks "
                             f"of {self.dspine_config.block_size}. Fix: drop the flag or set it to "
                             f"{self.dspine_config.block_size}")
        if hasattr(super(), "set_block_size"):
            super().set_block_size(block_size)
        self.block_size = int(block_size)

    def _warn_if_window_differs(self) -> None:
        window = compat.published_spec_value("speculative_draft_window_size")
        if window is not None and int(window) != self.dspine_config.sliding_window:
            logger.warning("DSPINE: --speculative-draft-window-size %s differs from the window the drafter was trained "
                           "with (dspine_config.sliding_window = %d).", window, self.dspine_config.sliding_window)
        elif window is None:
            logger.info("DSPINE: the drafter was trained with a context window of %d tokens; without "
                        "--speculative-draft-window-size %d it sees the whole context of longer requests.",
                        self.dspine_config.sliding_window, self.dspine_config.sliding_window)

    # ---------------------------------------------------------------------- target head
    def attach_target_head(self, lm_head: nn.Module, tp_group=None) -> None:
        """Reference the TARGET's `lm_head` (vocab-sharded under TP) for the transfer table and the
        candidates. Call before graph capture; the table buffer is allocated here once."""
        cfg = self.dspine_config
        weight = getattr(lm_head, "weight", None)
        if weight is None or not torch.is_floating_point(weight):
            raise ValueError("DSpine needs a dense floating-point target lm_head (quantized heads are not supported)")
        vocab = int(getattr(lm_head, "org_vocab_size", weight.shape[0]))
        if vocab != cfg.vocab_size or int(weight.shape[-1]) != cfg.hidden_size:
            raise ValueError(f"target lm_head is [vocab={vocab}, hidden={int(weight.shape[-1])}], this drafter was "
                             f"trained for [vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}]: serve it with "
                             f"the target it was trained for")
        self.__dict__.update(_target_head=lm_head, _tp_group=tp_group, _table_key=None, _served=False)
        if self.transfer is not None:
            proj = self.transfer.proj.weight
            self.__dict__["_table"] = torch.zeros(cfg.vocab_size, cfg.transfer_rank, dtype=proj.dtype,
                                                  device=weight.device)
            if not _capturing():
                self.refresh_transfer_table()

    @property
    def target_head(self) -> nn.Module:
        head = self.lm_head if self.lm_head is not None else self._target_head
        if head is None:
            raise RuntimeError("DSpineDraftModel: no target lm_head attached (the DSPINE worker attaches it)")
        return head

    def _tp(self) -> tuple[int, Optional[Callable]]:
        group = self._tp_group
        size = int(getattr(group, "world_size", 1)) if group is not None else 1
        return size, (group.all_gather if size > 1 else None)

    def refresh_transfer_table(self) -> None:
        """Recompute U into the persistent buffer (outside graphs; a collective under TP)."""
        head = self._target_head
        tp_size, all_gather = self._tp()
        # Inference mode: the buffer may have been made in or out of it; in-place writes work either way.
        with torch.inference_mode():
            table = transfer_table_from_head(head.weight, self.transfer.proj.weight, self.dspine_config.vocab_size,
                                             shard=getattr(head, "shard_indices", None), tp_size=tp_size,
                                             all_gather=all_gather)
            self._table.copy_(table)
        self.__dict__["_table_key"] = _weight_key(head.weight)

    def ensure_transfer_table(self, serving: bool = False) -> None:
        """Rebuild U when it may be stale: never built, the first serving step (`serving=True`;
        target weights are final by then), or the head's storage/version changed. Host-side check."""
        if self.transfer is None or self._table is None:
            return
        stale = self._table_key is None or _weight_key(self._target_head.weight) != self._table_key
        if stale or (serving and not self._served):
            self.refresh_transfer_table()
        if serving:
            self.__dict__["_served"] = True

    def invalidate_transfer_table(self) -> None:
        """Call after updating the target's lm_head in place (e.g. RL weight sync)."""
        self.__dict__["_table_key"] = None

    def transfer_table(self) -> Tensor:
        """U [V, r]: the persistent buffer (its address is what captured graphs read)."""
        if self._table is None:
            raise RuntimeError("DSpineDraftModel: call attach_target_head(target lm_head) before the first forward")
        if self._table_key is None and not _capturing():
            self.refresh_transfer_table()
        return self._table

    # ------------------------------------------------------------------------ candidates
    def compute_candidates(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """SGLang's selector seam: hidden [M, H] -> global (candidate ids [M, K], unary logits fp32).
        Also records the rows' confidence logits when recording is on (`enable_confidence_record`).

        With copy candidates (`attach_token_history`): M = n*(N-1) proposal rows of n blocks, and
        the K+C candidates a slot of `copy_candidate_lattice` (ids [M, K+C], unary [M, K+C]); the
        lattice's pair scores go to a static buffer for the `build_lattice` call that follows
        (`copy_lattice_scores`). This call has no anchors, so slot 0's transitions are scored after
        each history row's last token: the block's anchor (SGLang's `anchor_token_ids`), which the
        worker's history writes put there (the copy match already relies on it)."""
        if self._history is not None:
            unary, ids, pair = self.copy_candidate_lattice(hidden, None)
            n = pair.shape[0]
            self._copy_pair[:n].copy_(pair)
            self.__dict__["_copy_pending"] = ids      # held until build_lattice: its address stays its own
            return ids.view(hidden.shape[0], -1), unary.view(hidden.shape[0], -1)
        self.record_confidence(hidden)
        k = self.candidate_selector.top_k
        head = self.target_head
        sglang_topk = self._sglang_candidate_topk
        if sglang_topk is not None:  # 0.5.20+: radix top-k, TP gather, quantized heads
            ids, vals, _ = sglang_topk(hidden, head, k)
            return ids.long(), vals.float()
        weight, shard = head.weight, getattr(head, "shard_indices", None)
        tp_size, all_gather = self._tp()
        num_org = int(shard.num_org_elements) if shard is not None else self.dspine_config.vocab_size
        start = int(shard.org_vocab_start_index) if shard is not None else 0
        return global_topk(hidden, weight, k, num_org=num_org, org_start=start, tp_size=tp_size, all_gather=all_gather)

    def attach_token_history(self, history) -> None:
        """Turn on copy candidates: `history` (`token_history.SlotTokenHistory`) holds every running
        request's tokens, and its `rows`/`lengths` point at the step's requests before the draft
        runs. Call before graph capture (SGLang >= 0.5.20 reads `candidate_selector.top_k`, now K+C,
        when it builds the draft graph). With the seam, allocates the static pair-score buffer it
        hands from `compute_candidates` to `build_lattice`: [history.rows rows (its largest draft
        batch), N-1, K+C, K+C] fp32. One tensor-parallel rank only (the copy path scores the whole
        vocabulary through the unsharded head)."""
        if self._tp()[0] != 1:
            raise NotImplementedError("DSpine copy candidates run at tensor parallel size 1; serve with --tp 1 or a "
                                      "drafter config with copy_candidates false")
        cfg = self.dspine_config
        device = self.target_head.weight.device
        width = cfg.selection_top_k + cfg.copy_chains
        pair = (torch.zeros(history.rows.shape[0], self.block_size - 1, width, width, dtype=torch.float32, device=device)
                if compat.has_selector_seam() else None)        # 0.5.17 walks the lattice in `propose`
        self.__dict__.update(_history=history, _copy_tables=CopyTables.from_config(cfg, device), _copy_pair=pair)

    def copy_candidate_lattice(self, hidden: Tensor, anchor_ids: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The K+C-candidate lattice of n blocks with the attached history's copy candidates:
        hidden [n*(N-1), H] proposal rows (row-major [blocks, slots]), anchor_ids [n] (None: each
        history row's last token, the anchor) -> `selection.lattice_with_copies` over the
        full-vocabulary draft logits, (unary [n, N-1, K+C] fp32, candidate ids [n, N-1, K+C],
        pair [n, N-1, K+C, K+C] fp32), walked as `unary[:, :, None, :] + pair`. The history rows
        are `window_rows(n)` (the worker pointed them at the step's requests). Also records the
        rows' confidence logits."""
        gamma = self.block_size - 1
        n = hidden.shape[0] // gamma
        self.record_confidence(hidden)
        cfg = self.dspine_config
        weight = self.target_head.weight[: cfg.vocab_size]
        logits = (hidden.to(weight.dtype) @ weight.T).view(n, gamma, -1)
        recent, lengths = self._history.window_rows(n)
        if anchor_ids is None:
            anchor_ids = recent.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        copies = copy_candidates(recent, lengths, cfg, self._copy_tables, gamma, logits[:, 0].argmax(-1))
        return lattice_with_copies(logits, anchor_ids, copies, top_k=cfg.selection_top_k, lam=cfg.transition_lambda,
                                   scorer=self.transition, table=self.transfer_table())

    def copy_lattice_scores(self, candidate_ids: Tensor, unary_logits: Tensor) -> Tensor:
        """`build_lattice` with copy candidates: scores unary[:, :, None, :] + pair [n, N-1, K+C, K+C]
        of the lattice the last `compute_candidates` built. candidate_ids / unary_logits
        [n, N-1, K+C] must be that call's candidates: SGLang calls the two back to back for the same
        rows (in the draft graph and eagerly); checked on the host (same storage, same n; no sync)."""
        n = candidate_ids.shape[0]
        pending = self._copy_pending
        self.__dict__["_copy_pending"] = None
        if pending is None or (pending.data_ptr(), pending.shape[0]) != (candidate_ids.data_ptr(), n):
            raise RuntimeError("DSpineDraftModel: with copy candidates, build_lattice must take the candidates of "
                               "the compute_candidates call just before it (it keeps their pair scores)")
        return unary_logits[:, :, None, :] + self._copy_pair[:n]

    def _propose_with_copies(self, pred_hidden: Tensor, anchor_ids: Tensor, temperature: Tensor,
                             uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`propose` with copy candidates from the attached history: the walk over
        `copy_candidate_lattice` (K+C candidates a slot)."""
        unary, ids, pair = self.copy_candidate_lattice(pred_hidden.reshape(-1, pred_hidden.shape[-1]), anchor_ids)
        tokens, q = walk_lattice(ids, unary[:, :, None, :] + pair, temperature, uniforms)
        return tokens, ids, q

    def propose(self, pred_hidden: Tensor, anchor_ids: Tensor, temperature: Tensor,
                uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Transition selection for n blocks: pred_hidden [n, N-1, H] (slots 1..N-1), anchors [n],
        temperature [n] (<= 0: Viterbi), uniforms [n, N-1] -> (tokens, candidate ids, q); with
        copy candidates (`attach_token_history`) the lattice has K+C candidates a slot."""
        if self._history is not None:
            return self._propose_with_copies(pred_hidden, anchor_ids, temperature, uniforms)
        n, gamma, hidden = pred_hidden.shape
        ids, unary = self.compute_candidates(pred_hidden.reshape(-1, hidden))
        ids, unary = ids.view(n, gamma, -1), unary.view(n, gamma, -1)
        scores = self.candidate_selector.build_lattice(candidate_ids=ids, unary_logits=unary,
                                                       hidden_states=pred_hidden, anchor_token_ids=anchor_ids)
        tokens, q = walk_lattice(ids, scores, temperature, uniforms)
        return tokens, ids, q

    # --------------------------------------------------------------------------- forward
    def inject(self, layer: int, hidden: Tensor, anchor_ids: Tensor, table: Tensor,
               candidates: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """Layer `layer`'s adjacent injection on rows [n*N, H] viewed as [n, N, H]. Returns the rows
        and, with `injection_candidates = "first_layer"`, the candidates for the next layer (layer 0
        finds them, later layers reuse `candidates`); None otherwise."""
        n_h = hidden.shape[-1]
        blocks = hidden.view(-1, self.block_size, n_h)
        if self.dspine_config.injection_candidates == "first_layer":
            out, _, candidates = self.injections[layer].forward_with_candidates(blocks, table, anchor_ids,
                                                                                need_scores=False, candidates=candidates)
            return out.reshape(-1, n_h), candidates
        out, _ = self.injections[layer](blocks, table, anchor_ids, need_scores=False)
        return out.reshape(-1, n_h), None

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, input_embeds: Optional[Tensor] = None,
                get_embedding: bool = False, pp_proxy_tensors=None) -> LogitsProcessorOutput:
        if input_embeds is None:
            raise ValueError("DSpineDraftModel requires `input_embeds` (the worker embeds the block with the target "
                             "embedding)")
        if input_embeds.numel() == 0:  # idle DP rank
            return LogitsProcessorOutput(next_token_logits=None, hidden_states=input_embeds)
        dtype = self.norm.weight.dtype
        x = block_inputs(input_embeds.to(dtype), self.mask_embedding, self.block_size)
        anchors = table = None
        if self.injections is not None:
            if input_ids is None:
                raise ValueError("DSpineDraftModel requires the block ids (`input_ids`) for the anchors")
            # Padded graph rows hold stale (valid) ids; clamp keeps any other value in range.
            anchors = input_ids.view(-1, self.block_size)[:, 0].clamp(0, self.dspine_config.vocab_size - 1)
            table = self.transfer_table()
        candidates = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, x, forward_batch, None)
            x = h + residual
            if self.injections is not None:
                x, candidates = self.inject(i, x, anchors, table, candidates)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=self.norm(x))

    def confidence_logits(self, hidden: Tensor) -> Optional[Tensor]:
        """Raw per-position acceptance logits [...] for hidden [..., H] (None without a confidence head)."""
        return None if self.confidence is None else self.confidence(hidden.to(self.confidence.weight.dtype)).squeeze(-1)

    def enable_confidence_record(self, max_rows: int, device) -> bool:
        """Allocate the static buffer `compute_candidates` writes confidence logits into (call before
        graph capture). False when this drafter has no confidence head or no transition selection
        (the argmax ablation's tokens come from SGLang's own head, which never calls
        `compute_candidates`)."""
        if self.confidence is None or self.candidate_selector is None:
            return False
        self.__dict__["_confidence_buf"] = torch.zeros(int(max_rows), dtype=torch.float32, device=device)
        return True

    def record_confidence(self, hidden: Tensor) -> None:
        """Confidence logits of the M proposal rows of `hidden` [M, H] into the buffer's first M
        entries (row-major [blocks, N-1]); a no-op when recording is off or M exceeds the buffer."""
        buf = self._confidence_buf
        if buf is not None and hidden.shape[0] <= buf.shape[0]:
            buf[: hidden.shape[0]].copy_(self.confidence_logits(hidden).float())

    def recorded_confidence(self, blocks: int) -> Optional[Tensor]:
        """The last recorded confidence logits as [blocks, N-1] (a view of the buffer), or None."""
        buf, gamma = self._confidence_buf, self.block_size - 1
        if buf is None or blocks * gamma > buf.shape[0]:
            return None
        return buf[: blocks * gamma].view(blocks, gamma)

    # ------------------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Strict loading (`draft_weights.load_strict`): the first call must fill every parameter."""
        loaded = load_strict(self, weights, first_load=not self._weights_loaded)
        self.__dict__["_weights_loaded"] = True
        if self._table is not None:
            self.invalidate_transfer_table()  # P may have changed
        return loaded

EntryClass = [DSpineDraftModel]
