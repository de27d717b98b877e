"""The fused cross-entropy gradients kernel (`dspine.kernels.cross_entropy`) against the trainer's
PyTorch chunk (`dspine.train.losses.chunk_gradients`): gradients, CE and argmax for one and two
levels, fp32 and bf16 logits, a vocabulary that is not a multiple of the tile, ties for the largest
logit across tiles, and the trainer's dispatch choosing between them.
CPU: the Triton interpreter (tests/conftest.py). GPU host: `TRITON_INTERPRET=0 pytest -m gpu
tests/test_cross_entropy_kernel.py` (full vocabularies)."""

import pytest
import torch

pytest.importorskip("triton")

from triton_marks import gpu, interpreted  # noqa: E402

from dspine.kernels import dispatch  # noqa: E402
from dspine.kernels.cross_entropy import BLOCK_V, cross_entropy_grads  # noqa: E402
from dspine.train.losses import chunk_gradients, fused_chunk_gradients  # noqa: E402


def _inputs(levels: int, dtype: torch.dtype, rows: int = 6, vocab: int = BLOCK_V + 777, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(rows, vocab, generator=g) * 3).to(dtype) for _ in range(levels)]
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0] = vocab - 1                                     # a label in the last, partial tile
    weights = torch.rand(rows, generator=g)
    weights[1] = 0.0                                          # an ignored row
    coefs = (1.0, 0.5)[:levels]
    return parts, labels, weights, coefs


@interpreted
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_pytorch_chunk(levels, dtype):
    parts, labels, weights, coefs = _inputs(levels, dtype)
    got_grads, got_ce, got_argmax = cross_entropy_grads(parts, labels, weights, coefs)
    want_grads, want_ce, want_argmax = chunk_gradients(parts, labels, weights, coefs)
    tol = dict(atol=1e-6, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got_ce, want_ce, atol=1e-4, rtol=1e-5)
    assert torch.equal(got_argmax, want_argmax)


@interpreted
def test_argmax_takes_the_first_of_equal_logits_across_tiles():
    parts, labels, weights, coefs = _inputs(2, torch.float32)
    for p in parts:
        p[:, 5] = 100.0                                       # the same largest logit in tiles 0 and 1
        p[:, BLOCK_V + 3] = 100.0
    parts[1][2, BLOCK_V + 3] = 101.0                          # row 2, level 2: the later one is larger
    _, _, got = cross_entropy_grads(parts, labels, weights, coefs)
    _, _, want = chunk_gradients(parts, labels, weights, coefs)
    assert torch.equal(got, want) and got[0, 0] == 5 and got[1, 2] == BLOCK_V + 3


@interpreted
def test_the_trainers_chunk_fn_runs_the_kernel_where_dispatch_picks_triton():
    parts, labels, weights, coefs = _inputs(2, torch.float32, rows=3)
    calls = []

    def reference(*args):
        calls.append("reference")
        return chunk_gradients(*args)

    chunk_fn = fused_chunk_gradients(reference)
    with dispatch.forced("torch"):
        chunk_fn(parts, labels, weights, coefs)
    with dispatch.forced("triton"):
        got = chunk_fn(parts, labels, weights, coefs)
        chunk_fn(parts + parts[:1], labels, weights, (1.0, 1.0, 1.0))   # three levels: the reference
    assert calls == ["reference", "reference"]
    torch.testing.assert_close(got[1], chunk_gradients(parts, labels, weights, coefs)[1], atol=1e-4, rtol=1e-5)


@interpreted
def test_linear_cross_entropy_through_the_kernel_gives_the_reference_loss_and_gradients():
    from dspine.train.losses import linear_cross_entropy
    g = torch.Generator().manual_seed(1)
    n, d, vocab = 10, 16, BLOCK_V + 100
    xs = [torch.randn(n, d, generator=g, requires_grad=True), torch.randn(n, 8, generator=g, requires_grad=True)]
    ws = [torch.randn(vocab, d, generator=g, requires_grad=True), torch.randn(vocab, 8, generator=g)]
    labels, weights = torch.randint(0, vocab, (n,), generator=g), torch.rand(n, generator=g)
    results = []
    for chunk_fn in (chunk_gradients, fused_chunk_gradients()):
        with dispatch.forced("triton"):
            loss, levels, argmax = linear_cross_entropy(xs, ws, labels, weights, (1.0, 0.3), chunk_rows=4,
                                                        chunk_fn=chunk_fn)
        grads = torch.autograd.grad(loss, [xs[0], xs[1], ws[0]])
        results.append((loss.detach(), levels, argmax, grads))
    (loss_r, levels_r, argmax_r, grads_r), (loss_k, levels_k, argmax_k, grads_k) = results
    torch.testing.assert_close(loss_k, loss_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(levels_k, levels_r, atol=1e-5, rtol=1e-5)
    assert torch.equal(argmax_k, argmax_r)
    for got, want in zip(grads_k, grads_r):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("vocab", [49152, 151936])
def test_kernel_matches_the_pytorch_chunk_gpu(levels, vocab):
    g = torch.Generator(device="cuda").manual_seed(levels)
    parts = [(torch.randn(512, vocab, generator=g, device="cuda") * 3).bfloat16() for _ in range(levels)]
    labels = torch.randint(0, vocab, (512,), generator=g, device="cuda")
    weights = torch.rand(512, generator=g, device="cuda")
    coefs = (1.0, 0.5)[:levels]
    got_grads, got_ce, got_argmax = cross_entropy_grads(parts, labels, weights, coefs)
    want_grads, want_ce, want_argmax = chunk_gradients(parts, labels, weights, coefs)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(got_ce, want_ce, atol=1e-3, rtol=1e-4)
    assert torch.equal(got_argmax, want_argmax)
