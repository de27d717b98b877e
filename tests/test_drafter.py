"""The drafter's structure: the injection ablation, gradient flow, layer scores, context window."""

from __future__ import annotations

import warnings

import torch

from conftest import drafter_for
from dspine.engine.proposer import DSpineProposer


def _inputs(model, bs=2, ctx=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    hidden = torch.randn(bs, ctx, cfg.num_context_features * cfg.hidden_size, generator=g)
    positions = torch.arange(ctx)[None].expand(bs, -1)
    kv = model.context_key_values(model.project_context(hidden), positions)
    anchors = torch.randint(4, cfg.vocab_size, (bs, 1), generator=g)
    blk = torch.arange(ctx, ctx + cfg.block_size)[None].expand(bs, -1)
    mask = torch.ones(bs, cfg.block_size, ctx + cfg.block_size, dtype=torch.bool)
    return anchors, blk, kv, mask


def test_injection_off_equals_drafter_without_injection_modules(llama_target):
    with_inj = drafter_for(llama_target, seed=0)
    without = drafter_for(llama_target, seed=0, injection=False)
    assert without.injections is None and not any("injections" in k for k in without.state_dict())
    state = {k: v for k, v in with_inj.state_dict().items() if k in without.state_dict()}
    without.load_state_dict(state, strict=True)
    # The injection switch alone changes the output; with it off the layers are the DFlash-style stack.
    args = _inputs(with_inj)
    out_on = with_inj(*args).hidden
    with_inj.injections = None
    assert torch.equal(with_inj(*args).hidden, without(*args).hidden)
    assert not torch.allclose(out_on, without(*args).hidden)


def test_gradients_reach_gate_and_transfer_projection(llama_target):
    model = drafter_for(llama_target).train()
    out = model(*_inputs(model), need_layer_scores=True)
    assert len(out.layer_scores) == model.config.num_hidden_layers
    loss = model.logits(out.hidden).logsumexp(-1).mean() + sum(s.logsumexp(-1).mean() for s in out.layer_scores)
    loss.backward()
    for name in ("transfer.proj.weight", "injections.0.gate.weight", "injections.4.gate.weight",
                 "injections.2.out_proj.weight", "injections.3.score_proj.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, f"no gradient reaches {name}"


def test_anchor_position_receives_no_injection(llama_target):
    model = drafter_for(llama_target)
    anchors, blk, kv, mask = _inputs(model)
    # Changing only the anchor id changes what the anchor injects into position 1, nothing before it.
    a = model(anchors, blk, kv, mask).hidden
    table = model.transfer_table()
    inj = model.injections[0]
    h = torch.randn(3, model.config.block_size, model.config.hidden_size)
    out, _ = inj(h, table, torch.tensor([5, 6, 7]), need_scores=False)
    assert torch.equal(out[:, 0], h[:, 0]) and not torch.equal(out[:, 1], h[:, 1])
    assert a.shape == (2, model.config.block_size, model.config.hidden_size)


def test_sliding_window_drops_old_context(llama_target):
    model = drafter_for(llama_target, sliding_window=16, block_size=8)
    prop = DSpineProposer(model)
    hidden = torch.randn(1, 40, model.config.num_context_features * model.config.hidden_size)
    prop.start(torch.zeros(1, 40, dtype=torch.long), hidden, torch.tensor([40]))
    assert prop.valid.shape[1] == 16 and int(prop.positions.min()) == 24
    out = prop.propose(torch.tensor([5]), torch.zeros(1), None)
    # Same proposal when the dropped context is absent from the start.
    prop2 = DSpineProposer(model)
    pos_tail = hidden[:, 24:]
    prop2.start(torch.zeros(1, 16, dtype=torch.long), pos_tail, torch.tensor([16]))
    prop2.positions = prop2.positions + 24
    prop2.lengths = prop2.lengths + 24
    prop2.kv = model.context_key_values(model.project_context(pos_tail), prop2.positions)
    assert torch.equal(prop2.propose(torch.tensor([5]), torch.zeros(1), None).tokens, out.tokens)


def test_first_layer_candidates_equal_per_layer_when_every_token_is_a_candidate(llama_target):
    """injection_candidates="first_layer" re-weights layer 1's top-k in later layers: with k = V the
    candidate sets are the whole vocabulary, so it must equal the per-layer scan (hidden states and
    layer scores); with k = 2 it differs, and training still reaches every layer's score projection."""
    vocab = llama_target.config.vocab_size
    args = None
    for k, same in ((vocab, True), (2, False)):
        per = drafter_for(llama_target, seed=0, injection_top_k=k)
        first = drafter_for(llama_target, seed=0, injection_top_k=k, injection_candidates="first_layer")
        first.load_state_dict(per.state_dict())
        args = args or _inputs(per)
        a, b = per(*args, need_layer_scores=True), first(*args, need_layer_scores=True)
        if same:
            torch.testing.assert_close(b.hidden, a.hidden, rtol=1e-5, atol=1e-5)
            for sa, sb in zip(a.layer_scores, b.layer_scores):
                torch.testing.assert_close(sb, sa, rtol=1e-5, atol=1e-5)
        else:
            assert not torch.allclose(b.hidden, a.hidden, atol=1e-4)
    first.train()
    out = first(*args, need_layer_scores=True)
    (first.logits(out.hidden).logsumexp(-1).mean() + sum(s.logsumexp(-1).mean() for s in out.layer_scores)).backward()
    for i in range(first.config.num_hidden_layers):
        assert first.injections[i].score_proj.weight.grad.abs().sum() > 0


def test_drafting_under_autocast_runs_the_reference(llama_target, monkeypatch):
    """The trainer's held-out evaluation drafts under bf16 autocast, where activations are bf16 and the
    weights fp32: the fused injection kernels (one dtype for both) must step aside, in every kernel
    mode, and the result is the PyTorch reference's under the same autocast."""
    model = drafter_for(llama_target, seed=0, injection_candidates="first_layer").eval()
    args = _inputs(model)
    outs = {}
    for mode in ("triton", "torch"):
        monkeypatch.setenv("DSPINE_KERNELS", mode)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outs[mode] = model(*args).hidden
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=0, atol=0)


def test_injection_without_scores_has_the_reference_gradients():
    """The PyTorch injection without scores (top-k ids from a scan without autograd, then the k scores
    recomputed) against `adjacent_injection_reference` (autograd through the dense scores and
    topk): same output and same gradients for h, W_s, the transfer table, the gate and W_o."""
    from dspine.kernels.adjacent_injection import adjacent_injection_reference
    from dspine.model.transfer import AdjacentInjection

    g = torch.Generator().manual_seed(3)
    n, blk, hidden, rank, vocab, top_k = 5, 6, 16, 8, 97, 4
    layer = AdjacentInjection(hidden, rank, top_k).double()
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
    h = torch.randn(n, blk, hidden, generator=g, dtype=torch.float64)
    table = torch.randn(vocab, rank, generator=g, dtype=torch.float64)
    anchors = torch.randint(vocab, (n,), generator=g)
    upstream = torch.randn(n, blk, hidden, generator=g, dtype=torch.float64)

    def grads(run):
        leaves = [h.clone().requires_grad_(), table.clone().requires_grad_()]
        for p in layer.parameters():
            p.grad = None
        out = run(*leaves)
        (out * upstream).sum().backward()
        return out.detach(), [x.grad for x in leaves] + [p.grad.clone() for p in layer.parameters()]

    ref_out, ref_grads = grads(lambda x, t: adjacent_injection_reference(
        x, layer.score_proj.weight, t, anchors, layer.gate.weight, layer.gate.bias, layer.out_proj.weight, top_k)[0])
    out, got = grads(lambda x, t: layer(x, t, anchors, need_scores=False)[0])
    first, got_first = grads(lambda x, t: layer.forward_with_candidates(x, t, anchors, False, None)[0])
    for o, gs in ((out, got), (first, got_first)):      # both compute the features in fp32
        torch.testing.assert_close(o, ref_out, rtol=1e-5, atol=1e-6)
        for a, b in zip(gs, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert got[1].abs().sum() > 0                       # the table's gradient (score and feature paths)


def test_rms_norm_equals_its_formula_in_fp32_and_under_bf16_autocast():
    """`RMSNorm` (one fused `F.rms_norm`) against x / sqrt(mean(x²) + eps) · w computed in float64, with a
    non-trivial weight; a bf16 input (as autocast's Linear outputs are) takes the fused path, keeps its
    dtype and stays within bf16 rounding."""
    from dspine.model.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) * 2)
    x = torch.randn(3, 7, 48, generator=g) * 3
    x64 = x.double()
    want = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), want, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():   # a float32 weight with a bf16 input falls back to the unfused path, warning
        warnings.simplefilter("error")
        low = norm(x.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), want, rtol=2e-2, atol=2e-2)
