"""Speculative decoding on a hybrid Gated-DeltaNet target (Qwen3-Next-style, random weights, fp32):
greedy output token-identical to plain decoding, verification through ReplaySSM."""

from __future__ import annotations

import pytest

from conftest import drafter_for, fixed_prompts, tiny_qwen3_next
from dspine import generate
from test_engine_parity import TargetOracleProposer

PROMPTS, MAX_NEW = 20, 32


@pytest.fixture(scope="module")
def hybrid():
    target = tiny_qwen3_next()
    prompts = fixed_prompts(PROMPTS, target.config.vocab_size, seed=5)
    return target, prompts, generate(target, None, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[]).tokens


@pytest.mark.parametrize("batch_size", [1, 4])
def test_hybrid_greedy_parity_random_drafter(hybrid, batch_size):
    target, prompts, plain = hybrid
    spec = generate(target, drafter_for(target), prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                    batch_size=batch_size)
    assert [i for i, (a, b) in enumerate(zip(plain, spec.tokens)) if a != b] == []


def test_hybrid_oracle_drafter_accepts_whole_blocks(hybrid):
    target, prompts, plain = hybrid
    block = 8
    spec = generate(target, TargetOracleProposer(target, block), prompts[:6], max_new_tokens=1 + 3 * block,
                    stop_token_ids=[], batch_size=3)
    assert spec.tokens == [p[: 1 + 3 * block] for p in plain[:6]]
    assert spec.stats.tau == pytest.approx(block)


def test_hybrid_partial_acceptance_replays_exactly(hybrid):
    target, prompts, plain = hybrid
    spec = generate(target, TargetOracleProposer(target, 8, corrupt_seed=1), prompts[:4], max_new_tokens=MAX_NEW,
                    stop_token_ids=[], batch_size=4)
    assert spec.tokens == plain[:4]
    assert all(0.0 < a < 1.0 for a in spec.stats.per_position_accept)
