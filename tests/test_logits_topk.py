"""The split-V top-k of the draft logits (dspine/kernels/logits_topk.py) against its PyTorch reference.

CPU: the Triton interpreter at small shapes (TRITON_INTERPRET=1, set by tests/conftest.py before any kernel is built;
`_multiprocessors` is 4 there, so rows still split into several slices and the merges run). GPU
host, full shapes: `TRITON_INTERPRET=0 pytest -m gpu tests/test_logits_topk.py`. Outputs are
pre-filled with NaN (-1 for indices) so an unwritten element fails. The reference and the kernel
share one tie rule (equal logits: lower index first), so indices must match exactly, ties or not;
`torch.sort(..., stable=True)` is the independent second oracle of that order.
"""

import pytest
import torch

pytest.importorskip("triton")

from triton_marks import gpu, interpreted  # noqa: E402

from dspine.kernels import logits_topk as topk_module  # noqa: E402
from dspine.kernels.logits_topk import logits_topk, logits_topk_reference, topk_grid  # noqa: E402
from dspine.kernels.topk_keys import ordered_keys_reference  # noqa: E402
from dspine.model.selection import select_tokens  # noqa: E402
from dspine.model.transition import TransitionScorer  # noqa: E402


def _distinct(m: int, v: int, dtype: torch.dtype, seed: int = 0, device="cpu",
              span: float = float("inf")) -> torch.Tensor:
    """[m, v] logits without any tie in a row: a random permutation per row of v distinct values of
    `dtype` (fp32: spaced integers / 64, exact; bf16/fp16: distinct finite bit patterns of magnitude
    <= span, the whole range by default)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        pool = (torch.arange(v, dtype=torch.float32) - v // 2) * 3 / 64
    else:
        bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        keep = bits.float().isfinite() & ~((bits == 0) & bits.float().signbit()) & (bits.float().abs() <= span)
        pool = bits[keep]                                        # one zero
        pool = pool[torch.randperm(pool.numel(), generator=g)[:v]]
    assert pool.numel() == v and pool.float().unique().numel() == v
    order = torch.rand(m, v, generator=torch.Generator(device).manual_seed(seed), device=device).argsort(-1)
    return pool.to(device)[order]                                # [m, v]: a permutation of the pool per row


def _run(logits: torch.Tensor, k: int, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    lead = logits.shape[:-1]
    values = torch.full((*lead, k), float("nan"), device=logits.device)
    indices = torch.full((*lead, k), -1, dtype=torch.int64, device=logits.device)
    got = logits_topk(logits, k, out=(values, indices), **knobs)
    assert got[0] is values and got[1] is indices
    return values, indices


def _check(logits: torch.Tensor, k: int, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel == reference: indices exactly, values exactly (NaN == NaN, -0.0 == +0.0)."""
    values, indices = _run(logits, k, **knobs)
    want_val, want_idx = logits_topk_reference(logits, k)
    assert (indices >= 0).all(), "an index was never written"
    assert torch.equal(indices, want_idx), (indices, want_idx)
    torch.testing.assert_close(values, want_val, rtol=0, atol=0, equal_nan=True)
    return values, indices


def _stable_sort_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[..., :k]


def _tickets_are_zero() -> bool:
    return all(bool((b == 0).all()) for bufs in topk_module._TICKETS.values() for b in bufs)


