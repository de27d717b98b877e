"""The captured round's accept rule and its eligibility test, against a plain loop and SGLang's
own greedy-verify conditions (`dspine.sglang.round_graph`; no SGLang needed)."""

from types import SimpleNamespace

import pytest
import torch

from dspine.sglang.round_graph import accept_greedy, round_kind


def accept_by_loop(verify_ids, top1, prefix):
    """Greedy verification one row and one position at a time."""
    rows = []
    for ids, target, start in zip(verify_ids.tolist(), top1.tolist(), prefix.tolist()):
        accepted = 0
        while accepted < len(ids) - 1 and ids[accepted + 1] == target[accepted]:
            accepted += 1
        committed = ids[1: accepted + 1] + [target[accepted]]
        rows.append((committed, accepted + 1, target[accepted], start + accepted + 1))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_accept_rule_matches_a_loop_over_positions(seed):
    gen = torch.Generator().manual_seed(seed)
    n, width, vocab = 7, 16, 5         # a tiny vocabulary: long accepted runs and every cut point occur
    top1 = torch.randint(0, vocab, (n, width), generator=gen)
    verify = torch.randint(0, vocab, (n, width), generator=gen)
    run = torch.randint(0, width, (n,), generator=gen)
    for row in range(n):                # force an accepted prefix of run[row] proposals
        verify[row, 1: run[row] + 1] = top1[row, : run[row]]
    verify[0, 1:] = top1[0, :-1]        # one row accepts the whole block
    prefix = torch.randint(1, 1000, (n,), generator=gen)
    out, commit, bonus, new_lens = accept_greedy(verify, top1, prefix)
    assert out.dtype == bonus.dtype == new_lens.dtype == torch.int64 and commit.dtype == torch.int32
    for row, (committed, length, bonus_id, new_len) in enumerate(accept_by_loop(verify, top1, prefix)):
        assert int(commit[row]) == length and int(bonus[row]) == bonus_id and int(new_lens[row]) == new_len
        assert out[row, :length].tolist() == committed
    assert int(commit[0]) == width


def test_greedy_and_plain_sampled_batches_take_the_captured_round():
    greedy = SimpleNamespace(is_all_greedy=True, has_custom_logit_processor=False, logit_bias=None,
                             acc_additive_penalties=None, acc_scaling_penalties=None, grammar_mask=None,
                             vocab_mask=None, penalizer_orchestrator=None)   # the worker's copy_for_forward
    assert round_kind(SimpleNamespace(sampling_info=greedy)) == "greedy"
    assert round_kind(SimpleNamespace(sampling_info=None)) == "greedy"
    assert round_kind(SimpleNamespace(sampling_info=SimpleNamespace(**{**vars(greedy), "is_all_greedy": False}))) \
        == "sampled"
    changed = {"has_custom_logit_processor": True, "logit_bias": torch.zeros(1),
               "acc_additive_penalties": torch.zeros(1), "acc_scaling_penalties": torch.ones(1),
               "grammar_mask": object(), "vocab_mask": torch.zeros(1),
               "penalizer_orchestrator": SimpleNamespace(is_required=True)}
    for name, value in changed.items():
        for greedy_rows in (True, False):
            info = SimpleNamespace(**{**vars(greedy), "is_all_greedy": greedy_rows, name: value})
            assert round_kind(SimpleNamespace(sampling_info=info)) is None, name
    assert round_kind(SimpleNamespace(sampling_info=greedy, return_logprob=True)) is None
    assert round_kind(SimpleNamespace(sampling_info=greedy, has_grammar=True)) is None


def test_stage_clock_reads_finished_rounds_without_waiting(caplog):
    from dspine.sglang.round_graph import STAGES, StageClock

    ticks = iter(range(1000))

    class FakeEvent:
        """Records a time stamp; `query()` says whether the device reached it (gate)."""
        gate = [True]

        def record(self):
            self.t = next(ticks)

        def query(self):
            return self.gate[0]

        def elapsed_time(self, later):
            return float(later.t - self.t)

    clock = StageClock(2, FakeEvent)
    FakeEvent.gate[0] = False
    for n in (1, 4):
        events = []
        for _ in range(len(STAGES) + 1):
            clock.mark(events)
        clock.round_done(n, events)
    assert clock.finished == 0 and len(clock.pending) == 2          # not landed: nothing read, no wait
    FakeEvent.gate[0] = True
    events = []
    for _ in range(len(STAGES) + 1):
        clock.mark(events)
    with caplog.at_level("INFO"):
        clock.round_done(1, events)
    assert clock.finished == 3 and not clock.pending
    assert clock.totals[1] == [2.0] + [2.0] * len(STAGES) and clock.totals[4][0] == 1.0
    assert "bs 1: g1 1.000 draft 1.000 g2 1.000 verify 1.000 g3 1.000" in caplog.text
