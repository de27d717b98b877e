"""dspine/bench/copy_ceiling.py: each kind of a hand-made round, rounds cut by the answer's end left
out, kinds weighed by the rounds they would take, and on a target whose answers copy their context:
rows followed through batches and finished rows, greedy parity, and every tree at least as long as
its members."""

from __future__ import annotations

import pytest
import torch
from conftest import drafter_for, tiny_llama

from dspine.bench.copy_ceiling import Ceiling, Round, measure_rounds, measure_workload


def test_each_kind_of_a_hand_made_round():
    cfg = drafter_for(tiny_llama(), copy_candidates=True).config.replace(copy_min_match=2)
    seq = [5, 6, 7, 8, 9, 5, 6, 7, 8, 1, 2, 3]
    rounds = [Round(prompt=0, anchor=6, anchor_pos=6, proposed=[7, 9, 1], chains=[[7, 8, 9], [-1, -1, -1]],
                    argmax=[7, 8, 1]),
              Round(prompt=0, anchor=2, anchor_pos=10, proposed=[3, 4, 4], chains=[], argmax=[3, 4, 4])]   # cut
    out = measure_rounds(rounds, [seq], cfg)
    assert (out.recorded, out.complete) == (2, 1)
    # truth 7 8 1; the walk copies 7 after "5 6", 8 after "5 6 7", then 9 where 1 follows; the union
    # takes the argmax's 1 there
    assert out.tau() == {"lattice": 2, "argmax": 4, "chain_0": 3, "chain_1": 1, "tree_chains": 3,
                         "copy_walk": 3, "tree_walk": 3, "union": 4}
    neither = Round(prompt=0, anchor=6, anchor_pos=6, proposed=[0, 0, 0], chains=[], argmax=[3, 3, 3])
    assert measure_rounds([neither], [seq], cfg).tau()["union"] == 3     # slot 2: neither the walk nor the argmax
    with pytest.raises(ValueError, match="anchors on 6"):
        measure_rounds([Round(0, 6, 5, [7], [], [7])], [seq], cfg)


def test_a_kind_is_weighed_by_the_rounds_it_would_take():
    """A kind twice as long where the lattice covered 4 tokens a round and no better where it covered
    1: its trajectory takes 0.5 + 1 rounds for those 5 tokens (tau 3.33), not the rounds' mean 4.5."""
    out = Ceiling()
    out.add_round(4, {"lattice": 3, "walk": 7})
    out.add_round(1, {"lattice": 0, "walk": 0})
    tau = out.tau()
    assert tau["lattice"] == pytest.approx(2.5) and tau["walk"] == pytest.approx(5 / 1.5)
    assert (out.complete, out.tokens) == (2, 5)


def bigram_target():
    """Attention outputs zeroed: the next token depends on the current one only, so an answer
    repeats whatever followed the same token before."""
    target = tiny_llama(seed=4)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return target


def test_a_copying_workload_through_batches_and_finished_rows():
    from dspine.engine.generate import generate

    target = bigram_target()
    starts = [[123], [77], [9], [15], [180]]      # answers fall into one of two cycles; row 1's alone holds 104
    walks = generate(target, None, starts, max_new_tokens=29, stop_token_ids=[]).tokens
    chains = [s + a for s, a in zip(starts, walks)]
    prompts = [c[:30] + c[3:8] for c in chains]
    answers = generate(target, None, prompts, max_new_tokens=16, stop_token_ids=[]).tokens
    stop = 104
    assert stop in answers[1][:12] and all(stop not in a for k, a in enumerate(answers) if k != 1)   # row 1 leaves
    drafter = drafter_for(target, block_size=6)
    res = measure_workload(target, drafter, prompts, max_new_tokens=16, stop_token_ids=[stop], batch_size=3)
    assert res["prompts"] == 5 and res["parity"] == 5 and res["complete_rounds"] > 0
    assert res["tau_copy"] > res["tau_nocopy"] and drafter.config.copy_candidates is False
    tau = res["ceiling"]
    assert tau["tree_chains"] >= max(tau["lattice"], tau["chain_0"], tau["chain_1"])
    assert tau["tree_walk"] >= max(tau["lattice"], tau["copy_walk"]) and tau["copy_walk"] > 2.0
    assert tau["union"] >= max(tau["copy_walk"], tau["argmax"])
    assert all(1.0 <= v <= 6.0 for v in tau.values())
