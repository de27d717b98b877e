"""Dynamic verification: planner optimality and prefix shape, calibration fitting, SPS/STS formats,
and lossless end-to-end use in `generate` (fp32, CPU)."""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math

import pytest
import torch

from conftest import drafter_for, fixed_prompts
from dspine import generate
from dspine.dynamic.calibration import PositionCalibration, expected_calibration_error
from dspine.dynamic.cost_tables import (FlatCostTable, SpsAdditiveCostTable, SpsCostTable, load_sps_table,
                                        sps_table_from_json, sps_table_to_json)
from dspine.dynamic.planner import DynamicVerifier, VerifyPlan, VerifyPlanner, make_verify_budget
from dspine.dynamic.recording import ConfidenceRecorder
from dspine.engine.proposer import Proposal


def random_survival(bs: int, n: int, g: torch.Generator, low: float = 0.01) -> torch.Tensor:
    return (low + (1 - low) * torch.rand(bs, n, generator=g, dtype=torch.float64)).cumprod(-1)


def random_table(kind: str, g: torch.Generator):
    if kind == "flat":
        return FlatCostTable()
    if kind == "diagonal":
        probes = sorted(set(torch.randint(1, 20, (4,), generator=g).tolist()))
        sps = sorted((10 + 100 * torch.rand(len(probes), generator=g)).tolist(), reverse=True)
        return SpsCostTable(tuple(probes), tuple(sps), max_batch_tokens=probes[-1])
    r = lambda k: (0.01 * torch.rand(k, generator=g)).tolist()  # noqa: E731
    return SpsAdditiveCostTable(bias_seconds=0.01, bs_probes=(1, 3, 6), alpha_seconds=tuple(sorted(r(3))),
                                m_probes=(2, 5, 9, 15), theta_seconds=tuple(sorted(r(4))))


def cliff_table(tokens: int) -> SpsCostTable:
    """Free up to `tokens` verify tokens per step, prohibitive beyond."""
    return SpsCostTable((1, tokens + 1), (1.0, 1e-9), max_batch_tokens=tokens + 1)


