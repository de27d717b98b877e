"""The suffix match behind copy candidates (dspine/kernels/suffix_match.py): the PyTorch reference
against a brute-force search written from the definition, and the Triton kernel against the reference.

CPU: the kernel runs in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before any kernel is built).
GPU host: `TRITON_INTERPRET=0 pytest -m gpu tests/test_suffix_match.py`. Outputs are pre-filled with
garbage so an unwritten element fails.
"""

import pytest
import torch

pytest.importorskip("triton")

from triton_marks import gpu, interpreted  # noqa: E402

from dspine.kernels.suffix_match import suffix_match, suffix_match_reference  # noqa: E402


def brute_suffix_match(tokens: list[int], n: int, min_match: int, max_match: int, max_span: int,
                       window: int) -> tuple[list[int], int]:
    """The definition, by string search: the longest suffix (at most max_match tokens) of the last
    `window` tokens that occurs again ending before the anchor, its most recent occurrence, and the
    tokens after that occurrence (at most max_span, up to the anchor)."""
    length = len(tokens)
    lo = max(0, length - window)
    for m in range(min(max_match, length - lo), min_match - 1, -1):
        suffix = tokens[length - m:]
        for end in range(length - 2, lo + m - 2, -1):                    # most recent first
            if tokens[end - m + 1:end + 1] == suffix:
                span = tokens[end + 1:min(end + 1 + max_span, length)]
                return span + [-1] * (n - len(span)), m
    return [-1] * n, 0