@interpreted
@pytest.mark.parametrize("m, v, k, dtype, knobs", [
    (1, 1000, 4, torch.float32, {}),
    (3, 4099, 8, torch.bfloat16, {}),
    (16, 1000, 16, torch.float32, {}),
    (64, 1000, 8, torch.bfloat16, {}),                          # one slice per row: no merge
    (2, 49152, 8, torch.bfloat16, {}),
    (5, 4099, 16, torch.float32, {"merge": "kernel"}),
    (6, 4099, 8, torch.bfloat16, {"block_m": 4, "block_v": 256}),
    (3, 3000, 4, torch.float16, {"slices": 1}),
    (2, 4099, 16, torch.float32, {"slices": 9, "block_v": 64}),  # the last slice holds 3 columns < K
])
def test_logits_topk_matches_reference(m, v, k, dtype, knobs):
    logits = _distinct(m, v, dtype, seed=m + v)
    values, indices = _check(logits, k, **knobs)
    assert torch.equal(indices, _stable_sort_topk(logits, k))
    assert (values[:, :-1] > values[:, 1:]).all()               # sorted, and tie-free as built
    assert torch.equal(values, logits.float().gather(-1, indices))
    assert _tickets_are_zero()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_topk_on_gaussian_logits(dtype):
    """Plain randn logits (bf16 has exact ties among 4k values) through every merge path, [bs, N, V]."""
    logits = (torch.randn(3, 5, 4099, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    for knobs in ({}, {"merge": "kernel"}, {"slices": 1}, {"block_m": 2, "block_v": 512}):
        values, indices = _check(logits, 8, **knobs)
        assert values.shape == indices.shape == (3, 5, 8)
        assert torch.equal(indices, _stable_sort_topk(logits, 8))


@interpreted
@pytest.mark.parametrize("knobs", [{}, {"merge": "kernel"}, {"slices": 1}, {"block_m": 4, "block_v": 128}])
def test_ties_go_to_the_lower_index(knobs):
    """Rows drawn from five values: the k-th value is tied many times over, across tiles and slices.
    The top-k holds the lowest indices of each tied value, in index order; -0.0 ties +0.0."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 5, (6, 3001), generator=g).float() - 2
    logits[1] = 1.0                                              # a constant row: indices 0..k-1
    logits[2, ::2] = -0.0
    logits[2, 1::2] = 0.0                                        # signed zeros tie
    logits[3, 2000] = 7.0                                        # one winner late in the row, then ties
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        _, indices = _check(x, 8, **knobs)
        assert torch.equal(indices, _stable_sort_topk(x, 8))
        assert torch.equal(indices[1], torch.arange(8))
        assert torch.equal(indices[2], torch.arange(8))
        assert indices[3, 0] == 2000 and (indices[3, 1:].diff() > 0).all()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinities_and_extreme_values(dtype):
    """-inf everywhere but a few columns, all -inf, the most negative finite values, +inf and NaN
    (NaN ranks above +inf, as torch.topk ranks it)."""
    v, k = 2500, 8
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, v, generator=g)
    lowest = torch.finfo(dtype).min
    logits[0] = float("-inf")
    logits[0, [5, 1700, 2499]] = torch.tensor([-1e30, 3.0, lowest])  # fewer finite values than k
    logits[1] = float("-inf")                                   # all -inf: indices 0..k-1
    logits[2] = lowest
    logits[2, 1234] = lowest / 2
    logits[3, [10, 2000]] = float("inf")
    logits[3, 600] = float("nan")
    logits[3, 900] = -logits[3, 600]                             # a negative NaN: NaN all the same
    logits[4] = -1e30
    logits[4, 3] = float("-inf")
    logits[5, ::3] = float("-inf")
    x = logits.to(dtype)
    for knobs in ({}, {"merge": "kernel"}, {"slices": 1}):
        values, indices = _check(x, k, **knobs)
        assert torch.equal(indices[0, :3], torch.tensor([1700, 5, 2499])) and values[0, 3:].eq(float("-inf")).all()
        assert torch.equal(indices[0, 3:], torch.tensor([0, 1, 2, 3, 4]))
        assert torch.equal(indices[1], torch.arange(k)) and values[1].eq(float("-inf")).all()
        assert indices[2, 0] == 1234 and torch.equal(indices[2, 1:], torch.arange(k - 1))
        assert values[3, :2].isnan().all() and torch.equal(indices[3, :4], torch.tensor([600, 900, 10, 2000]))
        assert 3 not in indices[4].tolist()


def test_the_reference_orders_like_a_stable_sort():
    """The oracle itself, on CPU without Triton: ties, signed zeros, -inf; values are the logits."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 3, (4, 777), generator=g).float()
    x[0, :300] = -0.0
    x[1, 100:] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        values, indices = logits_topk_reference(x.to(dtype), 16)
        assert torch.equal(indices, _stable_sort_topk(x.to(dtype), 16))
        assert torch.equal(values, x.to(dtype).float().gather(-1, indices))
    keys = ordered_keys_reference(torch.tensor([1.0, -0.0, 0.0, float("nan"), float("-inf"), 1.0]))
    assert keys.argsort(descending=True).tolist() == [3, 0, 5, 1, 2, 4]


def test_launch_grid_covers_the_row_with_whole_tiles():
    """topk_grid: chunks are whole tiles, the slices cover V exactly once, rows x S >= the target."""
    cpu = torch.device("cpu")
    for rows, vocab, knobs in [(15, 151936, {}), (960, 151936, {}), (1, 100, {}), (15, 4099, {"block_v": 64}),
                               (7, 49152, {"slices": 1000}), (3, 5000, {"block_m": 2, "programs_per_sm": 8})]:
        tiles, splits, chunk = topk_grid(rows, vocab, cpu, **knobs)
        block_v = knobs.get("block_v", 1024)
        assert chunk % block_v == 0 and (splits - 1) * chunk < vocab <= splits * chunk
        assert tiles == -(-rows // knobs.get("block_m", 1))


@interpreted
def test_select_tokens_uses_the_kernel_and_equals_the_torch_path(monkeypatch):
    """select_tokens on its Triton path (forced, interpreter) takes its candidates from logits_topk
    and returns the torch path's Selection (candidates, tokens, choices and q) on tie-free logits."""
    g = torch.Generator().manual_seed(11)
    bs, n, vocab, rank, k = 3, 15, 2500, 16, 8
    table = torch.randn(vocab, rank, generator=g)
    scorer = TransitionScorer(rank)
    with torch.no_grad():
        scorer.weight.normal_(std=0.3, generator=g)
    anchors = torch.randint(0, vocab, (bs,), generator=g)
    temperature = torch.tensor([0.0, 0.8, 1.2])
    calls = []
    real = topk_module.logits_topk
    monkeypatch.setattr(topk_module, "logits_topk", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    for dtype in (torch.float32, torch.bfloat16):
        # tie-free: at a tie torch.topk orders the candidates its own way
        logits = _distinct(bs * n, vocab, dtype, seed=3, span=16).view(bs, n, vocab)
        picks = {}
        for mode in ("torch", "triton"):
            monkeypatch.setenv("DSPINE_KERNELS", mode)
            picks[mode] = select_tokens(logits, anchors, temperature, mode="transition", top_k=k, lam=1.0,
                                        scorer=scorer, table=table, generator=torch.Generator().manual_seed(5))
        want, got = picks["torch"], picks["triton"]
        assert torch.equal(got.cand_ids, want.cand_ids) and torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.choice, want.choice)
        torch.testing.assert_close(got.q, want.q, rtol=0, atol=1e-6)
    assert calls == [(bs, n, vocab)] * 2


# ------------------------------------------------------------------------------ GPU, full shapes
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bs", [1, 8, 32])
@pytest.mark.parametrize("k", [4, 8, 16])
def test_logits_topk_gpu(bs, k):
    """Qwen3-8B draft logits (V = 151,936, 15 slots a request), bf16 and fp32, both merges."""
    g = torch.Generator(device="cuda").manual_seed(bs * 100 + k)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(bs, 15, 151936, generator=g, device="cuda") * 4).to(dtype)
        for knobs in ({}, {"merge": "kernel"}, {"slices": 1}, {"block_v": 2048, "warps": 8}):
            _check(logits, k, **knobs)
    assert _tickets_are_zero()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bs", [1, 32])
def test_logits_topk_gpu_tie_free_and_ties(bs):
    """Full rows without a tie (fp32: bf16 has fewer than 151,936 finite values) and full rows of
    eight values (bf16: every top-k slot a tie), against the reference and a stable sort."""
    tie_free = _distinct(bs * 15, 151936, torch.float32, seed=bs, device="cuda")
    ties = torch.randint(-4, 4, (bs * 15, 151936), device="cuda").to(torch.bfloat16)
    for logits in (tie_free, ties):
        for knobs in ({}, {"merge": "kernel"}):
            _, indices = _check(logits, 8, **knobs)
            assert torch.equal(indices, _stable_sort_topk(logits, 8))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("eager_first", [True, False])
def test_logits_topk_gpu_cuda_graph(eager_first, monkeypatch):
    """Captured once, replayed on new logits: after an eager call made the ticket buffer (one-launch
    merge in the graph), and with no buffer yet (the capture falls back to the merge kernel)."""
    monkeypatch.setattr(topk_module, "_TICKETS", {})              # the old buffers stay alive (restored after)
    logits = torch.randn(8, 15, 151936, device="cuda").to(torch.bfloat16)
    out = (torch.empty(8, 15, 8, device="cuda"), torch.empty(8, 15, 8, dtype=torch.int64, device="cuda"))
    if eager_first:
        logits_topk(logits, 8, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits_topk(logits, 8, out=out)
    assert bool(topk_module._TICKETS) == eager_first                # nothing allocated inside the capture
    for seed in range(3):
        logits.copy_(torch.randn(8, 15, 151936, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        want_val, want_idx = logits_topk_reference(logits, 8)
        assert torch.equal(out[1], want_idx) and torch.equal(out[0], want_val)
    assert _tickets_are_zero()
