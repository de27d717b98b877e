"""The lossless reference engine: `generate(target, drafter, prompts, ...)`.

One round per step for every active row: the drafter proposes N = B-1 tokens after the row's
anchor, the target verifies anchor + proposals in one forward, acceptance keeps the longest valid
prefix plus the target's own next token, both caches commit exactly the emitted tokens. With
`drafter=None` the same loop is plain decoding (one token per step), the baseline every
speculative output is compared against. A `verify_budget` caps each row's verify length (dynamic
verification); one that is also a `SpeculationSwitch` can make a round plain decoding. Rows finish
independently (stop token or `max_new_tokens`) and leave the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from dspine.engine.acceptance import SamplingParams, accept_tokens, sample_tokens, warp_probs
from dspine.model.drafter import DSpineDrafter
from dspine.engine.proposer import DSpineProposer, Proposal, Proposer
from dspine.engine.target_runner import TargetRunner, TransformersTargetRunner

VerifyBudget = Callable[[Proposal], Tensor]
"""Dynamic verification hook: a proposal -> verify lengths [bs] in 0..N."""


def make_target_runner(model, layer_ids: list[int]) -> TargetRunner:
    """The runner for `model`: hybrid Gated-DeltaNet targets (config `layer_types` with
    "linear_attention") verify with ReplaySSM; every other causal LM uses the KV-cache runner."""
    if "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
        from dspine.engine.hybrid_target import HybridTargetRunner

        return HybridTargetRunner(model, layer_ids)
    return TransformersTargetRunner(model, layer_ids)


@runtime_checkable
class SpeculationSwitch(Protocol):
    """A verify budget that can also turn drafting off: before every round, `speculate(rows)` says
    whether this round drafts and verifies (True) or decodes plainly (False: one target step; the
    drafter still follows the committed tokens, so it can draft again in any later round). After
    every drafting round, `drafted(seconds)` gets its wall time, the drafter's catch-up over the
    plain steps before it included."""

    def speculate(self, rows: int) -> bool: ...

    def drafted(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class RoundTiming:
    """One decode round of a batch: `rows` active rows; `verify_tokens` tokens the target's forward
    ran (rows x (1 + the padded verify width); rows for plain decoding); `seconds` of wall time
    (draft + verify + accept + commit; the round reads its tokens back to the host, which syncs)."""

    rows: int
    verify_tokens: int
    seconds: float


@dataclass
class GenerationStats:
    """Counts of what the outputs hold, never more: `emitted` = every returned token (the one sampled
    at prefill included) = sum of the outputs' lengths; `decode_tokens` = the tokens the decode
    rounds added to them (a round's accepted + bonus tokens count only up to the row's
    `max_new_tokens` and its stop token), so emitted = decode_tokens + the prefill's token of every
    prompt (none when max_new_tokens is 0). tau = decode_tokens / row_rounds (tokens per round per row);
    tokens_per_s = decode_tokens over the decode phase's wall time; per_position_accept[j]: share of
    verified rounds whose proposal j+1 the target accepted (what verification found, budget or not);
    round_timings: every decode round's size and wall time (the reference engine's step-time record)."""

    rounds: int = 0
    row_rounds: int = 0
    emitted: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    verified_tokens: int = 0
    round_timings: list[RoundTiming] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.decode_tokens / max(self.row_rounds, 1)

    @property
    def per_position_accept(self) -> list[float]:
        return [a / v if v else 0.0 for a, v in zip(self.accepted_per_position, self.verified_per_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def mean_verify_tokens(self) -> float:
        return self.verified_tokens / max(self.row_rounds, 1)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "row_rounds": self.row_rounds, "emitted_tokens": self.emitted,
                "decode_tokens": self.decode_tokens, "tau": self.tau, "per_position_accept": self.per_position_accept,
                "tokens_per_s": self.tokens_per_s, "decode_seconds": self.decode_seconds,
                "prefill_seconds": self.prefill_seconds, "mean_verify_tokens": self.mean_verify_tokens}


@dataclass
class GenerationResult:
    tokens: list[list[int]]     # generated token ids per prompt (prompt excluded, stop token included)
    stats: GenerationStats
    texts: list[str] | None = None


def generate(target, drafter: DSpineDrafter | Proposer | None, prompts: list[list[int]] | list[str], *,
             tokenizer=None, chat: bool = True, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, stop_token_ids: list[int] | None = None, seed: int = 0,
             batch_size: int | None = None, verify_budget: VerifyBudget | None = None,
             progress: bool = False) -> GenerationResult:
    """Generate for every prompt; speculative when `drafter` is given, plain decoding otherwise.

    prompts: token-id lists, or strings (then `tokenizer` is required; `chat=True` applies its
    chat template). Greedy when temperature == 0. Returns tokens per prompt and the run's stats.
    """
    prompt_ids = _encode(prompts, tokenizer, chat)
    if stop_token_ids is None and tokenizer is not None:
        stop_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stop_token_ids = list(stop_token_ids or [])
    proposer = DSpineProposer(drafter) if isinstance(drafter, DSpineDrafter) else drafter
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    stats = GenerationStats()
    outputs: list[list[int]] = []
    batch_size = batch_size or len(prompt_ids)
    bar = _progress(len(prompt_ids), progress)
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        outputs += _generate_batch(target, proposer, chunk, max_new_tokens, stop_token_ids, device, generator,
                                   SamplingParams.uniform(len(chunk), temperature, top_k, top_p, device),
                                   verify_budget, stats)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in outputs] if tokenizer is not None else None
    return GenerationResult(tokens=outputs, stats=stats, texts=texts)


def _generate_batch(target, proposer: Proposer | None, prompts: list[list[int]], max_new: int, stops: list[int],
                    device, generator: torch.Generator, params: SamplingParams, verify_budget: VerifyBudget | None,
                    stats: GenerationStats) -> list[list[int]]:
    layer_ids = proposer.layer_ids if proposer is not None else []
    runner = make_target_runner(target, layer_ids)
    t0 = time.perf_counter()
    step = runner.prefill(prompts)
    last = runner.lengths - 1
    rows_all = torch.arange(len(prompts), device=device)
    anchor = sample_tokens(warp_probs(step.logits[rows_all, last][:, None], params)[:, 0], generator)
    out = [[int(a)] for a in anchor]
    if proposer is not None:
        ids = torch.zeros(len(prompts), int(runner.lengths.max()), dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, device=device)
        proposer.start(ids, step.hidden, runner.lengths)
    _sync(device)
    stats.prefill_seconds += time.perf_counter() - t0
    t0 = time.perf_counter()
    switch = verify_budget if isinstance(verify_budget, SpeculationSwitch) else None   # checked once, not per round
    active = list(range(len(prompts)))                     # batch row -> prompt index
    unseen: list[tuple[Tensor, Tensor]] = []               # plain steps (ids, hidden) not yet shown to the drafter
    while True:
        keep_rows = [r for r, i in enumerate(active) if not _finished(out[i], max_new, stops)]
        if not keep_rows:
            break
        if len(keep_rows) < len(active):
            rows = torch.tensor(keep_rows, device=device)
            runner.select(rows)
            if proposer is not None:
                _catch_up(proposer, unseen)
                proposer.select(rows)
            params, anchor = params.select(rows), anchor[rows]
            active = [active[r] for r in keep_rows]
        round_start = time.perf_counter()
        plain = proposer is None or (switch is not None and not switch.speculate(len(active)))
        if plain:
            step_ids = anchor[:, None]
            step = runner.verify(step_ids)
            anchor = sample_tokens(warp_probs(step.logits, params)[:, 0], generator)
            runner.commit(torch.ones_like(anchor))
            if proposer is not None:
                unseen.append((step_ids, step.hidden))
            emitted = [[int(a)] for a in anchor]
            _count(stats, len(active), None, None)
            fed = len(active)
        else:
            _catch_up(proposer, unseen)
            anchor, emitted, fed = _speculative_round(runner, proposer, anchor, params, generator, verify_budget,
                                                      stats)
        seconds = time.perf_counter() - round_start
        stats.round_timings.append(RoundTiming(len(active), fed, seconds))
        if not plain and switch is not None:
            switch.drafted(seconds)
        for r, i in enumerate(active):
            stats.decode_tokens += _kept(out[i], emitted[r], max_new, stops)
            out[i].extend(emitted[r])
    _sync(device)
    stats.decode_seconds += time.perf_counter() - t0
    outputs = [_truncate(o, max_new, stops) for o in out]
    stats.emitted += sum(len(o) for o in outputs)
    return outputs


def _catch_up(proposer: Proposer, unseen: list[tuple[Tensor, Tensor]]) -> None:
    """Show the drafter the plain steps since its last round, all in one `extend` (the same context
    as one `extend` per step), and empty `unseen`."""
    if unseen:
        ids = torch.cat([i for i, _ in unseen], 1)
        hidden = None if unseen[0][1] is None else torch.cat([h for _, h in unseen], 1)   # None: no layer_ids
        proposer.extend(ids, hidden, torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long, device=ids.device))
        unseen.clear()


def _speculative_round(runner: TargetRunner, proposer: Proposer, anchor: Tensor, params: SamplingParams,
                       generator: torch.Generator, verify_budget: VerifyBudget | None,
                       stats: GenerationStats) -> tuple[Tensor, list[list[int]], int]:
    """One round; returns the next anchors [bs], the tokens each row emitted, and the number of
    tokens the target's verify forward ran (bs x (1 + padded width))."""
    prop = proposer.propose(anchor, params.temperature, generator)
    n = prop.tokens.shape[1]
    verify_lens = verify_budget(prop) if verify_budget is not None else torch.full_like(anchor, n)
    width = int(verify_lens.max())
    block = torch.cat([anchor[:, None], prop.tokens[:, :width]], dim=1)              # [bs, 1 + width]
    step = runner.verify(block)
    probs = warp_probs(step.logits, params)
    # A round verifying no proposal at all (width 0) has no q to reject against: plain sampling.
    cand = None if prop.cand_ids is None or width == 0 else prop.cand_ids[:, :width]
    q = None if prop.q is None or width == 0 else prop.q[:, :width]
    accept_len, bonus = accept_tokens(prop.tokens[:, :width], probs, verify_lens, cand_ids=cand, q=q,
                                      generator=generator)
    keep = accept_len + 1
    runner.commit(keep)
    proposer.extend(block, step.hidden, keep)
    toks = prop.tokens.tolist()
    emitted = [toks[r][: int(a)] + [int(b)] for r, (a, b) in enumerate(zip(accept_len, bonus))]
    _count(stats, len(emitted), accept_len, verify_lens)
    return bonus, emitted, block.numel()


