"""Copy candidates: tokens copied from the request's own context, for the selection lattice.

Answers in long agentic sessions copy long spans of their context (tool results, file contents).
Each round, the row's token history (prompt + accepted output, ending with the anchor; its last
`copy_history_window` tokens) is searched for the most recent longest earlier occurrence of its own
suffix (`kernels.suffix_match`, `find_copies`); the tokens after that occurrence are the copy tokens
s_i of proposal slots i = 0, 1, ... (chain 0). With `copy_rematch` a second chain is matched again
after the drafter's own first-slot choice, for the later slots (`copy_candidates`): where the
history has no match, or chain 0 is wrong from the first token, a right first token often starts a
copy. `selection.copy_lattice` adds each chain's s_i to slot i's candidates.

Scores: rho(m, i), the log-odds that s_i is the target's next token, by match length m (bucketed;
`copy_match_buckets` are the buckets' lower edges) and slot i (the last column serves every later
slot), in two tables of the drafter config, [buckets, slots] each:
- `copy_follow_log_odds`: the walk reaches slot i on the copied span (it picked s_{i-1}; slot 0
  always, its predecessor the anchor ends the match): P(s_i is next | s_0 .. s_{i-1} were);
- `copy_reenter_log_odds`: it reaches slot i from another token: P(s_i is next | s_{i-1} was not)
  (column 0 repeats the follow table's: slot 0 is always on the span).
`selection.copy_scores` turns rho into lattice scores (`copy_score`). The tables are fitted from
token histories (`count_copy_outcomes`, then `fit_copy_tables`); this runs the target greedily on
trace requests (with --recorded: takes the assistant messages recorded in them instead) and prints
the fitted config fields:

    python -m dspine.model.copy_candidates benchmarks/traces/*.jsonl --out copy_scores.json

A constant score instead of the calibrated one is the 1 x 1 table (`constant_copy_scores`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dspine.kernels import dispatch
from dspine.kernels.suffix_match import suffix_match_reference
from dspine.model.config import DSpineConfig
from dspine.model.selection import CopyCandidates


def extend_history(history: Tensor, lengths: Tensor, token: Tensor) -> tuple[Tensor, Tensor]:
    """history [bs, W] right-padded, lengths [bs], token [bs] -> (history [bs, W+1] with `token`
    after each row's last token, lengths + 1)."""
    grown = torch.cat([history, torch.zeros_like(history[:, :1])], 1)
    return grown.scatter(1, lengths.long()[:, None], token.to(grown.dtype)[:, None]), lengths + 1


class TokenHistory:
    """Each row's most recent committed tokens, right-padded: tokens [bs, H] int64, lengths [bs].
    At most `capacity` tokens a row: older ones drop out and the rest move to the front."""

    def __init__(self, tokens: Tensor, lengths: Tensor, capacity: int):
        self.capacity = capacity
        self.tokens, self.lengths = tokens.long(), lengths.long().clone()
        self._trim()

    def extend(self, tokens: Tensor, keep: Tensor) -> None:
        """tokens [bs, q]; the first keep[b] of row b are committed."""
        slots = self.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None]
        grown = torch.cat([self.tokens, torch.zeros_like(tokens, dtype=torch.long)], 1)
        self.tokens = grown.scatter(1, slots, tokens.long())
        self.lengths = self.lengths + keep
        self._trim()

    def select(self, rows: Tensor) -> None:
        self.tokens, self.lengths = self.tokens[rows], self.lengths[rows]
        self._trim()

    def with_anchor(self, anchor_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The histories with each row's anchor appended: (tokens [bs, H+1] int64, lengths [bs])."""
        return extend_history(self.tokens, self.lengths, anchor_ids)

    def _trim(self) -> None:
        drop = (self.lengths - self.capacity).clamp(min=0)
        self.lengths = self.lengths - drop
        width = int(self.lengths.max()) if self.lengths.numel() else 0
        if width == self.tokens.shape[1] and not bool(drop.any()):
            return
        index = (drop[:, None] + torch.arange(width, device=drop.device)[None]).clamp(max=self.tokens.shape[1] - 1)
        self.tokens = self.tokens.gather(1, index)


def find_copies(history: Tensor, lengths: Tensor, cfg: DSpineConfig, n: int) -> tuple[Tensor, Tensor]:
    """history [bs, W] right-padded (ending with the anchor), lengths [bs] -> (copy_ids [bs, n] int64,
    -1 where none; match_len [bs] int64, 0 without a match), by the config's copy settings: the
    Triton kernel on `dispatch.use_triton` tensors, the PyTorch reference elsewhere."""
    span = n if cfg.copy_max_span is None else min(cfg.copy_max_span, n)
    args = dict(n=n, min_match=cfg.copy_min_match, max_match=cfg.copy_max_match, max_span=span,
                window=cfg.copy_history_window)
    if dispatch.use_triton(history):
        from dspine.kernels.suffix_match import suffix_match
        return suffix_match(history, lengths, **args)
    return suffix_match_reference(history, lengths, **args)


def match_bucket(edges: Tensor, match_len: Tensor) -> Tensor:
    """edges [B] (ascending lower edges), match_len [...] -> bucket index [...]: the last edge <=
    match_len (0 below the first)."""
    return (torch.searchsorted(edges, match_len.contiguous(), right=True) - 1).clamp(min=0)


@dataclass
class CopyTables:
    """The config's score tables on a device: edges [B] int64 (lower edges of the match-length
    buckets, ascending), follow / reenter [B, O] fp32 log-odds by bucket and slot."""

    edges: Tensor
    follow: Tensor
    reenter: Tensor

    @classmethod
    def from_config(cls, cfg: DSpineConfig, device: torch.device | str = "cpu") -> "CopyTables":
        return cls(torch.tensor(cfg.copy_match_buckets, dtype=torch.long, device=device),
                   torch.tensor(cfg.copy_follow_log_odds, dtype=torch.float32, device=device),
                   torch.tensor(cfg.copy_reenter_log_odds, dtype=torch.float32, device=device))

    def lookup(self, match_len: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """match_len [bs] -> (follow, reenter) [bs, n]: each row's bucket, slots 0..n-1 (slots past
        the tables' last column read that column)."""
        slot = torch.arange(n, device=match_len.device).clamp(max=self.follow.shape[1] - 1)
        bucket = match_bucket(self.edges, match_len)
        return self.follow[bucket][:, slot], self.reenter[bucket][:, slot]


# rho of a re-matched chain's first copy token when the path reaches it off the chain's entry: the
# copy was matched after that entry, so elsewhere it is (almost) never the target's next token.
REMATCH_OFF_ENTRY_LOG_ODDS = -30.0


def copy_candidates(history: Tensor, lengths: Tensor, cfg: DSpineConfig, tables: CopyTables, n: int,
                    first_draft: Tensor | None = None) -> CopyCandidates:
    """The copy chains of n proposal slots after each row's history [bs, W] (ending with the anchor),
    lengths [bs]:

    - chain 0: `find_copies` on the history, scored by `tables`;
    - with `cfg.copy_rematch`, chain 1 after the drafter's first-slot choice first_draft [bs]: that
      token as the chain's entry at slot 0, then `find_copies` on the history extended by it for
      slots 1.., scored by the tables one column back (copying after a right first token is copying
      from the next anchor: the same statistics) and entered off its entry with
      `REMATCH_OFF_ENTRY_LOG_ODDS`. A row whose chain 0 starts with first_draft has no chain 1: it
      would re-match the suffix chain 0 already continues."""
    ids, match_len = find_copies(history, lengths, cfg, n)
    follow, reenter = tables.lookup(match_len, n)
    chains = [(ids, follow, reenter, ids >= 0)]
    if cfg.copy_rematch:
        if first_draft is None:
            raise ValueError("copy_rematch needs the drafter's first-slot tokens (first_draft)")
        grown, grown_lengths = extend_history(history, lengths, first_draft)
        after, after_len = find_copies(grown, grown_lengths, cfg, n - 1)
        after = torch.where(ids[:, :1] == first_draft[:, None], -1, after)
        follow1, reenter1 = tables.lookup(after_len, n)
        entry = torch.full_like(follow1[:, :1], REMATCH_OFF_ENTRY_LOG_ODDS)
        chains.append((torch.cat([first_draft.long()[:, None], after], 1),
                       torch.cat([follow1[:, :1], follow1[:, :-1]], 1),
                       torch.cat([reenter1[:, :1], entry, reenter1[:, 1:-1]], 1),
                       torch.cat([torch.zeros_like(after[:, :1], dtype=torch.bool), after >= 0], 1)))
    ids, follow, reenter, scored = (torch.stack(parts, 1) for parts in zip(*chains))
    return CopyCandidates(ids=ids, follow=follow, reenter=reenter, scored=scored, mode=cfg.copy_score)


def constant_copy_scores(follow: float, reenter: float, mode: str = "logit") -> dict:
    """Config fields of a constant score (no calibration): rho = follow on the copied span (slot 0
    included), reenter off it. With mode "logit" a copy token's draft logit gains `follow` at slot 0
    and `reenter` after, and the pair copy(i-1) -> copy(i) gains `follow - reenter`."""
    return {"copy_score": mode, "copy_match_buckets": [1], "copy_follow_log_odds": [[float(follow)]],
            "copy_reenter_log_odds": [[float(reenter)]]}


# ------------------------------------------------------------------------------------------ fitting
@dataclass
class CopyCounts:
    """Outcomes of copy tokens by match bucket and slot, [B, O] int64 each. follow: s_i when
    s_0 .. s_{i-1} all were the next tokens (slot 0: every copy); reenter: s_i when s_{i-1} was not
    (slot 0: none). *_hits counts those where s_i was the next token too."""

    follow_trials: Tensor
    follow_hits: Tensor
    reenter_trials: Tensor
    reenter_hits: Tensor

    @classmethod
    def zeros(cls, buckets: int, slots: int) -> "CopyCounts":
        return cls(*(torch.zeros(buckets, slots, dtype=torch.long) for _ in range(4)))

    def add(self, other: "CopyCounts") -> None:
        for name in ("follow_trials", "follow_hits", "reenter_trials", "reenter_hits"):
            getattr(self, name).add_(getattr(other, name))


def count_copy_outcomes(tokens: Sequence[int], start: int, cfg: DSpineConfig, chunk: int = 128) -> CopyCounts:
    """Copy outcomes of one token history: every position t >= start (each token the target
    produced: positions where decoding anchors) with a next token is an anchor; its copy tokens
    (`find_copies` on tokens[:t+1], the config's copy settings and slots, every match counted:
    `copy_min_match` gates their use, not their statistics) are compared with the tokens that
    actually followed. Buckets: `copy_match_buckets`; slots: the config's proposals."""
    cfg = cfg.replace(copy_min_match=1)
    edges = torch.tensor(cfg.copy_match_buckets, dtype=torch.long)
    n = cfg.num_proposals
    counts = CopyCounts.zeros(len(edges), n)
    history = torch.tensor(list(tokens), dtype=torch.long)
    total = history.numel()
    slot = torch.arange(n)
    padded = torch.cat([history, torch.full((n + 1,), -1, dtype=torch.long)])
    for lo in range(max(start, 0), total - 1, chunk):
        anchors = torch.arange(lo, min(lo + chunk, total - 1))                         # [T]
        rows = history[None].expand(anchors.numel(), -1)
        ids, match_len = find_copies(rows, anchors + 1, cfg, n)                        # [T, n], [T]
        nxt = padded[anchors[:, None] + 1 + slot]                                      # [T, n], -1 past the end
        exists = (ids >= 0) & (nxt >= 0)
        hit = exists & (ids == nxt)
        before = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].long().cumprod(1).bool()], 1)
        follow = exists & before
        reenter = torch.cat([torch.zeros_like(hit[:, :1]), exists[:, 1:] & exists[:, :-1] & ~hit[:, :-1]], 1)
        cell = (match_bucket(edges, match_len)[:, None].expand(-1, n), slot[None].expand(anchors.numel(), -1))
        for name, mask in (("follow_trials", follow), ("follow_hits", follow & hit),
                           ("reenter_trials", reenter), ("reenter_hits", reenter & hit)):
            getattr(counts, name).index_put_(cell, mask.long(), accumulate=True)
    return counts


