"""The SGLang worker's speculation switch (`dspine.dynamic.switch`), host side: decisions against a
hand computation of the loss rule, the probe pattern, the confidence update, the switch file and the
server-environment rules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspine.dynamic.calibration import PositionCalibration
from dspine.dynamic.cost_tables import SpsCostTable
from dspine.dynamic.switch import (ForcedSwitch, ServingSwitch, SwitchConfig, SwitchConfigError, load_switch,
                                   write_forced_switch, write_switch_file)
from dspine.serve.flags import FlagError, check_plain_tokens, resolve_step_switch

BLOCK = 4                                   # anchor + 3 proposals
PLAIN = SpsCostTable((1, 4, 16), (1000.0, 800.0, 400.0), 16)               # T_plain: 1.0 / 1.25 / 2.5 ms
ROUND = SpsCostTable((4, 16, 64), (400.0, 300.0, 100.0), 64)               # T_round: 2.5 / 3.33 / 10 ms


def config(prior, calibration=None, probe_share=0.02, max_backoff=1024, plain_tokens=1) -> SwitchConfig:
    return SwitchConfig(ROUND, PLAIN, calibration, tuple(prior), probe_share, max_backoff, plain_tokens)


def loss_by_hand(n: int, expected_per_request: float) -> tuple[float, float]:
    """T_round(n) from ROUND at n·BLOCK tokens, T_plain(n) from PLAIN at n (floor probes)."""
    t_round = {1: 1 / 400, 4: 1 / 300, 16: 1 / 100}[n]
    t_plain = {1: 1 / 1000, 4: 1 / 800, 16: 1 / 400}[n]
    return t_round - n * (1 + expected_per_request) * t_plain / n, t_plain


def test_losing_prior_backs_off_then_probes():
    """Prior 1.05 expected proposals: at one request a drafting step (2.5 ms, 2.05 tokens) loses to
    2.05 plain steps (2.05 ms) by 0.45 ms -> k = ceil(0.45 / (0.02 x 1.0)) = 23 plain steps, then a probe."""
    prior = [0.6, 0.3, 0.15]
    switch = ServingSwitch(config(prior), BLOCK)
    loss, t_plain = loss_by_hand(1, sum(prior))
    k = math.ceil(loss / (0.02 * t_plain))
    assert k == 23
    pattern = "".join("D" if switch.decide(["a"]) else "P" for _ in range(2 * k + 2))
    assert pattern == "P" * k + "D" + "P" * k + "D"
    assert (switch.plain, switch.drafted) == (2 * k, 2)


def test_confident_requests_draft_every_step_and_observe_updates_them():
    """At 4 requests a drafting step costs 3.33 ms against 1.25 ms per plain step: it pays once each
    request expects more than 1.67 accepted proposals. Low prior -> plain; after `observe` reports
    confident rows (sigmoid(4)^j cumulated ~ 2.9), every step drafts; a request without a record
    falls back to the prior."""
    switch = ServingSwitch(config([0.3, 0.1, 0.0]), BLOCK)
    rids = ["a", "b", "c", "d"]
    assert switch.decide(rids) is False
    switch.state.skip, switch.state.probe_due = 0, False
    switch.observe(rids, torch.full((4, 3), 4.0))
    p = 1 / (1 + math.exp(-4.0))
    assert switch.expected["a"] == pytest.approx(p + p * p + p ** 3)
    assert all(switch.decide(rids) for _ in range(10))
    loss, _ = switch.loss(rids)
    assert loss == pytest.approx(loss_by_hand(4, p + p * p + p ** 3)[0])
    mixed = ["a", "b", "c", "new"]
    assert switch.loss(mixed)[0] == pytest.approx(1 / 300 - (4 + 3 * (p + p * p + p ** 3) + 0.4) * (1 / 800) / 4)


def test_a_k_token_plain_step_divides_the_plain_cost_per_token_by_k():
    """Plain steps of K = 3 tokens per request: the same drafting step is weighed against T_plain(n)/(n·3)
    per token. At 4 requests with 2.9 expected proposals each, drafting wins against one-token plain
    steps (3.33 ms vs 4 x 3.9 x 1.25 / 4 = 4.9 ms) and loses against three-token ones (1.6 ms)."""
    rids = ["a", "b", "c", "d"]
    one, three = ServingSwitch(config([0.99, 0.97, 0.94]), BLOCK), ServingSwitch(config([0.99, 0.97, 0.94],
                                                                                          plain_tokens=3), BLOCK)
    expected = 4 * (1 + 0.99 + 0.97 + 0.94)
    assert one.loss(rids)[0] == pytest.approx(1 / 300 - expected * (1 / 800) / 4)
    assert three.loss(rids)[0] == pytest.approx(1 / 300 - expected * (1 / 800) / 12)
    assert one.decide(rids) is True and three.decide(rids) is False
    with pytest.raises(SwitchConfigError, match="exceeds the block size 4"):
        ServingSwitch(config([0.5, 0.2, 0.1], plain_tokens=5), BLOCK)


def test_calibration_is_applied_before_the_cumprod():
    """observe goes through the per-position calibration: a bias of -8 at position 1 makes every later
    position's survival near zero, whatever the raw logits."""
    calibration = PositionCalibration((1.0, 1.0, 1.0), biases=(0.0, -8.0, 0.0))
    switch = ServingSwitch(config([0.5, 0.2, 0.1], calibration), BLOCK)
    switch.observe(["a"], torch.tensor([[0.0, 3.0, 3.0]]))
    s1 = 0.5
    s2 = s1 / (1 + math.exp(-(3.0 - 8.0)))
    s3 = s2 / (1 + math.exp(-3.0))
    assert switch.expected["a"] == pytest.approx(s1 + s2 + s3)


