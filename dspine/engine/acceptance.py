"""Lossless acceptance of drafted tokens against the target's distributions.

Every emitted token is distributed exactly as the target's (after temperature / top-k / top-p):
- greedy rows (temperature 0): the warped distribution is the one-hot argmax, so a proposal is
  accepted iff it equals the target's argmax, and the bonus is that argmax;
- rows with a proposal distribution q: rejection sampling — accept x_j with probability
  min(1, p_j(x_j) / q_j(x_j)); at the first rejection sample the bonus from norm(max(p - q, 0));
- rows without q: accept while the proposal equals the target's own sample at that position; the
  bonus is the target's sample at the first mismatch.
A verify length m_b < N caps acceptance: the bonus is then drawn from p_{m_b} (no residual), as if
only m_b tokens had been proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """Per-row sampling settings, each [bs]: temperature (0 = greedy), top_k (0 = off), top_p (1 = off)."""

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor

    @classmethod
    def uniform(cls, bs: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                device: torch.device | str = "cpu") -> "SamplingParams":
        return cls(torch.full((bs,), float(temperature), device=device), torch.full((bs,), int(top_k), device=device),
                   torch.full((bs,), float(top_p), device=device))

    def select(self, rows: Tensor) -> "SamplingParams":
        return SamplingParams(self.temperature[rows], self.top_k[rows], self.top_p[rows])


def warp_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [bs, q, V] -> target probabilities [bs, q, V] fp32 after temperature, top-k, top-p.
    Greedy rows are the one-hot argmax of the raw logits."""
    logits = logits.float()
    bs, _, vocab = logits.shape
    greedy = params.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature).float()
    scaled = logits / temp[:, None, None]
    k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, vocab)).clamp(max=vocab)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    keep = (rank[None, None, :] < k[:, None, None]).expand_as(sorted_logits).clone()
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep &= mass_before < params.top_p.float()[:, None, None]
    keep[..., 0] = True
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    return torch.where(greedy[:, None, None], one_hot, probs)


def sample_tokens(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """probs [n, V] -> samples [n]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept_tokens(proposals: Tensor, target_probs: Tensor, verify_lens: Tensor, *, cand_ids: Tensor | None = None,
                  q: Tensor | None = None, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """proposals [bs, N]; target_probs [bs, N+1, V] (row j: the target's distribution for block
    slot j+1, i.e. after the anchor and j proposals); verify_lens [bs] in 0..N; cand_ids / q
    [bs, N, K]: the proposal distribution (rejection sampling) or None (match the target sample).

    Returns (accept_len [bs] in 0..verify_lens, bonus [bs]). The round emits
    proposals[:accept_len] followed by bonus.
    """
    bs, n = proposals.shape
    rows = torch.arange(bs, device=proposals.device)
    slots = torch.arange(n, device=proposals.device)
    p_tok = target_probs[:, :n].gather(-1, proposals[..., None]).squeeze(-1)          # [bs, N]
    if q is None:
        target_samples = sample_tokens(target_probs.reshape(-1, target_probs.shape[-1]), generator).view(bs, n + 1)
        ok = proposals == target_samples[:, :n]
    else:
        q_tok = (q * (cand_ids == proposals[..., None])).sum(-1)                       # [bs, N]
        u = torch.rand(bs, n, generator=generator, device=proposals.device)
        ok = u * q_tok < p_tok                                 # u < p/q, and never when p = 0
    ok &= slots[None] < verify_lens[:, None]
    accept_len = ok.long().cumprod(-1).sum(-1)                                         # [bs]
    p_next = target_probs[rows, accept_len]                                            # [bs, V]
    if q is None:
        return accept_len, target_samples[rows, accept_len]
    rejected = accept_len < verify_lens
    slot = accept_len.clamp(max=n - 1)
    q_dense = torch.zeros_like(p_next).scatter_add_(-1, cand_ids[rows, slot], q[rows, slot])
    residual = (p_next - q_dense).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    bonus_dist = torch.where(rejected[:, None], residual, p_next)
    return accept_len, sample_tokens(bonus_dist, generator)