def _shrunk_rates(trials: Tensor, hits: Tensor, prior: float) -> Tensor:
    """Hit rates [B, O], each cell shrunk toward its bucket's rate, that toward the overall rate
    (`prior` pseudo-trials at each level; the overall rate itself has one pseudo-hit and -miss)."""
    overall = (hits.sum() + 1.0) / (trials.sum() + 2.0)
    bucket = (hits.sum(1, keepdim=True) + prior * overall) / (trials.sum(1, keepdim=True) + prior)
    return (hits + prior * bucket) / (trials + prior)


def fit_copy_tables(counts: CopyCounts, edges: Sequence[int], prior: float = 8.0) -> dict:
    """Config fields `copy_match_buckets`, `copy_follow_log_odds`, `copy_reenter_log_odds` fitted to
    `counts`: the log-odds of each cell's hit rate (`_shrunk_rates`: empty and sparse cells borrow
    from their bucket). Column 0 of the reenter table repeats the follow table's."""
    follow = _shrunk_rates(counts.follow_trials.double(), counts.follow_hits.double(), prior)
    reenter = _shrunk_rates(counts.reenter_trials[:, 1:].double(), counts.reenter_hits[:, 1:].double(), prior)
    reenter = torch.cat([follow[:, :1], reenter], 1)

    def log_odds(p: Tensor) -> list[list[float]]:
        return [[round(math.log(v / (1.0 - v)), 3) for v in row] for row in p.tolist()]

    return {"copy_match_buckets": [int(e) for e in edges], "copy_follow_log_odds": log_odds(follow),
            "copy_reenter_log_odds": log_odds(reenter)}


