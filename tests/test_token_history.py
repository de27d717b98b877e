"""`SlotTokenHistory` (the SGLang worker's per-request token ids on the device) against a plain
Python list per request, through prefills, commits of every length and window reads."""

from __future__ import annotations

import random

import torch

from dspine.sglang.token_history import SlotTokenHistory


def test_history_follows_python_lists_through_prefills_and_commits():
    rng = random.Random(0)
    block, window = 4, 8
    hist = SlotTokenHistory(pool_rows=6, max_context_len=40, block_size=block, window=window, max_bs=4, device="cpu")
    truth: dict[int, list[int]] = {}
    slots = [3, 1, 5]
    prompts = [[rng.randrange(100) for _ in range(n)] for n in (3, 12, 1)]
    firsts = torch.tensor([101, 102, 103])
    hist.write_prefill(torch.tensor(slots), prompts, firsts)
    for slot, prompt, first in zip(slots, prompts, firsts.tolist()):
        truth[slot] = prompt + [first]          # the anchor is the last token
    for _ in range(6):
        idx = torch.tensor(slots)
        prefix = torch.tensor([len(truth[s]) - 1 for s in slots])   # the anchor's position
        hist.prepare_draft(idx, prefix)
        tokens, lengths = hist.window_rows(len(slots))
        for b, s in enumerate(slots):
            want = truth[s][-window:]
            assert int(lengths[b]) == len(want)
            assert tokens[b, : len(want)].tolist() == want
        out = torch.randint(200, 300, (len(slots), block))
        commit = [rng.randint(1, block) for _ in slots]
        hist.write_committed(idx, prefix, out)
        for b, s in enumerate(slots):
            truth[s] += out[b, : commit[b]].tolist()
            # the row's tail past the commit is written too but never read: the next prefix stops before it
    assert hist.ids[0].eq(0).all()                      # SGLang's padding row is never touched


def test_writes_past_the_capacity_are_clamped_into_it():
    hist = SlotTokenHistory(pool_rows=2, max_context_len=6, block_size=4, window=4, max_bs=1, device="cpu")
    hist.write_prefill(torch.tensor([1]), [[1, 2, 3, 4, 5]], torch.tensor([6]))
    hist.write_committed(torch.tensor([1]), torch.tensor([8]), torch.tensor([[7, 8, 9, 10]]))
    assert hist.ids.shape[1] == 6 + 4 + 1
    assert hist.ids[1].tolist()[:9] == [0, 2, 3, 4, 5, 6, 0, 0, 0]   # only the last `window` prompt tokens
    assert hist.ids[1, 9] == 7