def test_memory_is_bounded_to_running_requests():
    switch = ServingSwitch(config([0.5, 0.2, 0.1]), BLOCK)
    switch.observe([str(i) for i in range(300)], torch.zeros(300, 3))
    switch.decide(["0", "1"])
    assert set(switch.expected) == {"0", "1"}


def write_tables(folder) -> None:
    """ROUND and PLAIN as round.json / plain.json, a calibration as sts.json, in `folder`."""
    (folder / "round.json").write_text(json.dumps({"sample_batch_tokens": [4, 16, 64],
                                                   "sample_steps_per_sec": [400.0, 300.0, 100.0],
                                                   "max_batch_tokens": 64}))
    (folder / "plain.json").write_text(json.dumps({"sample_batch_tokens": [1, 4, 16],
                                                   "sample_steps_per_sec": [1000.0, 800.0, 400.0],
                                                   "max_batch_tokens": 16}))
    PositionCalibration((1.0, 2.0, 3.0)).save(folder / "sts.json")


def test_switch_file_round_trip_and_errors(tmp_path):
    write_tables(tmp_path)
    path = tmp_path / "switch.json"
    write_switch_file(path, round_table="round.json", plain_table="plain.json", calibration="sts.json",
                      prior_survival=[0.5, 0.25, 0.1])
    loaded = SwitchConfig.load(path)
    assert loaded == config([0.5, 0.25, 0.1], PositionCalibration((1.0, 2.0, 3.0)))

    write_switch_file(path, round_table="round.json", plain_table="plain.json", calibration="sts.json",
                      prior_survival=[0.5, 0.25, 0.1], plain_tokens=4)
    assert SwitchConfig.load(path).plain_tokens == 4
    for bad_tokens in (0, "8", True):
        with pytest.raises(SwitchConfigError, match="plain_tokens"):
            write_switch_file(tmp_path / "k.json", round_table="round.json", plain_table="plain.json",
                              calibration=None, prior_survival=[0.5, 0.2, 0.1], plain_tokens=bad_tokens)
    with pytest.raises(SwitchConfigError, match="non-increasing"):
        write_switch_file(tmp_path / "bad.json", round_table="round.json", plain_table="plain.json",
                          calibration=None, prior_survival=[0.2, 0.5, 0.1])
    assert list(tmp_path.glob("*bad.json*")) == []                     # validated before anything is written
    with pytest.raises(SwitchConfigError, match="3 positions but prior_survival 2"):
        write_switch_file(tmp_path / "w.json", round_table="round.json", plain_table="plain.json",
                          calibration="sts.json", prior_survival=[0.5, 0.2])
    with pytest.raises(SwitchConfigError, match="plain_table"):
        write_switch_file(tmp_path / "m.json", round_table="round.json", plain_table="missing.json",
                          calibration=None, prior_survival=[0.5, 0.2, 0.1])
    bad = dict(json.loads(path.read_text()), extra=1)
    (tmp_path / "u.json").write_text(json.dumps(bad))
    with pytest.raises(SwitchConfigError, match="unknown field"):
        SwitchConfig.load(tmp_path / "u.json")
    with pytest.raises(SwitchConfigError, match="proposes 4 per block"):
        ServingSwitch(loaded, 5)