def fit_from_histories(histories: Sequence[tuple[Sequence[int], int]], cfg: DSpineConfig,
                       prior: float = 8.0) -> tuple[dict, CopyCounts]:
    """(token history, first anchor position) pairs -> (the fitted config fields, their counts),
    with `cfg`'s copy settings, buckets and slots."""
    counts = CopyCounts.zeros(len(cfg.copy_match_buckets), cfg.num_proposals)
    for tokens, start in histories:
        counts.add(count_copy_outcomes(tokens, start, cfg))
    return fit_copy_tables(counts, cfg.copy_match_buckets, prior), counts


def plain_messages(messages: Sequence[dict], tools: Sequence[dict] = ()) -> list[dict]:
    """OpenAI chat messages for a chat template without tool support: tool calls become their JSON
    as the message's content, the tools a leading system message."""
    out = [dict(m, content=m.get("content") if m.get("content") is not None else json.dumps(m.get("tool_calls")))
           for m in messages]
    return ([{"role": "system", "content": "Tools: " + json.dumps(list(tools))}] if tools else []) + out


def recorded_histories(messages: Sequence[dict], render) -> list[tuple[list[int], int]]:
    """(token history, first anchor position) for every assistant message with text content of one
    conversation: the conversation rendered up to and including it, anchors from its first token.
    render(messages, prompt) -> token ids of the chat template (prompt: add the generation prompt)."""
    out = []
    for k, msg in enumerate(messages):
        if k and msg.get("role") == "assistant" and isinstance(msg.get("content"), str) and msg["content"]:
            prompt, full = render(messages[:k], True), render(messages[: k + 1], False)
            if full[: len(prompt)] == prompt and len(full) > len(prompt) + 1:
                out.append((full, len(prompt)))
    return out


