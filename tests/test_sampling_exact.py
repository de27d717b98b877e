"""At T > 0 speculative sampling emits exactly the target's distribution (chi-square, 10k draws)."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from conftest import drafter_for, tiny_llama
from dspine import generate
from dspine.engine.acceptance import SamplingParams, warp_probs

VOCAB, K_TOKENS, DRAWS = 6, 3, 10_000
PROMPT = [4, 1, 5, 3]


def exact_joint(target, params_kwargs) -> dict[tuple, float]:
    """P(first K_TOKENS emitted tokens) under plain sampling, by enumeration."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=K_TOKENS):
        ids = torch.tensor([PROMPT + list(seq[:-1])])
        logits = target(ids).logits[:, len(PROMPT) - 1:]
        p = warp_probs(logits, SamplingParams.uniform(1, **params_kwargs))[0]
        probs[seq] = float(torch.prod(torch.stack([p[i, t] for i, t in enumerate(seq)])))
    return probs


def empirical(target, drafter, params_kwargs, seed: int) -> dict[tuple, int]:
    """Counts of the first K_TOKENS emitted tokens; asserts both accept and reject paths ran."""
    counts: dict[tuple, int] = {}
    accepted = []
    batch = 2500
    for i in range(DRAWS // batch):
        out = generate(target, drafter, [PROMPT] * batch, max_new_tokens=K_TOKENS, stop_token_ids=[],
                       seed=seed + i, **params_kwargs)
        for t in out.tokens:
            counts[tuple(t)] = counts.get(tuple(t), 0) + 1
        accepted += out.stats.per_position_accept[:1]
    if drafter is not None:
        assert 0.05 < sum(accepted) / len(accepted) < 0.95, "the test must exercise acceptance and rejection"
    return counts


def chi2_pvalue(exact: dict, counts: dict) -> float:
    impossible = sum(c for k, c in counts.items() if exact.get(k, 0.0) == 0.0)
    if impossible:
        return 0.0  # a sequence the warped target can never emit
    keys = sorted((k for k in exact if exact[k] > 0), key=lambda k: -exact[k])
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k in keys:
        e = exact[k] * DRAWS
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            rest_o += counts.get(k, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    total = sum(exp)
    exp = [e * sum(obs) / total for e in exp]  # exact probabilities sum to 1 only up to fp32 rounding
    return chisquare(obs, exp).pvalue


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=VOCAB, hidden=32, layers=2, seed=3, init=0.3)


@pytest.mark.parametrize("path", ["q", "target-sample-match"])
@pytest.mark.parametrize("params_kwargs", [dict(temperature=1.0), dict(temperature=0.8, top_k=4, top_p=0.9)],
                         ids=["T1", "T0.8-topk4-topp0.9"])
def test_speculative_sampling_matches_target(small_target, path, params_kwargs):
    overrides = dict(selection_top_k=4, block_size=4, injection_top_k=2, mask_token_id=0, successor_table_size=4)
    if path == "target-sample-match":
        overrides.update(selection="argmax", injection=False)
    drafter = drafter_for(small_target, seed=5, **overrides)
    exact = exact_joint(small_target, params_kwargs)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    counts = empirical(small_target, drafter, params_kwargs, seed=11)
    assert sum(counts.values()) == DRAWS
    p = chi2_pvalue(exact, counts)
    assert p > 0.01, f"speculative samples deviate from the target distribution (chi-square p={p:.2e})"


def test_chi_square_detects_a_biased_sampler(small_target):
    """The statistic has power: a sampler that drops the temperature fails it."""
    exact = exact_joint(small_target, dict(temperature=1.0))
    counts = empirical(small_target, None, dict(temperature=0.7), seed=3)
    assert chi2_pvalue(exact, counts) < 1e-6
