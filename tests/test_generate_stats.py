"""The engine's figures count only what the outputs hold: a round's accepted tokens past
`max_new_tokens` or past a stop token are neither emitted nor in τ or tokens/s (issue 25)."""

from __future__ import annotations

import pytest

from conftest import fixed_prompts
from dspine import generate
from test_engine_parity import TargetOracleProposer

BLOCK = 8


def _check_honest(result, prompts: int) -> None:
    s = result.stats
    assert s.emitted == sum(len(t) for t in result.tokens)
    assert s.decode_tokens == s.emitted - prompts                  # the prefill's token is no round's
    assert s.tau * s.row_rounds == pytest.approx(s.decode_tokens)
    assert s.tokens_per_s == pytest.approx(s.decode_tokens / s.decode_seconds)
    assert s.as_dict()["emitted_tokens"] == s.emitted


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_budget_smaller_than_the_block_counts_only_the_kept_tokens(llama_target, batch_size):
    prompts = fixed_prompts(3, llama_target.config.vocab_size)
    spec = generate(llama_target, TargetOracleProposer(llama_target, BLOCK), prompts, max_new_tokens=4,
                    stop_token_ids=[], batch_size=batch_size)
    assert [len(t) for t in spec.tokens] == [4, 4, 4]
    _check_honest(spec, len(prompts))
    # One round per row: it accepted the whole block, but only 3 tokens fit after the prefill's one.
    assert spec.stats.row_rounds == 3 and spec.stats.tau == 3.0 and spec.stats.emitted == 12


def test_a_stop_token_ends_the_count(llama_target):
    prompts = fixed_prompts(4, llama_target.config.vocab_size, seed=5)
    plain = generate(llama_target, None, prompts, max_new_tokens=24, stop_token_ids=[]).tokens
    stop = plain[0][3]                                  # inside the first round of prompt 0
    spec = generate(llama_target, TargetOracleProposer(llama_target, BLOCK), prompts, max_new_tokens=24,
                    stop_token_ids=[stop], batch_size=2)
    assert spec.tokens[0] == plain[0][: plain[0].index(stop) + 1]
    _check_honest(spec, len(prompts))
    plain_stop = generate(llama_target, None, prompts, max_new_tokens=24, stop_token_ids=[stop])
    assert plain_stop.tokens == spec.tokens
    _check_honest(plain_stop, len(prompts))
    assert plain_stop.stats.tau == 1.0