def _count(stats: GenerationStats, rows: int, accept_len: Tensor | None, verify_lens: Tensor | None) -> None:
    """One round of `rows` rows: its verify cost and per-position acceptance (tokens are counted
    where they join the outputs, `_kept`)."""
    stats.rounds += 1
    stats.row_rounds += rows
    stats.verified_tokens += rows if verify_lens is None else int(verify_lens.sum()) + rows
    if accept_len is None:
        return
    n = int(verify_lens.max())
    if len(stats.verified_per_position) < n:
        pad = n - len(stats.verified_per_position)
        stats.verified_per_position += [0] * pad
        stats.accepted_per_position += [0] * pad
    for j in range(n):
        stats.verified_per_position[j] += int((verify_lens > j).sum())
        stats.accepted_per_position[j] += int((accept_len > j).sum())


def _kept(tokens: list[int], new: list[int], max_new: int, stops: list[int]) -> int:
    """How many of a round's `new` tokens survive in the output after `tokens` (an unfinished row):
    at most the `max_new - len(tokens)` left, and none past the first stop token."""
    budget = max_new - len(tokens)
    stop = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
    return min(budget, stop)


def _finished(tokens: list[int], max_new: int, stops: list[int]) -> bool:
    return len(tokens) >= max_new or any(t in stops for t in tokens)


def _truncate(tokens: list[int], max_new: int, stops: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: min(i + 1, max_new)]
    return tokens[:max_new]


def _encode(prompts, tokenizer, chat: bool) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts given")
    if isinstance(prompts[0], str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: pass tokenizer=..., or give token-id lists")
        if chat:
            return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False) for p in prompts]
        return [tokenizer(p)["input_ids"] for p in prompts]
    return [list(p) for p in prompts]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="prompt")