def test_forced_switch_files(tmp_path):
    """{"force": "plain", "plain_tokens": K} / {"force": "draft"}: written, read back, and every bad
    field named (before anything is written)."""
    path = tmp_path / "forced.json"
    write_forced_switch(path, "plain", plain_tokens=8)
    assert json.loads(path.read_text()) == {"force": "plain", "plain_tokens": 8}
    assert load_switch(path) == ForcedSwitch("plain", 8) and load_switch(path).policy == "plain"
    write_forced_switch(path, "plain")
    assert load_switch(path).plain_tokens == 1
    write_forced_switch(path, "draft")
    assert json.loads(path.read_text()) == {"force": "draft"}
    assert load_switch(path) == ForcedSwitch("draft") and load_switch(path).plain_tokens is None
    path.write_text(json.dumps({"force": "plain"}))
    assert load_switch(path) == ForcedSwitch("plain", 1)
    for bad_tokens in (0, -2, "eight", True):
        with pytest.raises(SwitchConfigError, match="plain_tokens"):
            write_forced_switch(tmp_path / "k.json", "plain", plain_tokens=bad_tokens)
    with pytest.raises(SwitchConfigError, match="no plain step runs. Fix: drop plain_tokens"):
        write_forced_switch(tmp_path / "k.json", "draft", plain_tokens=8)
    with pytest.raises(SwitchConfigError, match="'sometimes'"):
        write_forced_switch(tmp_path / "k.json", "sometimes")
    assert not (tmp_path / "k.json").exists()
    path.write_text(json.dumps({"force": "plain", "plain_tokens": 4, "round_table": "round.json"}))
    with pytest.raises(SwitchConfigError, match=r"unknown field\(s\) \['round_table'\] in a forced switch file"):
        load_switch(path)
    path.write_text(json.dumps({"force": "draft", "plain_tokens": 4}))
    with pytest.raises(SwitchConfigError, match="forced.json: plain_tokens=4 with force"):
        load_switch(path)
    write_forced_switch(path, "plain", plain_tokens=2)
    with pytest.raises(SwitchConfigError, match="a forced switch file"):
        SwitchConfig.load(path)


