"""ReplaySSM: Triton kernels vs references, replay vs sequential decoding, hybrid runner vs transformers."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: Triton kernels run in the interpreter (set before import)

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule  # noqa: E402

from dspine.engine.hybrid_target import HybridTargetRunner  # noqa: E402
from dspine.kernels.gated_delta_replay import (  # noqa: E402
    gated_delta_replay,
    gated_delta_replay_reference,
    gated_delta_verify_outputs,
    gated_delta_verify_outputs_reference,
)
from dspine.engine.replay_ssm import ReplaySSMState, verify_scratch_bytes  # noqa: E402
from conftest import tiny_qwen3_next  # noqa: E402

torch.set_num_threads(1)


def _inputs(N, T, HV, K, V, dtype=torch.float32, seed=0):
    """Random recurrence inputs: state [N, HV, K, V] fp32; q, k unit-norm [N, T, HV, K]; v; g <= 0; beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(N, HV, K, V, generator=gen)
    q = F.normalize(torch.randn(N, T, HV, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(N, T, HV, K, generator=gen), dim=-1)
    v = torch.randn(N, T, HV, V, generator=gen)
    g = -torch.rand(N, T, HV, generator=gen)
    beta = torch.rand(N, T, HV, generator=gen)
    return state, q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def _accept_lens(N, T, seed=0):
    """Random 0..T with 0 and T always present."""
    a = torch.randint(0, T + 1, (N,), generator=torch.Generator().manual_seed(seed))
    a[0], a[-1] = 0, T
    return a


SHAPES = [(2, 1, 1, 16, 16), (3, 5, 2, 16, 40), (4, 16, 2, 32, 32)]  # (N, T, HV, K, V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,T,HV,K,V", SHAPES)
def test_replay_kernel_matches_reference(N, T, HV, K, V, dtype):
    state, _, k, v, g, beta = _inputs(N, T, HV, K, V, dtype)
    a = _accept_lens(N, T)
    ref = gated_delta_replay_reference(state, k, v, g, beta, a)
    out = torch.full_like(state, float("nan"))
    gated_delta_replay(state, k, v, g, beta, a, out=out)
    assert (out - ref).abs().max() <= 1e-5
    assert torch.equal(out[0], state[0])  # nothing accepted: checkpoint unchanged
    inplace = state.clone()
    gated_delta_replay(inplace, k, v, g, beta, a, out=inplace)
    assert torch.equal(inplace, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU with compiled Triton (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("N", [1, 8, 32])
def test_replay_and_verify_kernels_gpu_27b_like(N):
    """Full 27B-like head shapes (HV 16, K = V = 128, T 16) on the GPU, bf16 records, fp32 state."""
    state, q, k, v, g, beta = (t.cuda() for t in _inputs(N, 16, 16, 128, 128, torch.bfloat16, seed=N))
    a = _accept_lens(N, 16, seed=N).cuda()
    out = torch.full_like(state, float("nan"))
    gated_delta_replay(state, k, v, g, beta, a, out=out)
    assert (out - gated_delta_replay_reference(state, k, v, g, beta, a)).abs().max() <= 1e-5
    o = torch.full((N, 16, 16, 128), float("nan"), device="cuda")
    gated_delta_verify_outputs(state, q.float(), k.float(), v.float(), g, beta, out=o)
    assert (o - gated_delta_verify_outputs_reference(state, q.float(), k.float(), v.float(), g, beta)).abs().max() <= 1e-5


@pytest.mark.parametrize("N,T,HV,K,V", SHAPES)
def test_verify_kernel_matches_reference(N, T, HV, K, V):
    state, q, k, v, g, beta = _inputs(N, T, HV, K, V)
    ref = gated_delta_verify_outputs_reference(state, q, k, v, g, beta)
    out = torch.full((N, T, HV, V), float("nan"))
    gated_delta_verify_outputs(state, q, k, v, g, beta, out=out)
    assert (out - ref).abs().max() <= 1e-5


def test_verify_reference_matches_transformers():
    """Outputs and final state follow transformers' token-by-token recurrence."""
    state, q, k, v, g, beta = _inputs(2, 6, 3, 16, 8)
    o_ref, s_ref = torch_recurrent_gated_delta_rule(
        q * 16**0.5, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    assert (gated_delta_verify_outputs_reference(state, q, k, v, g, beta) - o_ref).abs().max() <= 1e-5
    full = gated_delta_replay_reference(state, k, v, g, beta, torch.full((2,), 6))
    assert (full - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_replay_equals_sequential_decoding(kernels, monkeypatch):
    """Rounds of random accept lengths 0..15 (full rejection and full acceptance included)."""
    monkeypatch.setenv("DSPINE_KERNELS", kernels)
    L, N, T, HV, K, V, C, W = 2, 4, 15, 2, 16, 8, 6, 4
    ssm = ReplaySSMState(L, N, HV, K, V, conv_dim=C, conv_kernel=W)
    seq_state = torch.zeros(L, N, HV, K, V)
    seq_conv_in = [[[] for _ in range(N)] for _ in range(L)]  # every committed pre-conv input
    for rnd in range(6):
        a = _accept_lens(N, T, seed=rnd)
        ssm.begin(T)
        for layer in range(L):
            _, _, k, v, g, beta = _inputs(N, T, HV, K, V, seed=100 * rnd + layer)
            conv_in = torch.randn(N, C, T)
            ssm.record_layer(layer, k, v, g, beta, conv_in)
            for n in range(N):
                for t in range(int(a[n])):  # sequential decoding: one token at a time
                    _, s = torch_recurrent_gated_delta_rule(
                        k[n : n + 1, t : t + 1], k[n : n + 1, t : t + 1], v[n : n + 1, t : t + 1],
                        g[n : n + 1, t : t + 1], beta[n : n + 1, t : t + 1],
                        initial_state=seq_state[layer, n : n + 1], output_final_state=True,
                    )
                    seq_state[layer, n] = s[0]
                    seq_conv_in[layer][n].append(conv_in[n, :, t])
        ssm.commit(a)
        assert (ssm.state - seq_state).abs().max() <= 1e-5
        for layer in range(L):
            for n in range(N):
                window = torch.stack([torch.zeros(C)] * (W - 1) + seq_conv_in[layer][n], dim=-1)[:, -(W - 1) :]
                assert torch.equal(ssm.conv[layer, n], window)
    before = ssm.state.clone()
    ssm.select(torch.tensor([3, 1]))
    assert torch.equal(ssm.state, before[:, [3, 1]])


@torch.no_grad()
def _hf_one_at_a_time(model, seq: list[int], prompt_len: int) -> torch.Tensor:
    """transformers' own cache path: the prompt in one forward, then one token per forward -> [len, V]."""
    ids = torch.tensor([seq])
    out = model(ids[:, :prompt_len], use_cache=True)
    logits = [out.logits[0]]
    for i in range(prompt_len, len(seq)):
        out = model(ids[:, i : i + 1], cache=out.cache, use_cache=True)
        logits.append(out.logits[0])
    return torch.cat(logits)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("prompt_lens", [[6], [5, 9, 2]])
def test_hybrid_runner_matches_transformers(prompt_lens, kernels, monkeypatch):
    monkeypatch.setenv("DSPINE_KERNELS", kernels)
    model = tiny_qwen3_next()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in prompt_lens]
    runner = HybridTargetRunner(model, layer_ids=[0, 1, 3])
    step = runner.prefill(prompts)
    with torch.no_grad():
        hf = model(torch.tensor([prompts[-1]]), output_hidden_states=True)
    hf_hidden = torch.cat([hf.hidden_states[i + 1] for i in (0, 1, 3)], dim=-1)[0]
    assert (step.hidden[-1, : prompt_lens[-1]] - hf_hidden).abs().max() <= 1e-5

    seqs = [list(p) for p in prompts]
    logits = [[step.logits[b, : len(p)]] for b, p in enumerate(prompts)]
    rows = list(range(len(prompts)))
    for rnd in range(5):
        bs = runner.batch_size
        tokens = torch.randint(0, 256, (bs, 5), generator=gen)
        keep = torch.randint(1, 6, (bs,), generator=gen)
        keep[0], keep[-1] = 1, 5
        step = runner.verify(tokens)
        assert step.logits.shape == (bs, 5, 256) and step.hidden.shape == (bs, 5, 3 * 64)
        runner.commit(keep)
        for b, row in enumerate(rows):
            seqs[row] += tokens[b, : keep[b]].tolist()
            logits[row].append(step.logits[b, : keep[b]])
        if rnd == 2 and bs > 1:  # a request leaves mid-generation
            rows = [rows[0], rows[2]]
            runner.select(torch.tensor([0, 2]))
    assert runner.lengths.tolist() == [len(seqs[r]) for r in rows]
    for row, p in enumerate(prompts):
        ref = _hf_one_at_a_time(model, seqs[row], len(p))
        assert (torch.cat(logits[row]) - ref).abs().max() <= 1e-5


def test_scratch_bytes_27b_like():
    """48 GDN layers, HV=16, K=V=128, T=16, fp32 state: ReplaySSM records >= 5x smaller."""
    L, T, HV, K, V, C, W = 48, 16, 16, 128, 128, 2 * 16 * 128 + 16 * 128, 4
    shape = dict(num_layers=L, num_tokens=T, num_v_heads=HV, head_k_dim=K, head_v_dim=V, conv_dim=C, conv_kernel=W)
    scratch = verify_scratch_bytes(**shape)
    assert scratch.snapshot_state == L * T * HV * K * V * 4
    assert scratch.ratio >= 5
    fp32 = verify_scratch_bytes(**shape, record_bytes=4, conv_bytes=4)
    assert fp32.ratio >= 5
    ssm = ReplaySSMState(L, 1, HV, K, V, conv_dim=C, conv_kernel=W)
    ssm.begin(T)
    allocated = sum(t.numel() * t.element_size() for t in (ssm.record.k, ssm.record.v, ssm.record.g,
                                                            ssm.record.beta, ssm.record.conv_in))
    assert allocated == fp32.replayssm
