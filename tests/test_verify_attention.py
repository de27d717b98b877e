"""Block-verify attention (dspine/kernels/verify_attention.py): the PyTorch reference against plain
softmax attention over explicitly built keys and masks, and the Triton kernel against the reference.

CPU: the kernel runs in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before any kernel is built).
GPU host: `TRITON_INTERPRET=0 pytest -m gpu tests/test_verify_attention.py`. Outputs are pre-filled
with NaN so an unwritten element fails.
"""

import pytest
import torch

pytest.importorskip("triton")

from triton_marks import gpu, interpreted  # noqa: E402

from dspine.kernels.verify_attention import verify_attention, verify_attention_reference  # noqa: E402


def paged_case(lengths, block, hq, hkv, d, *, dtype=torch.float32, device="cpu", seed=0):
    """Random q / new k, v for each request's block, a KV pool with the prefixes at shuffled slots
    (plus unused slots), kv_indptr (int32) and kv_indices (int64), and the dense prefixes per request."""
    g = torch.Generator().manual_seed(seed)
    bs, total = len(lengths), sum(lengths)
    slots = total + 7
    k_buffer = torch.randn(slots, hkv, d, generator=g)
    v_buffer = torch.randn(slots, hkv, d, generator=g)
    kv_indices = torch.randperm(slots, generator=g)[:total]
    kv_indptr = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    q = torch.randn(bs * block, hq, d, generator=g)
    k = torch.randn(bs * block, hkv, d, generator=g)
    v = torch.randn(bs * block, hkv, d, generator=g)
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), cast(k_buffer), cast(v_buffer), kv_indptr.to(device), kv_indices.to(device))


def dense_attention(q, k, v, k_buffer, v_buffer, kv_indptr, kv_indices, block, causal, scale):
    """Written from the definition, one (request, query head, token) at a time."""
    tokens, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty(tokens, hq, d, dtype=torch.float64)
    for b in range(tokens // block):
        slots = kv_indices[int(kv_indptr[b]): int(kv_indptr[b + 1])]
        for h in range(hq):
            kh = h // group
            for t in range(block):
                visible = list(range(block)) if not causal else list(range(t + 1))
                keys = torch.cat([k_buffer[slots, kh], k[b * block + torch.tensor(visible, dtype=torch.long), kh]])
                vals = torch.cat([v_buffer[slots, kh], v[b * block + torch.tensor(visible, dtype=torch.long), kh]])
                w = (keys.double() @ q[b * block + t, h].double() * scale).softmax(0)
                out[b * block + t, h] = w @ vals.double()
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_reference_equals_dense_attention(causal):
    case = paged_case([5, 0, 11], block=4, hq=6, hkv=2, d=8)
    want = dense_attention(*case, block=4, causal=causal, scale=0.3)
    got = verify_attention_reference(*case, block=4, causal=causal, scale=0.3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("lengths,block,hq,hkv,d,splits,causal", [
    ([0, 1, 70, 300], 16, 9, 3, 64, 4, True),      # SmolLM2's heads, empty and one-token prefixes
    ([130], 16, 9, 3, 64, 16, False),                # the drafter's bidirectional block, more splits than tiles
    ([17, 64], 4, 8, 8, 16, 2, True),                # no grouping, a small block
    ([200, 5], 8, 16, 2, 32, 3, True),               # 8 query heads per KV head (one 64-row tile)
    ([33, 90], 16, 18, 2, 64, 3, True),              # 144 query rows a KV head: two row tiles, the last partial
])
def test_kernel_equals_reference(lengths, block, hq, hkv, d, splits, causal):
    case = paged_case(lengths, block, hq, hkv, d, seed=len(lengths) + d)
    q = case[0]
    out = torch.full_like(q, float("nan"))
    verify_attention(q, case[1], case[2], out, *case[3:], block=block, causal=causal, scale=d ** -0.5, splits=splits)
    want = verify_attention_reference(*case, block=block, causal=causal, scale=d ** -0.5)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@interpreted
def test_kernel_reads_strided_pools_and_writes_strided_output():
    """SGLang's KV pool and output views: a buffer whose head dim is not the last stride's only user."""
    lengths, block, hq, hkv, d = [40, 9], 8, 4, 2, 16
    q, k, v, k_buffer, v_buffer, kv_indptr, kv_indices = paged_case(lengths, block, hq, hkv, d, seed=5)
    wide_k = torch.zeros(k_buffer.shape[0], hkv + 1, d)
    wide_k[:, :hkv] = k_buffer
    out_wide = torch.full((q.shape[0], hq + 2, d), float("nan"))
    out = out_wide[:, 1:hq + 1]
    verify_attention(q, k, v, out, wide_k[:, :hkv], v_buffer, kv_indptr, kv_indices, block=block, causal=True,
                     scale=0.25, splits=3)
    want = verify_attention_reference(q, k, v, k_buffer, v_buffer, kv_indptr, kv_indices, block=block, causal=True,
                                      scale=0.25)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert torch.isnan(out_wide[:, 0]).all() and torch.isnan(out_wide[:, -1]).all()   # nothing written outside


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lengths,hq,hkv,d", [([3000], 9, 3, 64), ([2000] * 8, 32, 8, 128), ([5, 8000, 40], 24, 4, 256)])
def test_verify_attention_gpu(lengths, hq, hkv, d):
    case = paged_case(lengths, 16, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=1)
    out = torch.full_like(case[0], float("nan"))
    verify_attention(case[0], case[1], case[2], out, *case[3:], block=16, causal=True, scale=d ** -0.5)
    want = verify_attention_reference(*case, block=16, causal=True, scale=d ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
