"""Greedy speculative decoding is token-identical to plain greedy decoding (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import drafter_for, fixed_prompts, tiny_qwen2
from dspine import generate
from dspine.engine.proposer import Proposal

PROMPTS = 24
MAX_NEW = 40


class TargetOracleProposer:
    """Proposes exactly the target's own greedy continuation: every proposal must be accepted.

    With `corrupt_seed`, one random slot per round is replaced by a wrong token, so exactly the
    slots before it are accepted: partial acceptance of every length, deterministically."""

    def __init__(self, target, block_size: int, corrupt_seed: int | None = None):
        self.target, self.block_size, self.layer_ids = target, block_size, []
        self.seqs: list[list[int]] = []
        self.rng = None if corrupt_seed is None else torch.Generator().manual_seed(corrupt_seed)

    def start(self, tokens, hidden, lengths):
        self.seqs = [tokens[b, : int(n)].tolist() for b, n in enumerate(lengths)]

    def extend(self, tokens, hidden, keep):
        for b, k in enumerate(keep.tolist()):
            self.seqs[b] += tokens[b, :k].tolist()

    def select(self, rows):
        self.seqs = [self.seqs[r] for r in rows.tolist()]

    @torch.no_grad()
    def propose(self, anchor_ids, temperature, generator):
        out = []
        for seq, anchor in zip(self.seqs, anchor_ids.tolist()):
            ids = seq + [anchor]
            for _ in range(self.block_size - 1):
                ids.append(int(self.target(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[-(self.block_size - 1):])
        tokens = torch.tensor(out)
        if self.rng is not None:
            slot = torch.randint(0, self.block_size, (len(out),), generator=self.rng)  # block_size-1: none
            rows = torch.arange(len(out))[slot < self.block_size - 1]
            slot = slot[slot < self.block_size - 1]
            tokens[rows, slot] = (tokens[rows, slot] + 1) % self.target.config.vocab_size
        return Proposal(tokens=tokens)


@pytest.fixture(scope="module")
def plain_outputs(llama_target):
    prompts = fixed_prompts(PROMPTS, llama_target.config.vocab_size)
    return prompts, generate(llama_target, None, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[]).tokens


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("variant", [dict(), dict(injection=False, selection="argmax"), dict(transition_lambda=0.0),
                                     dict(injection_candidates="first_layer")],
                         ids=["dspine", "ablation", "lambda0", "first-layer-candidates"])
def test_random_drafter_greedy_parity(llama_target, plain_outputs, batch_size, variant):
    prompts, plain = plain_outputs
    drafter = drafter_for(llama_target, **variant)
    spec = generate(llama_target, drafter, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[], batch_size=batch_size)
    mismatches = [i for i, (a, b) in enumerate(zip(plain, spec.tokens)) if a != b]
    assert not mismatches, f"prompts {mismatches} diverge from plain greedy decoding"
    assert spec.stats.rounds > 0


@pytest.mark.parametrize("batch_size", [1, 4])
def test_oracle_drafter_reaches_block_size(llama_target, plain_outputs, batch_size):
    prompts, plain = plain_outputs
    block = 8
    oracle = TargetOracleProposer(llama_target, block)
    spec = generate(llama_target, oracle, prompts, max_new_tokens=1 + 4 * block, stop_token_ids=[],
                    batch_size=batch_size)
    assert [t for t in spec.tokens] == [p[: 1 + 4 * block] for p in plain]
    # 1 token from prefill, then exactly 4 full rounds of `block` tokens each.
    assert spec.stats.tau == pytest.approx(block)
    assert spec.stats.per_position_accept == [1.0] * (block - 1)


def test_partial_acceptance_of_every_length(llama_target, plain_outputs):
    prompts, plain = plain_outputs
    spec = generate(llama_target, TargetOracleProposer(llama_target, 8, corrupt_seed=0), prompts[:8],
                    max_new_tokens=MAX_NEW, stop_token_ids=[], batch_size=4)
    assert spec.tokens == plain[:8]
    accept = spec.stats.per_position_accept
    assert all(0.0 < a < 1.0 for a in accept), accept  # every prefix length occurred, none always


def test_stop_tokens_and_qwen3_family(qwen3_target):
    prompts = fixed_prompts(6, qwen3_target.config.vocab_size, seed=7)
    plain = generate(qwen3_target, None, prompts, max_new_tokens=30, stop_token_ids=[])
    stop = plain.tokens[0][5]
    plain_stop = generate(qwen3_target, None, prompts, max_new_tokens=30, stop_token_ids=[stop])
    spec = generate(qwen3_target, drafter_for(qwen3_target), prompts, max_new_tokens=30, stop_token_ids=[stop],
                    batch_size=3)
    assert spec.tokens == plain_stop.tokens
    assert spec.tokens[0][-1] == stop and len(spec.tokens[0]) <= 6
    assert all(len(t) <= 30 for t in spec.tokens)


def test_qwen2_family_parity():
    target = tiny_qwen2()
    prompts = fixed_prompts(8, target.config.vocab_size, seed=9)
    plain = generate(target, None, prompts, max_new_tokens=24, stop_token_ids=[])
    spec = generate(target, drafter_for(target), prompts, max_new_tokens=24, stop_token_ids=[], batch_size=4)
    assert spec.tokens == plain.tokens