def _random_rows(g: torch.Generator, bs: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    history = torch.randint(0, vocab, (bs, width), generator=g)
    lengths = torch.randint(0, width + 1, (bs,), generator=g)
    return history, lengths


def _check_brute(history, lengths, **kw):
    copy_ids, match_len = suffix_match_reference(history, lengths, **kw)
    for b in range(history.shape[0]):
        want = brute_suffix_match(history[b, :int(lengths[b])].tolist(), kw["n"], kw["min_match"], kw["max_match"],
                                  kw["max_span"], kw["window"])
        assert (copy_ids[b].tolist(), int(match_len[b])) == want, (history[b, :int(lengths[b])].tolist(), kw)
    return copy_ids, match_len


@pytest.mark.parametrize("seed", range(6))
def test_reference_equals_brute_force_on_random_histories(seed):
    g = torch.Generator().manual_seed(seed)
    for trial in range(40):
        vocab = int(torch.randint(2, 6, (1,), generator=g))
        history, lengths = _random_rows(g, 4, int(torch.randint(1, 48, (1,), generator=g)), vocab)
        min_match = int(torch.randint(1, 4, (1,), generator=g))
        _check_brute(history, lengths, n=7, min_match=min_match,
                     max_match=min_match + int(torch.randint(0, 6, (1,), generator=g)),
                     max_span=int(torch.randint(1, 8, (1,), generator=g)),
                     window=int(torch.randint(2, 60, (1,), generator=g)))


@pytest.mark.parametrize("tokens, kw, want", [
    # a repeated phrase: the longest match wins over a more recent shorter one
    ([5, 6, 7, 8, 9, 1, 7, 8, 2, 6, 7, 8], dict(min_match=1, max_match=8, max_span=4), ([9, 1, 7, 8, -1], 3)),
    # one token over and over: every earlier end matches up to the cap, the most recent one (just
    # before the anchor) wins and its continuation stops at the anchor; uncapped, the same end
    ([4] * 10, dict(min_match=2, max_match=2, max_span=5), ([4, -1, -1, -1, -1], 2)),
    ([4] * 10, dict(min_match=2, max_match=20, max_span=5), ([4, -1, -1, -1, -1], 9)),
    # a period of 3: the most recent full-length occurrence is one period back
    ([1, 2, 3] * 4, dict(min_match=2, max_match=4, max_span=5), ([1, 2, 3, -1, -1], 4)),
    # shorter than min_match, or a match shorter than min_match: nothing
    ([3], dict(min_match=1, max_match=4, max_span=5), ([-1] * 5, 0)),
    ([1, 2, 3, 1, 2], dict(min_match=3, max_match=4, max_span=5), ([-1] * 5, 0)),
    # the window hides the earlier occurrence
    ([1, 2, 3, 9, 9, 9, 1, 2], dict(min_match=2, max_match=4, max_span=5, window=5), ([-1] * 5, 0)),
    ([1, 2, 3, 9, 9, 9, 1, 2], dict(min_match=2, max_match=4, max_span=5, window=8), ([3, 9, 9, 9, 1], 2)),
])
def test_reference_on_adversarial_histories(tokens, kw, want):
    kw = {"window": 64, **kw}
    history = torch.tensor([tokens + [0] * 3])
    copy_ids, match_len = _check_brute(history, torch.tensor([len(tokens)]), n=5, **kw)
    assert (copy_ids[0].tolist(), int(match_len[0])) == want


def _check_kernel(history, lengths, block=256, **kw):
    """Kernel == reference exactly, into outputs pre-filled with garbage; returns the outputs."""
    bs = history.shape[0]
    out = (torch.full((bs, kw["n"]), 987654, dtype=torch.long, device=history.device),
           torch.full((bs,), -987654, dtype=torch.long, device=history.device))
    got = suffix_match(history, lengths, out=out, block=block, **kw)
    assert got[0] is out[0] and got[1] is out[1]
    want = suffix_match_reference(history, lengths, **kw)
    assert torch.equal(out[0], want[0]), (out[0], want[0])
    assert torch.equal(out[1], want[1]), (out[1], want[1])
    return out


@interpreted
@pytest.mark.parametrize("width, window, block", [(64, 64, 16), (300, 100, 32), (1000, 4096, 256),
                                                  (8192, 8192, 256), (8192, 2048, 512)])
def test_kernel_equals_reference(width, window, block):
    g = torch.Generator().manual_seed(width + window)
    history = torch.randint(0, 6, (5, width), generator=g)
    history[1, : width // 2] = history[1, width // 2: 2 * (width // 2)]        # a long copied span
    history[2] = 7                                                             # one token repeated
    history[3, -1] = 99                                                        # anchor never seen before
    lengths = torch.tensor([width, width, width - 3, width, 1])                # row 4: shorter than min_match
    for kw in (dict(min_match=2, max_match=32, max_span=15), dict(min_match=1, max_match=4, max_span=3)):
        copy_ids, match_len = _check_kernel(history, lengths, block=block, n=15, window=window, **kw)
        assert int(match_len[3]) == 0 and (copy_ids[3] == -1).all()
        assert int(match_len[4]) == 0 and (copy_ids[4] == -1).all()
        assert int(match_len[2]) == kw["max_match"]


@interpreted
def test_kernel_on_random_small_histories():
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        history, lengths = _random_rows(g, 3, int(torch.randint(1, 80, (1,), generator=g)), 3)
        _check_kernel(history.int(), lengths, block=16, n=6, min_match=1 + trial % 3, max_match=3 + trial % 5,
                      max_span=1 + trial % 6, window=int(torch.randint(2, 90, (1,), generator=g)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bs", [1, 8, 64])
@pytest.mark.parametrize("window", [64, 1024, 8192])
def test_suffix_match_gpu(bs, window):
    """Full windows on CUDA: random text, a copied span, one repeated token, no match."""
    g = torch.Generator(device="cuda").manual_seed(bs * 10 + window)
    history = torch.randint(0, 50000, (bs, window), generator=g, device="cuda")
    history[0, window // 2:] = history[0, : window - window // 2]
    if bs > 1:
        history[1] = 11
    lengths = torch.randint(window // 2, window + 1, (bs,), generator=g, device="cuda")
    lengths[0] = window
    copy_ids, match_len = _check_kernel(history, lengths, n=15, min_match=2, max_match=32, max_span=15, window=window)
    assert int(match_len[0]) == 32 and bool((copy_ids[0] >= 0).all())