def test_server_environment_rules(tmp_path):
    """DSPINE_DYNAMIC names the switch file: unset -> static, else the file decides (dynamic or
    forced); a missing or malformed file is a FlagError naming the variable."""
    write_tables(tmp_path)
    dynamic, forced = tmp_path / "switch.json", tmp_path / "forced.json"
    write_switch_file(dynamic, round_table="round.json", plain_table="plain.json", calibration=None,
                      prior_survival=[0.5, 0.2, 0.1], plain_tokens=3)
    write_forced_switch(forced, "plain")
    assert resolve_step_switch({}) is None
    assert resolve_step_switch({"DSPINE_DYNAMIC": str(forced)}) == ForcedSwitch("plain", 1)
    loaded = resolve_step_switch({"DSPINE_DYNAMIC": str(dynamic)})
    assert loaded == SwitchConfig.load(dynamic) and loaded.policy == "dynamic"
    with pytest.raises(FlagError, match="DSPINE_DYNAMIC=.*nope.json: no such file"):
        resolve_step_switch({"DSPINE_DYNAMIC": str(tmp_path / "nope.json")})
    (tmp_path / "odd.json").write_text(json.dumps({"force": "sometimes"}))
    with pytest.raises(FlagError, match="DSPINE_DYNAMIC: .*odd.json: force='sometimes'"):
        resolve_step_switch({"DSPINE_DYNAMIC": str(tmp_path / "odd.json")})


def test_plain_tokens_come_from_the_switch_file(tmp_path):
    """Target tokens per plain step: the forced plain file's or the dynamic file's `plain_tokens`,
    none without a switch file or with a forced draft one; at most the verify width."""
    write_tables(tmp_path)
    write_switch_file(tmp_path / "switch.json", round_table="round.json", plain_table="plain.json",
                      calibration=None, prior_survival=[0.5, 0.2, 0.1], plain_tokens=3)
    write_forced_switch(tmp_path / "plain8.json", "plain", plain_tokens=8)
    write_forced_switch(tmp_path / "draft.json", "draft")
    tokens = {name: resolve_step_switch({"DSPINE_DYNAMIC": str(tmp_path / name)}).plain_tokens
              for name in ("switch.json", "plain8.json", "draft.json")}
    assert tokens == {"switch.json": 3, "plain8.json": 8, "draft.json": None}
    for switch in (None, ForcedSwitch("draft"), ForcedSwitch("plain", 4), SwitchConfig.load(tmp_path / "switch.json")):
        check_plain_tokens(switch, 4)
    with pytest.raises(FlagError, match="plain_tokens=8 exceeds --speculative-num-draft-tokens 4"):
        check_plain_tokens(ForcedSwitch("plain", 8), 4)


def test_one_backoff_rule_for_the_worker_and_the_reference_engine():
    """`DraftOrPlain` is the state of both callers. A drafting step that loses backs off by
    ceil(loss / (probe_share x T_plain)) plain steps, then probes; a measured time larger than the
    prediction sets the loss (here 1 ms predicted, 3 ms measured, 2 tokens against 1 ms plain steps:
    losses 0 and 1 ms -> 0 and ceil(1 / 0.5) = 2 plain steps)."""
    from dspine.dynamic.backoff import BackoffRule, DraftEstimate, DraftOrPlain
    from dspine.dynamic.planner import DynamicVerifier, VerifyPlanner

    assert isinstance(ServingSwitch(config([0.5, 0.2, 0.1]), BLOCK).state, DraftOrPlain)
    assert isinstance(DynamicVerifier(VerifyPlanner(), plain_table=PLAIN).state, DraftOrPlain)
    rule = BackoffRule(probe_share=0.5, max_backoff=8)
    predicted = DraftEstimate(seconds=1e-3, tokens=2.0, rows=1, plain_seconds=1e-3)
    assert predicted.loss == pytest.approx(-1e-3) and rule.plain_steps(predicted) == 0
    assert predicted.measured(0.5e-3) == predicted                      # only a larger time counts
    measured = predicted.measured(3e-3)
    assert measured.loss == pytest.approx(1e-3) and rule.plain_steps(measured) == 2
    state = DraftOrPlain(rule)
    pattern = "".join("D" if state.decide(lambda: measured) else "P" for _ in range(6))
    assert pattern == "PPDPPD" and (state.drafts, state.plains) == (2, 4)
    asked = []
    state = DraftOrPlain(rule)
    assert state.decide(lambda: asked.append(1)) is True and asked == [1]   # nothing known: draft
    with pytest.raises(ValueError, match="probe_share"):
        BackoffRule(probe_share=1.5)