if __name__ == "__main__":
    # The engine imports this module: only the script imports the engine back.
    from jinja2 import TemplateError

    from dspine.data.traces import load_traces
    from dspine.engine.generate import generate
    from dspine.engine.targets import load_target, load_tokenizer, stop_token_ids
    from dspine.model.checkpoint import default_drafter_dir, read_config, resolve_checkpoint_dir

    parser = argparse.ArgumentParser(prog="python -m dspine.model.copy_candidates",
                                     description="Fit the copy-score tables of a drafter config from token histories.")
    parser.add_argument("traces", nargs="+", help="trace files (JSONL of OpenAI requests, ShareGPT)")
    parser.add_argument("--recorded", action="store_true",
                        help="histories of the assistant messages recorded in the requests (no target run); "
                             "default: the target's greedy answer to every request")
    parser.add_argument("--target", default=None, help="target (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="drafter whose copy settings to fit (default: the bundled)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=None, help="the first N requests only")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--prior", type=float, default=8.0, help="pseudo-trials a cell borrows from its bucket")
    parser.add_argument("--out", default=None, help="also write the fields and the counts to this JSON file")
    args = parser.parse_args()
    drafter_cfg = read_config(resolve_checkpoint_dir(args.drafter) if args.drafter else default_drafter_dir())
    target, tokenizer = (None, load_tokenizer(args.target)[0]) if args.recorded else load_target(args.target)
    requests = load_traces(args.traces)[: args.limit]

    def render(messages, prompt: bool, tools=()) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, tokenize=False,
                                                 add_generation_prompt=prompt)
        except TemplateError:
            text = tokenizer.apply_chat_template(plain_messages(messages, tools), tokenize=False,
                                                 add_generation_prompt=prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    if args.recorded:
        unique = {tuple(t): s for r in requests for t, s in
                  recorded_histories(r.messages, lambda m, p, r=r: render(m, p, r.tools))}
        histories = [(list(t), s) for t, s in unique.items()]
    else:
        prompts = [render(r.messages, True, r.tools) for r in requests]
        answers = generate(target, None, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                           stop_token_ids=stop_token_ids(tokenizer, target), progress=True).tokens
        histories = [(p + a, len(p)) for p, a in zip(prompts, answers)]
    fields, counts = fit_from_histories(histories, drafter_cfg, args.prior)
    print(json.dumps(fields))
    if args.out:
        record = {**fields, "histories": len(histories), "answer_tokens": sum(len(t) - s for t, s in histories),
                  "counts": {k: v.tolist() for k, v in vars(counts).items()}, "argv": sys.argv[1:]}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
