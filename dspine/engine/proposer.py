"""Drafters as seen by the reference engine, and `DSpineProposer`, which runs a `DSpineDrafter`.

A proposer follows the committed sequence of every row: `start` with the prompt (tokens and the
target's hidden states), `extend` with each round's committed tokens, `select` when rows leave,
and `propose` a block's N = B-1 tokens after the row's anchor. With `copy_candidates` on,
`DSpineProposer` also keeps each row's recent tokens (`TokenHistory`), whose copies join the lattice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dspine.model.copy_candidates import CopyTables, TokenHistory, copy_candidates
from dspine.model.drafter import DSpineDrafter
from dspine.engine.slots import compact_order, gather_slots
from dspine.model.selection import CopyCandidates, select_tokens
from dspine.model.transition import SuccessorTable


@dataclass
class Proposal:
    """tokens [bs, N]; cand_ids/q [bs, N, K] proposal distribution (None: no q);
    confidence [bs, N] per-position acceptance estimates in [0, 1] (None: no head)."""

    tokens: Tensor
    cand_ids: Tensor | None = None
    q: Tensor | None = None
    confidence: Tensor | None = None


class Proposer(Protocol):
    block_size: int
    layer_ids: list[int]

    def start(self, tokens: Tensor, hidden: Tensor, lengths: Tensor) -> None:
        """tokens [bs, L] right-padded prompts, hidden [bs, L, K*H], lengths [bs]."""

    def extend(self, tokens: Tensor, hidden: Tensor, keep: Tensor) -> None:
        """tokens [bs, q] just verified, hidden [bs, q, K*H]; the first keep[b] are committed."""

    def select(self, rows: Tensor) -> None: ...

    def propose(self, anchor_ids: Tensor, temperature: Tensor, generator: torch.Generator | None) -> Proposal: ...


class DSpineProposer:
    """Per-layer context K/V cache (right-padded slots + validity, positions) and one-block drafting;
    with `copy_candidates`, each row's last `copy_history_window - 1` committed tokens too (the
    anchor completes the window)."""

    def __init__(self, model: DSpineDrafter):
        self.model = model
        self.config = model.config
        self.block_size = model.config.block_size
        self.layer_ids = model.config.target_layer_ids
        self.successors: SuccessorTable | None = None
        if model.transition is not None:
            device = model.fc.weight.device
            self.successors = SuccessorTable(model.config.vocab_size, model.config.successor_table_size, device)
        self.kv: list[tuple[Tensor, Tensor]] = []
        self.positions = self.valid = self.lengths = None
        self.copy_tables: CopyTables | None = None
        self.history: TokenHistory | None = None
        if model.config.copy_candidates:
            self.copy_tables = CopyTables.from_config(model.config, model.fc.weight.device)

    @torch.no_grad()
    def start(self, tokens: Tensor, hidden: Tensor, lengths: Tensor) -> None:
        bs, length = tokens.shape
        self.positions = torch.arange(length, device=tokens.device)[None].expand(bs, -1)
        self.valid = self.positions < lengths[:, None]
        self.lengths = lengths.clone()
        self.kv = self.model.context_key_values(self.model.project_context(hidden), self.positions)
        if self.copy_tables is not None:
            self.history = TokenHistory(tokens, lengths, self.config.copy_history_window - 1)
        self._compact()

    @torch.no_grad()
    def extend(self, tokens: Tensor, hidden: Tensor, keep: Tensor) -> None:
        q = tokens.shape[1]
        pos = self.lengths[:, None] + torch.arange(q, device=tokens.device)[None]
        new_kv = self.model.context_key_values(self.model.project_context(hidden), pos)
        self.kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.kv, new_kv)]
        self.positions = torch.cat([self.positions, pos], 1)
        self.valid = torch.cat([self.valid, torch.arange(q, device=tokens.device)[None] < keep[:, None]], 1)
        self.lengths = self.lengths + keep
        if self.history is not None:
            self.history.extend(tokens, keep)
        self._compact()

    def select(self, rows: Tensor) -> None:
        self.kv = [(k[rows], v[rows]) for k, v in self.kv]
        self.positions, self.valid, self.lengths = self.positions[rows], self.valid[rows], self.lengths[rows]
        if self.history is not None:
            self.history.select(rows)
        self._compact()

    def _compact(self) -> None:
        window = self.config.sliding_window
        # Slots that left every row's window are dropped too: the next anchor sits at `lengths`.
        self.valid = self.valid & (self.positions >= (self.lengths[:, None] - window))
        if bool(self.valid.all()):
            return
        index, self.valid = compact_order(self.valid)
        self.positions = gather_slots(self.positions, index, 1)
        self.kv = [(gather_slots(k, index, 2), gather_slots(v, index, 2)) for k, v in self.kv]

    @torch.no_grad()
    def draft(self, anchor_ids: Tensor) -> tuple[Tensor, Tensor, CopyCandidates | None]:
        """One draft forward after anchor_ids [bs]: (hidden [bs, B, H], logits [bs, N, V], the copy
        chains of the rows' histories, None without copy candidates)."""
        cfg, model = self.config, self.model
        bs, blk = anchor_ids.shape[0], cfg.block_size
        positions = self.lengths[:, None] + torch.arange(blk, device=anchor_ids.device)[None]
        ctx_mask = self.valid[:, None, :].expand(bs, blk, -1)
        mask = torch.cat([ctx_mask, torch.ones(bs, blk, blk, dtype=torch.bool, device=anchor_ids.device)], 2)
        hidden = model(anchor_ids[:, None], positions, self.kv, mask).hidden          # [bs, B, H]
        logits = model.logits(hidden[:, 1:])                                            # [bs, N, V]
        copies = None
        if self.history is not None:
            history, lengths = self.history.with_anchor(anchor_ids)
            copies = copy_candidates(history, lengths, cfg, self.copy_tables, blk - 1, logits[:, 0].argmax(-1))
        return hidden, logits, copies

    @torch.no_grad()
    def propose(self, anchor_ids: Tensor, temperature: Tensor, generator: torch.Generator | None) -> Proposal:
        cfg, model = self.config, self.model
        hidden, logits, copies = self.draft(anchor_ids)
        sel = select_tokens(logits, anchor_ids, temperature, mode=cfg.selection, top_k=cfg.selection_top_k,
                            lam=cfg.transition_lambda, scorer=model.transition, table=model.transfer_table(),
                            successors=self.successors, generator=generator, copies=copies)
        conf = model.confidence_logits(hidden[:, 1:])
        return Proposal(tokens=sel.tokens, cand_ids=sel.cand_ids, q=sel.q,
                        confidence=None if conf is None else torch.sigmoid(conf.float()))