# ------------------------------------------------------------------------------------- planner
@pytest.mark.parametrize("kind", ["flat", "diagonal", "additive"])
def test_planner_matches_brute_force(kind):
    g = torch.Generator().manual_seed(0)
    for case in range(40):
        bs, n = 1 + case % 3, 1 + (case // 3) % 3
        survival, table = random_survival(bs, n, g), random_table(kind, g)
        plan = VerifyPlanner(table).plan(survival)
        # Brute force 1: every B, the top-B survival values.
        top = survival.flatten().sort(descending=True).values
        rates = [(bs + float(top[:b].sum())) / float(table.step_seconds(bs, torch.tensor([b]))[0])
                 for b in range(bs * n + 1)]
        assert plan.budget == max(range(len(rates)), key=lambda b: (rates[b], -b))
        # Brute force 2: every per-row prefix allocation.
        best = max((bs + sum(float(survival[r, :m].sum()) for r, m in enumerate(lens)))
                   / float(table.step_seconds(bs, torch.tensor([sum(lens)]))[0])
                   for lens in itertools.product(range(n + 1), repeat=bs))
        assert plan.tokens_per_s == pytest.approx(best, rel=1e-12)
        assert int(plan.verify_lens.sum()) == plan.budget
        assert plan.expected_tokens == pytest.approx(bs + sum(float(survival[r, :m].sum())
                                                              for r, m in enumerate(plan.verify_lens.tolist())))


def test_flat_table_verifies_everything():
    g = torch.Generator().manual_seed(1)
    survival = random_survival(5, 7, g)
    plan = VerifyPlanner().plan(survival)
    assert plan.verify_lens.tolist() == [7] * 5 and plan.budget == 35


def test_steep_cost_verifies_nothing():
    survival = torch.ones(4, 6, dtype=torch.float64).cumprod(-1) * 0.99
    steep = SpsCostTable(tuple(range(1, 40)), tuple(100 * 0.3 ** m for m in range(39)), max_batch_tokens=39)
    assert VerifyPlanner(steep).plan(survival).verify_lens.tolist() == [0] * 4
    additive = SpsAdditiveCostTable(bias_seconds=1e-3, bs_probes=(1,), alpha_seconds=(0.0,), m_probes=(4, 5),
                                    theta_seconds=(0.0, 1.0))
    assert VerifyPlanner(additive).plan(survival).verify_lens.tolist() == [0] * 4


def test_picks_are_prefixes_in_survival_order():
    g = torch.Generator().manual_seed(2)
    for case in range(30):
        bs, n = 2 + case % 4, 2 + case % 5
        survival = random_survival(bs, n, g, low=0.2)
        budget = case % (bs * n + 1)
        plan = VerifyPlanner(cliff_table(bs + budget)).plan(survival)
        assert plan.budget == budget
        chosen = torch.arange(n)[None] < plan.verify_lens[:, None]          # a prefix per row by construction
        if 0 < budget < bs * n:
            assert survival[chosen].min() >= survival[~chosen].max()
    # Ties (all survival 1): picks go position by position, earlier rows first.
    ties = torch.ones(3, 4, dtype=torch.float64)
    assert VerifyPlanner(cliff_table(3 + 4)).plan(ties).verify_lens.tolist() == [2, 1, 1]


def test_planner_eps_extra_requests_and_bad_survival():
    survival = torch.tensor([[0.9, 1e-8], [0.5, 0.25]], dtype=torch.float64)
    assert VerifyPlanner().plan(survival).verify_lens.tolist() == [1, 2]        # below survival_eps: never
    # Extra running requests without proposals raise the step's token count: cliff at 5 tokens.
    assert VerifyPlanner(cliff_table(5)).plan(survival, num_requests=4).budget == 1
    with pytest.raises(ValueError, match="non-increasing"):
        VerifyPlanner().plan(torch.tensor([[0.5, 0.6]]))
    with pytest.raises(ValueError, match="num_requests"):
        VerifyPlanner().plan(survival, num_requests=1)


@pytest.mark.parametrize("kind", ["flat", "diagonal", "additive"])
def test_padded_planner_matches_brute_force(kind):
    g = torch.Generator().manual_seed(3)
    for case in range(40):
        bs, n = 1 + case % 4, 1 + (case // 4) % 4
        survival, table = random_survival(bs, n, g), random_table(kind, g)
        extra = case % 2                                     # running requests without survival rows
        plan = VerifyPlanner(table, layout="padded").plan(survival, num_requests=bs + extra)
        # Brute force: every common width w; the step runs bs*w proposal slots whatever the rows hold.
        rates = [(bs + extra + sum(float(survival[r, :w].sum()) for r in range(bs)))
                 / float(table.step_seconds(bs + extra, torch.tensor([bs * w]))[0]) for w in range(n + 1)]
        width = max(range(n + 1), key=lambda w: (rates[w], -w))
        assert plan.verify_lens.tolist() == [width] * bs
        assert plan.budget == bs * width and plan.tokens_per_s == pytest.approx(rates[width], rel=1e-12)


def test_padded_layout_does_not_pay_for_one_confident_row():
    # One sure row and seven hopeless ones; each verified slot costs 10 ms on top of 100 ms.
    survival = torch.tensor([[0.99] * 7] + [[0.02] * 7] * 7, dtype=torch.float64).cumprod(-1)
    linear = SpsAdditiveCostTable(bias_seconds=0.1, bs_probes=(1,), alpha_seconds=(0.0,), m_probes=(0, 1000),
                                  theta_seconds=(0.0, 10.0))
    ragged = VerifyPlanner(linear).plan(survival)
    assert ragged.verify_lens.tolist() == [7] + [0] * 7            # pays only for the sure row's slots
    padded = VerifyPlanner(linear, layout="padded").plan(survival)
    assert padded.verify_lens.tolist() == [0] * 8                  # a width of 7 would cost 8 x 7 slots
    with pytest.raises(ValueError, match="layout"):
        VerifyPlanner(layout="compact")


# ---------------------------------------------------------------------------------- calibration
def synthetic_rounds(temps: list[float], n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits [n, N] and accept_len [n] where position j accepts w.p. sigmoid(logit / T_j)."""
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 + 2.5 * torch.randn(n, len(temps), generator=g, dtype=torch.float64)
    accepted = torch.rand(n, len(temps), generator=g, dtype=torch.float64) < torch.sigmoid(
        logits / torch.tensor(temps, dtype=torch.float64))
    return logits, accepted.long().cumprod(-1).sum(-1)


def test_calibration_recovers_temperatures_and_lowers_ece():
    temps = [0.5, 1.0, 2.0, 4.0]
    logits, accept_len = synthetic_rounds(temps, 40000)
    cal = PositionCalibration.fit(logits, accept_len, dataset="synthetic")
    assert cal.temperatures == pytest.approx(temps, rel=0.1)
    assert cal.num_samples == 40000 and len(cal.ece_before) == len(cal.ece_after) == 4
    before = PositionCalibration.identity(4).calibration_error(logits, accept_len)
    after = cal.calibration_error(logits, accept_len)
    assert list(cal.ece_before) == before[0] and list(cal.ece_after) == after[0]
    assert after[1] < 0.5 * before[1] and after[1] < 0.01
    for j in (0, 2, 3):                                             # the positions that were off
        assert after[0][j] < before[0][j]


def test_affine_calibration_recovers_scale_and_bias_where_temperature_cannot():
    """Acceptance w.p. sigmoid(s_j·z + b_j) with b_j != 0 (a biased head): temperature scaling alone
    leaves the mean acceptance off by points; the affine fit recovers (s_j, b_j) and the mean."""
    g = torch.Generator().manual_seed(11)
    n, scale, bias = 40000, torch.tensor([0.4, 1.0, 2.0]), torch.tensor([-1.0, 0.5, -2.0])
    z = 1.5 + 2.5 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    accepted = torch.rand(n, 3, generator=g, dtype=torch.float64) < torch.sigmoid(z * scale + bias)
    accept_len = accepted.long().cumprod(-1).sum(-1)
    temp_only = PositionCalibration.fit(z, accept_len)
    affine = PositionCalibration.fit(z, accept_len, affine=True, dataset="synthetic")
    assert temp_only.biases == ()
    assert [1 / t for t in affine.temperatures] == pytest.approx(scale.tolist(), rel=0.08)
    assert list(affine.biases) == pytest.approx(bias.tolist(), abs=0.12)

    def worst_gap(cal):
        survival = cal.probabilities(z).cumprod(-1).mean(0)
        observed = (accept_len[:, None] > torch.arange(3)).double().mean(0)
        return float((survival - observed).abs().max())

    assert worst_gap(affine) < 0.01 < 0.03 < worst_gap(temp_only)
    assert affine.calibration_error(z, accept_len)[1] < temp_only.calibration_error(z, accept_len)[1]
    assert PositionCalibration.from_json(affine.to_json()) == affine
    assert "biases" in json.loads(affine.to_json())


def test_affine_fit_stays_finite_on_degenerate_positions():
    """Constant logits, a position every row fails, a position no row reaches."""
    z = torch.cat([torch.zeros(50, 1), torch.randn(50, 1, dtype=torch.float64), torch.randn(50, 1, dtype=torch.float64)],
                  -1).double()
    accept_len = torch.tensor([1] * 30 + [0] * 20)                      # position 2 never accepts, 3 never reached
    cal = PositionCalibration.fit(z, accept_len, affine=True)
    assert all(math.isfinite(t) and t > 0 for t in cal.temperatures) and all(math.isfinite(b) for b in cal.biases)
    assert cal.temperatures[2] == 1.0 and cal.biases[2] == 0.0
    assert float(cal.probabilities(z)[:, 0].mean()) == pytest.approx(0.6, abs=1e-3)
    assert float(cal.probabilities(z)[:, 1].max()) < 0.05


def test_survival_gaps_compare_mean_survival_with_the_observed_rate():
    logits = torch.tensor([[10.0, 0.0], [10.0, -10.0]], dtype=torch.float64)  # p ≈ (1, .5) and (1, 0)
    accept = torch.tensor([2, 0])
    rows = PositionCalibration.identity(2).survival_gaps(logits, accept)
    assert rows[0]["predicted"] == pytest.approx(1.0, abs=1e-4) and rows[0]["observed"] == 0.5
    assert rows[1]["predicted"] == pytest.approx(0.25, abs=1e-4) and rows[1]["observed"] == 0.5
    assert rows[1]["gap_points"] == pytest.approx(-25.0, abs=1e-2)


def test_ece_equal_width_bins_by_hand():
    probs, labels = torch.tensor([0.05, 0.15, 0.95]), torch.tensor([0, 1, 1])
    assert expected_calibration_error(probs, labels) == pytest.approx((0.05 + 0.85 + 0.05) / 3)
    # Two samples in one bin average before the gap is taken.
    assert expected_calibration_error(torch.tensor([0.31, 0.39]), torch.tensor([1, 0])) == pytest.approx(0.15)


def test_calibration_json_round_trip_and_errors(tmp_path):
    logits, accept_len = synthetic_rounds([0.7, 1.3], 2000, seed=3)
    cal = PositionCalibration.fit(logits, accept_len, dataset="unit")
    cal.save(tmp_path / "sts.json")
    assert PositionCalibration.load(tmp_path / "sts.json") == cal
    assert set(json.loads(cal.to_json())) == {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    # SGLang omits defaults: temperatures alone is a complete file.
    assert PositionCalibration.from_json('{"temperatures": [1.5, 2]}').temperatures == (1.5, 2.0)
    for text, field in [('{"temperatures": []}', "temperatures"), ('{"temperatures": [1.0, 0.0]}', "temperatures"),
                        ('{"dataset": "x"}', "temperatures"), ('{"temperatures": "1.0"}', "temperatures"),
                        ('{"temperatures": [1.0], "ece_after": [0.1, 0.2]}', "ece_after"),
                        ('{"temperatures": [1.0], "biases": [0.1, 0.2]}', "biases"),
                        ('{"temperatures": [1.0], "gamma": 1}', "gamma")]:
        with pytest.raises(ValueError, match=field):
            PositionCalibration.from_json(text)
    with pytest.raises(ValueError, match="N=3"):
        cal.probabilities(torch.zeros(1, 3))


# ---------------------------------------------------------------------------------- SPS tables
def test_diagonal_lookup_by_hand():
    table = SpsCostTable((4, 8, 16), (100.0, 80.0, 50.0), max_batch_tokens=64)
    tokens = torch.tensor([1, 4, 7, 8, 15, 16, 1000])
    assert table.steps_per_sec(tokens).tolist() == [100.0, 100.0, 100.0, 80.0, 80.0, 50.0, 50.0]
    assert table.step_seconds(3, torch.tensor([0, 5, 13])).tolist() == pytest.approx([1 / 100, 1 / 80, 1 / 50])


def test_additive_lookup_by_hand():
    table = SpsAdditiveCostTable(bias_seconds=0.01, bs_probes=(1, 9), alpha_seconds=(0.0, 0.004), m_probes=(8, 16, 32),
                                 theta_seconds=(0.001, 0.002, 0.006))
    assert table.step_seconds(5, torch.tensor([7, 0])).tolist() == pytest.approx([0.01 + 0.002 + 0.0015,
                                                                                   0.01 + 0.002 + 0.001])
    assert table.step_seconds(20, torch.tensor([20])).tolist() == pytest.approx([0.01 + 0.004 + 0.006])
    assert table.step_seconds(9, torch.tensor([15])).tolist() == pytest.approx([0.01 + 0.004 + 0.004])
    single = SpsAdditiveCostTable(bias_seconds=0.5, bs_probes=(4,), alpha_seconds=(0.1,), m_probes=(4,),
                                  theta_seconds=(0.2,))
    assert single.step_seconds(1, torch.tensor([0, 9])).tolist() == pytest.approx([0.8, 0.8])


def test_sps_json_round_trip(tmp_path):
    for table in (SpsCostTable((4, 8), (90.0, 70.5), 128),
                  SpsAdditiveCostTable(0.01, (1, 9), (0.0, 0.004), (8, 16), (0.001, 0.002))):
        path = tmp_path / "table.json"
        path.write_text(sps_table_to_json(table))
        assert load_sps_table(path) == table


@pytest.mark.parametrize("data,field", [
    ({"sample_steps_per_sec": [1.0], "max_batch_tokens": 4}, "sample_batch_tokens"),
    ({"sample_batch_tokens": [8, 4], "sample_steps_per_sec": [1.0, 2.0], "max_batch_tokens": 8},
     "sample_batch_tokens"),
    ({"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [1.0], "max_batch_tokens": 8}, "sample_steps_per_sec"),
    ({"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [1.0, 0.0], "max_batch_tokens": 8},
     "sample_steps_per_sec"),
    ({"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [1.0, 2.0], "max_batch_tokens": 6}, "max_batch_tokens"),
    ({"sample_batch_tokens": [4.5], "sample_steps_per_sec": [1.0], "max_batch_tokens": 8}, "sample_batch_tokens"),
    ({"sample_batch_tokens": [4], "sample_steps_per_sec": [1.0], "max_batch_tokens": 8, "extra": 1}, "extra"),
    ({"bias_seconds": 0.0, "bs_probes": [1], "alpha_seconds": [0.0], "m_probes": [1], "theta_seconds": [0.0]},
     "bias_seconds"),
    ({"bias_seconds": 0.1, "bs_probes": [1], "alpha_seconds": [0.0], "m_probes": [1]}, "theta_seconds"),
    ({"bias_seconds": 0.1, "bs_probes": [2, 2], "alpha_seconds": [0.0, 0.1], "m_probes": [1], "theta_seconds": [0.0]},
     "bs_probes"),
    ({"bias_seconds": 0.1, "bs_probes": [1], "alpha_seconds": [0.0], "m_probes": [1, 2], "theta_seconds": [0.0]},
     "theta_seconds"),
    ({"bias_seconds": "0.1", "bs_probes": [1], "alpha_seconds": [0.0], "m_probes": [1], "theta_seconds": [0.0]},
     "bias_seconds"),
])
def test_malformed_sps_tables_name_the_field(tmp_path, data, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field) as err:
        load_sps_table(path)
    assert str(path) in str(err.value)


# ---------------------------------------------------------------------------------- end to end
PROMPTS, MAX_NEW = 6, 24


@pytest.fixture(scope="module")
def plain(llama_target):
    prompts = fixed_prompts(PROMPTS, llama_target.config.vocab_size)
    return prompts, generate(llama_target, None, prompts, max_new_tokens=MAX_NEW + 16, stop_token_ids=[]).tokens


class KnownPrefixProposer:
    """Proposes the target's true greedy continuation for `k` positions, then wrong tokens; its
    confidence says so (0.95, then 0.05). Looks the continuation up in precomputed plain outputs."""

    def __init__(self, prompts, continuations, k: int, block_size: int = 8):
        self.truth = {tuple(p): c for p, c in zip(prompts, continuations)}
        self.k, self.block_size, self.layer_ids = k, block_size, []

    def start(self, tokens, hidden, lengths):
        self.rows = [(tuple(tokens[b, : int(n)].tolist()), int(n)) for b, n in enumerate(lengths)]
        self.done = [0] * len(self.rows)                 # generated tokens committed so far, per row

    def extend(self, tokens, hidden, keep):
        self.done = [d + k for d, k in zip(self.done, keep.tolist())]

    def select(self, rows):
        self.rows, self.done = [self.rows[r] for r in rows.tolist()], [self.done[r] for r in rows.tolist()]

    def propose(self, anchor_ids, temperature, generator):
        n = self.block_size - 1
        out = []
        for (prompt, _), done in zip(self.rows, self.done):
            truth = self.truth[prompt][done + 1: done + 1 + n]
            out.append(truth[: self.k] + [(t + 1) % 256 for t in truth[self.k:]])
        conf = torch.tensor([0.95] * self.k + [0.05] * (n - self.k)).expand(len(out), n)
        return Proposal(tokens=torch.tensor(out), confidence=conf)


def test_recorder_outcomes_and_fit(llama_target, plain):
    prompts, truth = plain
    recorder = ConfidenceRecorder(KnownPrefixProposer(prompts, truth, k=3))
    out = generate(llama_target, recorder, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert out.tokens == [t[:MAX_NEW] for t in truth]
    assert recorder.logits.shape == (out.stats.row_rounds, 7)
    assert recorder.accept_len.tolist() == [3] * out.stats.row_rounds
    cal = recorder.fit()
    # Positions 0-2 always accepted, 3 always rejected (both sharpen to the bound); 4-6 never reached.
    assert cal.temperatures == pytest.approx((0.05,) * 4 + (1.0,) * 3)
    with pytest.raises(ValueError, match="verify_budget=None"):
        generate(llama_target, ConfidenceRecorder(KnownPrefixProposer(prompts, truth, k=3)), prompts,
                 max_new_tokens=8, stop_token_ids=[], verify_budget=lambda p: torch.full((p.tokens.shape[0],), 2))


def test_planner_verifies_the_confident_prefix(llama_target, plain):
    prompts, truth = plain
    proposer = KnownPrefixProposer(prompts, truth, k=3)
    full = generate(llama_target, proposer, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])
    # Each step costs 1 s + 20 ms per verify token: worth it for survival 0.95^j, not for 0.05·0.95^3.
    table = SpsAdditiveCostTable(bias_seconds=1.0, bs_probes=(1,), alpha_seconds=(0.0,), m_probes=(0, 1000),
                                 theta_seconds=(0.0, 20.0))
    dyn = generate(llama_target, proposer, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                   verify_budget=make_verify_budget(VerifyPlanner(table)))
    assert dyn.tokens == full.tokens == [t[:MAX_NEW] for t in truth]
    assert full.stats.mean_verify_tokens == 8 and dyn.stats.mean_verify_tokens == 4
    # 4 per round (anchor + 3 accepted), but the last round keeps only 3 of them: MAX_NEW - 1 = 23 tokens in 6.
    assert dyn.stats.tau == full.stats.tau == pytest.approx(23 / 6)
    # The step-time record: every round's rows and the tokens its verify forward ran.
    for stats, width in ((full.stats, 7), (dyn.stats, 3)):
        assert len(stats.round_timings) == stats.rounds
        assert sum(t.rows for t in stats.round_timings) == stats.row_rounds
        assert [t.verify_tokens for t in stats.round_timings] == [t.rows * (1 + width) for t in stats.round_timings]
        assert all(t.seconds > 0 for t in stats.round_timings)
    padded = generate(llama_target, proposer, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                      verify_budget=make_verify_budget(VerifyPlanner(table, layout="padded")))
    assert padded.tokens == full.tokens and padded.stats.mean_verify_tokens == 4


def round_kinds(stats, width: int) -> str:
    """'S' for a round that verified `width` proposals per row, 'P' for a plain decoding step."""
    kinds = {t.rows * (1 + width): "S" for t in stats.round_timings} | {t.rows: "P" for t in stats.round_timings}
    return "".join(kinds[t.verify_tokens] for t in stats.round_timings)


# KnownPrefixProposer's survival: 0.95, 0.95^2, 0.95^3, then x0.05: tau* = 1 + 2.755 tokens per row
# when everything is verified (a flat cost makes that the plan). A drafting round costs 1 s, a plain
# step 0.2 s: loss = 1 - 3.755 x 0.2 = 0.249 s; with probe_share 0.5, k = ceil(0.249 / 0.1) = 3.
ONE_SECOND_ROUND = SpsCostTable((1,), (1.0,), max_batch_tokens=1)
PLAIN_STEP = SpsCostTable((1,), (5.0,), max_batch_tokens=1)


def test_switch_decodes_plainly_for_the_rounds_a_probe_loses(llama_target, plain):
    prompts, truth = plain
    recorder = ConfidenceRecorder(KnownPrefixProposer(prompts, truth, k=3))
    verifier = make_verify_budget(VerifyPlanner(ONE_SECOND_ROUND), plain_table=PLAIN_STEP, probe_share=0.5)
    assert verifier.plain_rounds_after(VerifyPlan(0, torch.zeros(1), 3.755, 1.0), 1) == 3
    out = generate(llama_target, recorder, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                   verify_budget=verifier)
    assert out.tokens == [t[:MAX_NEW] for t in truth]
    # Each drafting round emits 4 tokens (3 accepted + bonus), then 3 plain steps: 1 + 4+3+4+3+4+3+4 = 26.
    assert round_kinds(out.stats, 7) == "SPPPSPPPSPPPS"
    assert verifier.plans == 4 and verifier.plain_rounds == 9
    # The drafter followed the plain steps too: every drafting round still accepted exactly 3.
    assert recorder.accept_len.tolist() == [3] * 4 * PROMPTS
    assert recorder.observed_survival.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_switch_backs_off_by_the_measured_loss_when_the_table_is_optimistic(llama_target, plain):
    prompts, truth = plain
    # The table says a drafting round takes 1 ns and a plain step 1 us: drafting wins on paper
    # (1 ns against 3.755 x 1 us), so only the measured wall time (milliseconds) can make it lose.
    optimistic = SpsCostTable((1,), (1e9,), max_batch_tokens=1)
    plain_step = SpsCostTable((1,), (1e6,), max_batch_tokens=1)
    verifier = make_verify_budget(VerifyPlanner(optimistic), plain_table=plain_step, probe_share=0.5, max_backoff=3)
    plan = VerifyPlan(0, torch.zeros(1), 3.755, 1e-9)
    assert verifier.plain_rounds_after(plan, 1) == 0
    assert verifier.plain_rounds_after(plan, 1, seconds=2.5e-6) == 0        # 2.5 us < 3.755 us: still wins
    assert verifier.plain_rounds_after(plan, 1, seconds=4.5e-6) == 2        # loses 0.745 us: ceil(0.745 / 0.5)
    out = generate(llama_target, KnownPrefixProposer(prompts, truth, k=3), prompts, max_new_tokens=MAX_NEW,
                   stop_token_ids=[], verify_budget=verifier)
    assert out.tokens == [t[:MAX_NEW] for t in truth]
    # Every drafting round really takes milliseconds: each is followed by max_backoff plain steps.
    assert round_kinds(out.stats, 7) == "SPPPSPPPSPPPS"


def test_prior_survival_decides_the_first_round_before_any_draft(llama_target, plain):
    prompts, truth = plain
    prior = torch.tensor([0.95, 0.95, 0.95, 0.05, 0.05, 0.05, 0.05], dtype=torch.float64).cumprod(0)
    verifier = make_verify_budget(VerifyPlanner(ONE_SECOND_ROUND), plain_table=PLAIN_STEP, probe_share=0.5,
                                  prior_survival=prior)
    out = generate(llama_target, KnownPrefixProposer(prompts, truth, k=3), prompts, max_new_tokens=MAX_NEW,
                   stop_token_ids=[], verify_budget=verifier)
    assert out.tokens == [t[:MAX_NEW] for t in truth]
    assert round_kinds(out.stats, 7) == "PPPSPPPSPPPSPP"                  # 1 + 3+4+3+4+3+4+2 = 24
    # A prior that wins drafts from the first round on.
    eager = make_verify_budget(VerifyPlanner(ONE_SECOND_ROUND), plain_table=SpsCostTable((1,), (0.1,), max_batch_tokens=1),
                               prior_survival=prior)
    out = generate(llama_target, KnownPrefixProposer(prompts, truth, k=3), prompts, max_new_tokens=MAX_NEW,
                   stop_token_ids=[], verify_budget=eager)
    assert set(round_kinds(out.stats, 7)) == {"S"} and eager.plain_rounds == 0


def test_switch_keeps_drafting_while_drafting_wins(llama_target, plain):
    prompts, truth = plain
    slow_plain = SpsCostTable((1,), (1e-6,), max_batch_tokens=1)
    verifier = make_verify_budget(VerifyPlanner(), plain_table=slow_plain)
    out = generate(llama_target, drafter_for(llama_target), prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                   verify_budget=verifier)
    assert out.tokens == [t[:MAX_NEW] for t in truth]
    assert verifier.plain_rounds == 0 and verifier.plans == out.stats.rounds
    with pytest.raises(ValueError, match="max_backoff"):
        DynamicVerifier(VerifyPlanner(), max_backoff=0)
    with pytest.raises(ValueError, match="probe_share"):
        DynamicVerifier(VerifyPlanner(), probe_share=0.0)
    with pytest.raises(ValueError, match="prior_survival"):
        DynamicVerifier(VerifyPlanner(), prior_survival=torch.ones(7))


@pytest.mark.parametrize("tokens_per_row,expect", [(0, 1.0), (2, None)], ids=["steep", "partial"])
def test_random_drafter_stays_lossless_under_budget(llama_target, plain, tokens_per_row, expect):
    prompts, truth = plain
    drafter = drafter_for(llama_target)
    recorder = ConfidenceRecorder(drafter)
    generate(llama_target, recorder, prompts[:3], max_new_tokens=12, stop_token_ids=[])
    calibration = recorder.fit()
    budget = make_verify_budget(VerifyPlanner(cliff_table(PROMPTS * (1 + tokens_per_row))), calibration)
    dyn = generate(llama_target, drafter, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[], verify_budget=budget)
    full = generate(llama_target, drafter, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert dyn.tokens == full.tokens == [t[:MAX_NEW] for t in truth]
    assert dyn.stats.mean_verify_tokens < full.stats.mean_verify_tokens
    if expect is not None:
        assert dyn.stats.mean_verify_tokens == expect


# ---------------------------------------------------------------------------------- SGLang parity
def _sglang_installed() -> bool:
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _sglang_installed(), reason="SGLang is not installed here (run in .venv-sglang)")
def test_same_decisions_and_files_as_sglang(tmp_path):
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import schedule_verify_lens_topk_from_survival
    from sglang.srt.speculative.dspark_components.dspark_planner import (DSparkScheduleConfig,
                                                                         compute_verify_token_budget)
    from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path
    from sglang.srt.speculative.dspark_components.dspark_sts import DSparkStsCalibration

    g = torch.Generator().manual_seed(5)
    for case in range(60):
        bs, n = 1 + case % 6, 1 + case % 7
        survival = random_survival(bs, n, g).float()
        table = random_table(("diagonal", "additive")[case % 2], g)
        path = tmp_path / f"sps_{case}.json"
        path.write_text(sps_table_to_json(table))
        theirs_table = load_sps_table_from_path(str(path))
        assert sps_table_from_json(theirs_table.to_json()) == table
        cfg = DSparkScheduleConfig(gamma=n)
        budget = compute_verify_token_budget(history_survival_probs=survival, sps_table=theirs_table, cfg=cfg).budget
        plan = VerifyPlanner(table).plan(survival)
        assert plan.budget == budget
        lens = schedule_verify_lens_topk_from_survival(survival_probs=survival, budget=budget, cfg=cfg)
        assert (plan.verify_lens + 1).tolist() == lens.tolist()
    cal = PositionCalibration(temperatures=(0.5, 2.0), dataset="x", num_samples=3, ece_before=(0.1, 0.2),
                              ece_after=(0.05, 0.1))
    theirs = DSparkStsCalibration.from_json(cal.to_json())
    assert PositionCalibration.from_json(theirs.to_json()) == cal
