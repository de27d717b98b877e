"""Injection and selection kernels vs their PyTorch references.

CPU: the Triton interpreter at small shapes (TRITON_INTERPRET=1, set by tests/conftest.py before
any kernel is built). GPU host, full shapes: `TRITON_INTERPRET=0 pytest -m gpu tests/test_kernels.py`.
Outputs are pre-filled with NaN (-1 for indices) so an unwritten element fails.
"""

import pytest
import torch

pytest.importorskip("triton")

from triton_marks import gpu, interpreted  # noqa: E402

from dspine.model.config import DSpineConfig  # noqa: E402
from dspine.model.drafter import DSpineDrafter  # noqa: E402
from dspine import env  # noqa: E402
from dspine.kernels import dispatch  # noqa: E402
from dspine.kernels.adjacent_injection import (  # noqa: E402
    InjectionBlocks,
    Tiles,
    adjacent_injection,
    adjacent_injection_reference,
    blocks_for,
    inject_features_reference,
    inject_on_candidates,
    inject_on_candidates_reference,
    transfer_features,
    transfer_features_on_candidates,
    transfer_features_reference,
)
from dspine.kernels.transition_select import transition_path, transition_path_reference  # noqa: E402
from dspine.model.selection import select_tokens  # noqa: E402
from dspine.model.transition import TransitionScorer  # noqa: E402

# Relative-norm tolerance of the injected hidden states. bf16: the kernel rounds once where the
# reference rounds after every op (the interpreter also truncates instead of rounding to nearest).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}



def _injection_inputs(n, blk, hidden, vocab, rank, dtype, device="cpu", seed=0):
    """Random weights scaled so scores are O(1): top-k near-ties are improbable."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    return dict(h=rnd(n, blk, hidden), score_weight=rnd(rank, hidden, scale=hidden**-0.5), table=rnd(vocab, rank),
                anchor_ids=torch.randint(0, vocab, (n,), generator=g).to(device),
                gate_weight=rnd(hidden, hidden + rank, scale=(hidden + rank) ** -0.5), gate_bias=rnd(hidden),
                out_weight=rnd(hidden, rank, scale=rank**-0.5))


def _oracle(x: dict, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference with fp32 scores (t [n, B, r], h_out): q by the reference's own op, then
    q·Uᵀ in fp32. For fp32 inputs this is the reference itself; in bf16 the reference rounds its
    scores to bf16 before the top-k, which only reorders near-ties."""
    q = (x["h"] @ x["score_weight"].T).float()
    eye = torch.eye(q.shape[-1], device=q.device)
    t, _ = transfer_features_reference(q, eye, x["table"].float(), x["anchor_ids"], top_k)
    return t, inject_features_reference(x["h"], t, x["gate_weight"], x["gate_bias"], x["out_weight"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_injection(n, blk, hidden, vocab, rank, top_k, dtype, device="cpu", seed=0):
    x = _injection_inputs(n, blk, hidden, vocab, rank, dtype, device, seed)
    t = torch.full((n, blk - 1, rank), float("nan"), device=device)
    transfer_features(x["h"], x["score_weight"], x["table"], x["anchor_ids"], top_k, out=t)
    out = torch.full_like(x["h"], float("nan"))
    adjacent_injection(*x.values(), top_k, out=out)
    t_ref, h_ref = _oracle(x, top_k)
    assert not t.isnan().any() and not out.isnan().any()
    torch.testing.assert_close(t, t_ref[:, :-1], rtol=1e-5, atol=1e-5)
    assert _rel(out, h_ref) < TOL[dtype]
    assert torch.equal(out[:, 0], x["h"][:, 0])
    if dtype == torch.float32:  # the reference itself, unmodified
        ref, _ = adjacent_injection_reference(*x.values(), top_k)
        assert _rel(out, ref) < TOL[dtype]


@interpreted
@pytest.mark.parametrize("n, blk, hidden, vocab, rank, top_k, dtype", [
    (1, 16, 32, 500, 32, 8, torch.float32),
    (3, 8, 48, 1200, 32, 4, torch.float32),
    (2, 16, 64, 3000, 64, 16, torch.bfloat16),
    (4, 8, 32, 2000, 24, 5, torch.bfloat16),
    (2, 2, 32, 500, 32, 4, torch.float32),  # anchor only: nothing scored
    (3, 3, 32, 700, 16, 8, torch.bfloat16),
])
def test_adjacent_injection_matches_reference(n, blk, hidden, vocab, rank, top_k, dtype):
    _check_injection(n, blk, hidden, vocab, rank, top_k, dtype)


@interpreted
@pytest.mark.parametrize("n, blk, hidden, vocab, rank, top_k, dtype", [
    (2, 16, 32, 900, 32, 8, torch.float32),
    (3, 8, 48, 1500, 24, 5, torch.bfloat16),
    (2, 3, 32, 600, 16, 4, torch.float32),
])
def test_fused_injection_writes_the_top_k_candidates(n, blk, hidden, vocab, rank, top_k, dtype):
    """`candidates_out` holds each scored position's top-k ids (any order; the anchor's id at
    position 0), the same set as the oracle's top-k; h_out is unchanged by asking for them."""
    x = _injection_inputs(n, blk, hidden, vocab, rank, dtype, seed=3)
    found = torch.full((n, blk - 1, top_k), -1, dtype=torch.int64)
    out = adjacent_injection(*x.values(), top_k, candidates_out=found)
    torch.testing.assert_close(out, adjacent_injection(*x.values(), top_k), rtol=0, atol=0)
    scores = (x["h"] @ x["score_weight"].T).float() @ x["table"].float().T
    want = scores.topk(top_k, dim=-1).indices[:, 1:blk - 1]
    assert torch.equal(found[:, 1:].sort(-1).values, want.sort(-1).values)
    assert torch.equal(found[:, 0], x["anchor_ids"][:, None].expand(n, top_k))


@interpreted
@pytest.mark.parametrize("autocast", [False, True])
def test_trainings_candidate_scan_through_the_kernel_equals_the_pytorch_scan(autocast):
    """`AdjacentInjection.scan_top_k` (training's no-grad vocabulary scan) through the split-V kernel
    finds each scored position's top-k set of the PyTorch scan; under bf16 autocast (the trainer's
    steps) with fp32 weights too, where the kernel's inputs take the autocast dtype. The injection
    and its gradients built on either scan's ids agree (the ids' order only reorders a sum)."""
    from dspine.model.transfer import AdjacentInjection

    n, blk, hidden, vocab, rank, top_k = 3, 8, 32, 900, 16, 5
    layer = AdjacentInjection(hidden, rank, top_k)
    x = _injection_inputs(n, blk, hidden, vocab, rank, torch.float32, seed=7)
    h, table, anchors = x["h"], x["table"], x["anchor_ids"]
    with torch.no_grad():
        layer.score_proj.weight.copy_(x["score_weight"])

    def run(mode):
        leaves = [h.clone().requires_grad_(), table.clone().requires_grad_()]
        layer.zero_grad()
        with dispatch.forced(mode), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            found = layer.scan_top_k(*leaves, anchors)
            out, _ = layer._on_own_top_k(*leaves, anchors)
        out.float().square().sum().backward()
        return found, out.detach(), [v.grad for v in leaves] + [w.grad.clone() for w in layer.parameters()]

    ids_ref, out_ref, grads_ref = run("torch")
    ids, out, grads = run("triton")
    assert ids.shape == ids_ref.shape == (n, blk - 1, top_k) and not ids_ref.requires_grad
    assert torch.equal(ids[:, 1:].sort(-1).values, ids_ref[:, 1:].sort(-1).values)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_ref, **tol)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_on_own_top_k_equal_the_vocabulary_scan(dtype):
    """Re-weighting a position's own top-k (what `injection_candidates = "first_layer"` does with
    layer 1's) equals the per-layer reference; other candidates give the softmax over theirs."""
    x = _injection_inputs(3, 8, 32, 800, 16, dtype, seed=5)
    t_ref, scores = transfer_features_reference(x["h"], x["score_weight"], x["table"], x["anchor_ids"], 6)
    own = scores[:, :-1].topk(6, dim=-1).indices
    t = transfer_features_on_candidates(x["h"], x["score_weight"], x["table"], x["anchor_ids"], own)
    if dtype == torch.float32:
        torch.testing.assert_close(t, t_ref[:, :-1], rtol=1e-5, atol=1e-5)
    else:  # the reference softmaxes bf16-rounded scores, this fp32 ones
        assert _rel(t, t_ref[:, :-1]) < TOL[dtype]
    other = torch.randint(0, 800, own.shape, generator=torch.Generator().manual_seed(1))
    t_other = transfer_features_on_candidates(x["h"], x["score_weight"], x["table"], x["anchor_ids"], other)
    q = (x["h"][:, 1:-1] @ x["score_weight"].T).double()
    rows = x["table"].double()[other[:, 1:]]
    brute = (torch.softmax(torch.einsum("nbr,nbkr->nbk", q, rows), -1)[..., None] * rows).sum(-2)
    assert _rel(t_other[:, 1:], brute) < (1e-6 if dtype == torch.float32 else TOL[dtype])
    torch.testing.assert_close(t_other[:, 0], x["table"][x["anchor_ids"]].float())


def _selection_inputs(bs, n, k, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    unary = torch.randn(bs, n, k, generator=g) * 2
    pair = torch.randn(bs, n, k, k, generator=g)
    temperature = torch.tensor([0.0, 0.7, 1.3, -1.0])[torch.arange(bs) % 4]  # greedy and sampled rows
    uniforms = torch.rand(bs, n, generator=g)
    return [x.to(device) for x in (unary, pair, temperature, uniforms)]


def _check_selection(bs, n, k, lam, device="cpu", seed=0):
    unary, pair, temperature, uniforms = _selection_inputs(bs, n, k, device, seed)
    choice = torch.full((bs, n), -1, dtype=torch.long, device=device)
    q = torch.full((bs, n, k), float("nan"), device=device)
    transition_path(unary, pair, lam, temperature, uniforms, out=(choice, q))
    choice_ref, q_ref = transition_path_reference(unary, pair, lam, temperature, uniforms)
    assert torch.equal(choice, choice_ref)
    torch.testing.assert_close(q, q_ref, rtol=0, atol=1e-5)


@interpreted
@pytest.mark.parametrize("bs, n, k, lam", [(1, 15, 8, 1.0), (4, 15, 8, 0.5), (3, 7, 5, 2.0), (2, 1, 4, 1.0),
                                           (4, 15, 16, 0.0)])
def test_transition_path_matches_reference(bs, n, k, lam):
    _check_selection(bs, n, k, lam)


def _tiny_drafter(seed=0, candidates="per_layer"):
    torch.manual_seed(seed)
    cfg = DSpineConfig(hidden_size=64, vocab_size=640, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, num_target_layers=8, mask_token_id=3,
                       num_hidden_layers=2 if candidates == "per_layer" else 3,
                       layer_loss_weights=[0.5, 0.4] if candidates == "per_layer" else [0.5, 0.4, 0.3], block_size=8,
                       transfer_rank=32, injection_top_k=4, selection_top_k=4, sliding_window=64,
                       injection_candidates=candidates)
    model = DSpineDrafter(cfg).eval()
    with torch.no_grad():  # spread the transfer scores: larger P and W_s than the training init
        model.transfer.proj.weight.normal_(std=0.5)
        model.transition.weight.normal_(std=0.1)
        for inj in model.injections:
            inj.score_proj.weight.normal_(std=0.5)
    model.attach_target(torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size))
    return model


@torch.no_grad()
def _draft(model, bs=2, ctx=12, seed=1):
    """One block per row from a random context: (hidden [bs, B, H], Selection)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    target_hidden = torch.randn(bs, ctx, cfg.num_context_features * cfg.hidden_size, generator=g)
    positions = torch.arange(ctx)[None].expand(bs, -1)
    kv = model.context_key_values(model.project_context(target_hidden), positions)
    anchors = torch.randint(0, cfg.vocab_size, (bs,), generator=g)
    blk_pos = ctx + torch.arange(cfg.block_size)[None].expand(bs, -1)
    mask = torch.ones(bs, cfg.block_size, ctx + cfg.block_size, dtype=torch.bool)
    hidden = model(anchors[:, None], blk_pos, kv, mask).hidden
    logits = model.logits(hidden[:, 1:])
    sel = select_tokens(logits, anchors, torch.tensor([0.0, 0.8])[torch.arange(bs) % 2], mode="transition",
                        top_k=cfg.selection_top_k, lam=cfg.transition_lambda, scorer=model.transition,
                        table=model.transfer_table(), generator=torch.Generator().manual_seed(seed))
    return hidden, sel


@interpreted
@pytest.mark.parametrize("candidates", ["per_layer", "first_layer"])
def test_drafter_triton_path_matches_torch_path(monkeypatch, candidates):
    """The whole draft (forward, logits, selection) through the kernels equals the PyTorch path; with
    `first_layer` candidates, layers 2.. run `inject_on_candidates`."""
    model = _tiny_drafter(candidates=candidates)
    monkeypatch.setenv("DSPINE_KERNELS", "torch")
    hidden_ref, sel_ref = _draft(model)
    # The injection module on its own, fused path (need_scores=False) vs reference path.
    x = torch.randn(3, model.config.block_size, model.config.hidden_size)
    anchors = torch.randint(0, model.config.vocab_size, (3,))
    with torch.no_grad():   # the fused kernels run where autograd records nothing
        inj_ref, _ = model.injections[0](x, model.transfer_table(), anchors, need_scores=False)
        monkeypatch.setenv("DSPINE_KERNELS", "triton")
        inj, scores = model.injections[0](x, model.transfer_table(), anchors, need_scores=False)
    assert scores is None
    torch.testing.assert_close(inj, inj_ref, rtol=1e-5, atol=1e-5)
    hidden, sel = _draft(model)
    # first_layer: each later layer of either path is within 1e-6 of a float64 evaluation; the sharp
    # transfer softmax of this drafter (W_s at std 0.5) amplifies the accumulation-order difference
    # to ~5e-5 by the third layer.
    torch.testing.assert_close(hidden, hidden_ref, rtol=1e-4, atol=1e-5 if candidates == "per_layer" else 1e-4)
    assert torch.equal(sel.tokens, sel_ref.tokens) and torch.equal(sel.choice, sel_ref.choice)
    torch.testing.assert_close(sel.q, sel_ref.q, rtol=0, atol=1e-5)


@interpreted
def test_select_tokens_triton_matches_torch(monkeypatch):
    g = torch.Generator().manual_seed(3)
    bs, n, vocab, rank = 4, 7, 300, 16
    logits = torch.randn(bs, n, vocab, generator=g) * 3
    table = torch.randn(vocab, rank, generator=g)
    scorer = TransitionScorer(rank)
    with torch.no_grad():
        scorer.weight.normal_(std=0.3, generator=g)
    anchors = torch.randint(0, vocab, (bs,), generator=g)
    temperature = torch.tensor([0.0, 0.9, 0.0, 1.5])
    picks = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("DSPINE_KERNELS", mode)
        picks[mode] = select_tokens(logits, anchors, temperature, mode="transition", top_k=8, lam=1.0, scorer=scorer,
                                    table=table, generator=torch.Generator().manual_seed(7))
    assert torch.equal(picks["torch"].tokens, picks["triton"].tokens)
    torch.testing.assert_close(picks["triton"].q, picks["torch"].q, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ GPU, full shapes
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, hidden, vocab, top_k", [
    (1, 4096, 151936, 8),     # Qwen3-8B, bs 1
    (32, 4096, 151936, 8),
    (64, 576, 49152, 16),     # SmolLM2, bs 64
    (8, 5120, 152064, 4),     # Qwen3-32B-like
])
def test_adjacent_injection_gpu(n, hidden, vocab, top_k):
    x = _injection_inputs(n, 16, hidden, vocab, 256, torch.bfloat16, device="cuda", seed=n)
    out = torch.full_like(x["h"], float("nan"))
    adjacent_injection(*x.values(), top_k, out=out)
    t = transfer_features(x["h"], x["score_weight"], x["table"], x["anchor_ids"], top_k)
    t_ref, h_ref = _oracle(x, top_k)
    assert not out.isnan().any()
    # Rows whose k-th and (k+1)-th fp32 scores differ by less than the accumulation-order error
    # may legitimately pick another candidate: allow a handful out of n·14.
    bad = ((t - t_ref[:, :-1]).abs().amax(-1) > 1e-3).sum().item()
    assert bad <= max(1, n * 14 // 100), f"{bad} rows differ"
    assert _rel(out, h_ref) < TOL[torch.bfloat16]


def _check_inject_on_candidates(n, blk, hidden, vocab, rank, top_k, dtype, device="cpu", seed=0, blocks=None):
    """The fused later layer against `inject_on_candidates_reference` on random candidates (repeats
    allowed: a layer-1 top-k never has them, the kernels must not care). Row 0 of the candidates is
    random too: the anchor's feature must come from `anchor_ids` alone. `blocks` overrides the
    launch configuration (`InjectionBlocks.updated` changes)."""
    x = _injection_inputs(n, blk, hidden, vocab, rank, dtype, device, seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    cand = torch.randint(0, vocab, (n, blk - 1, top_k), generator=g).to(device)
    args = (x["h"], x["score_weight"], x["table"], x["anchor_ids"], cand, x["gate_weight"], x["gate_bias"],
            x["out_weight"])
    out = torch.full_like(x["h"], float("nan"))
    inject_on_candidates(*args, blocks=blocks_for(n, blk).updated(**(blocks or {})), out=out)
    want = inject_on_candidates_reference(*args)
    assert not out.isnan().any()
    assert torch.equal(out[:, 0], x["h"][:, 0])
    # Every position within tolerance (the anchor's successor included), not only the whole tensor.
    worst = max(_rel(out[:, i], want[:, i]) for i in range(1, blk))
    assert worst < TOL[dtype], f"worst position's relative error {worst:.3g}"


@interpreted
@pytest.mark.parametrize("n, blk, hidden, vocab, rank, top_k, dtype, blocks", [
    (1, 16, 64, 1000, 32, 8, torch.float32, {}),
    (3, 8, 96, 2000, 64, 4, torch.bfloat16, {}),
    (8, 16, 128, 5000, 256, 16, torch.bfloat16, {}),   # 128 rows: wide H-spans (mix_tiles_n 4)
    (2, 16, 576, 3000, 256, 8, torch.bfloat16, {}),    # SmolLM2's H
    (5, 8, 64, 1500, 48, 5, torch.float32, {}),        # 40 rows, r and k not powers of two
    (4, 16, 200, 2500, 32, 8, torch.float32,           # split-K with a ragged last split, several H-tiles
     dict(hidden_split=3, hidden={"block_k": 32, "block_n": 16}, mix={"block_n": 16}, mix_tiles_n=3)),
    (6, 8, 64, 1000, 32, 4, torch.bfloat16, dict(hidden_split=2, hidden={"block_k": 32, "block_m": 32},
                                                 mix={"block_m": 32})),
    (2, 3, 32, 600, 16, 4, torch.float32, {}),         # one scored position
    (3, 2, 32, 500, 32, 4, torch.bfloat16, {}),        # anchor only: nothing scored
])
def test_inject_on_candidates_matches_reference(n, blk, hidden, vocab, rank, top_k, dtype, blocks):
    _check_inject_on_candidates(n, blk, hidden, vocab, rank, top_k, dtype, seed=n, blocks=blocks)


@interpreted
def test_first_layer_drafter_uses_the_fused_later_layer_and_matches_the_reference(monkeypatch):
    """A first_layer drafter's injections through the kernels (forced) equal its PyTorch path, and
    every later layer goes through `inject_on_candidates`."""
    torch.manual_seed(0)
    cfg = DSpineConfig(hidden_size=32, vocab_size=300, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, num_target_layers=4, mask_token_id=0, num_hidden_layers=5,
                       block_size=8, transfer_rank=16, injection_top_k=4, selection_top_k=4, sliding_window=64,
                       injection_candidates="first_layer")
    model = DSpineDrafter(cfg).eval()
    model.attach_target(torch.randn(300, 32), torch.randn(300, 32))
    h = torch.randn(2, 8, 32)
    anchors = torch.randint(0, 300, (2,))
    table = model.transfer_table()
    calls = []
    import dspine.kernels.adjacent_injection as kernels_module
    real = kernels_module.inject_on_candidates
    monkeypatch.setattr(kernels_module, "inject_on_candidates", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("DSPINE_KERNELS", mode)
        x, cand = h, None
        with torch.no_grad():
            for layer in model.injections:
                x, _, cand = layer.forward_with_candidates(x, table, anchors, need_scores=False, candidates=cand)
        outs[mode] = x
    assert len(calls) == len(model.injections) - 1  # every later layer, only under "triton"
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-4)
    # Where autograd records (a training step), no forward-only kernel runs, in any mode: the
    # injections' gradients are the PyTorch path's.
    grads = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("DSPINE_KERNELS", mode)
        model.zero_grad()
        x, cand = h.clone().requires_grad_(), None
        leaf = x
        for layer in model.injections:
            x, _, cand = layer.forward_with_candidates(x, table.detach(), anchors, need_scores=False, candidates=cand)
            y, _ = layer(x, table.detach(), anchors, need_scores=False)
        (x.square().sum() + y.square().sum()).backward()
        grads[mode] = [leaf.grad] + [p.grad.clone() for p in model.injections.parameters()]
    assert len(calls) == len(model.injections) - 1
    for a, b in zip(grads["triton"], grads["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, hidden, vocab, top_k", [(1, 4096, 151936, 8), (32, 4096, 151936, 8),
                                                     (64, 576, 49152, 16), (8, 5120, 152064, 4)])
def test_inject_on_candidates_gpu(n, hidden, vocab, top_k):
    _check_inject_on_candidates(n, 16, hidden, vocab, 256, top_k, torch.bfloat16, device="cuda", seed=n)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("blocks", [dict(hidden_split=2), dict(hidden_split=4, hidden={"block_k": 256}),
                                    dict(mix={"warps": 4}), dict(mix_tiles_n=4, mix={"block_n": 64})])
def test_inject_on_candidates_gpu_variants(blocks):
    """Launch-config variants the benchmark sweeps, at 8B shapes, bs 1."""
    _check_inject_on_candidates(1, 16, 4096, 151936, 256, 8, torch.bfloat16, device="cuda", seed=2, blocks=blocks)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, hidden, vocab, top_k", [(1, 4096, 151936, 8), (48, 576, 49152, 8)])
def test_injection_candidates_gpu(n, hidden, vocab, top_k):
    """Full shapes: the fused kernel's candidates are the fp32 top-k (up to near-tie rows), and a
    later layer re-weighting them matches the reference on its own top-k."""
    x = _injection_inputs(n, 16, hidden, vocab, 256, torch.bfloat16, device="cuda", seed=n)
    found = torch.full((n, 15, top_k), -1, dtype=torch.int64, device="cuda")
    adjacent_injection(*x.values(), top_k, candidates_out=found)
    scores = (x["h"] @ x["score_weight"].T).float() @ x["table"].float().T
    want = scores.topk(top_k, dim=-1).indices[:, 1:15]
    bad = (found[:, 1:].sort(-1).values != want.sort(-1).values).any(-1).sum().item()
    assert (found >= 0).all() and bad <= max(1, n * 14 // 100), f"{bad} rows differ"
    t = transfer_features_on_candidates(x["h"], x["score_weight"], x["table"], x["anchor_ids"], found)
    t_ref, h_ref = _oracle(x, top_k)
    assert _rel(t, t_ref[:, :-1]) < TOL[torch.bfloat16]
    out = inject_on_candidates(x["h"], x["score_weight"], x["table"], x["anchor_ids"], found, x["gate_weight"],
                               x["gate_bias"], x["out_weight"])
    assert _rel(out, h_ref) < TOL[torch.bfloat16]  # the fused later layer on its own top-k: the per-layer result


@pytest.mark.gpu
@gpu
def test_trainings_candidate_scan_gpu():
    """A training batch's scan (4,096 blocks of 16 over SmolLM2's vocabulary, bf16 autocast with fp32
    weights, as the trainer runs it) through the split-V kernel: the fp32 top-k sets up to near-tie
    rows, without the [n, B-1, V] scores (8 GB in bf16) in memory."""
    from dspine.model.transfer import AdjacentInjection

    n, hidden, vocab, rank, top_k = 4096, 576, 49152, 256, 8
    x = _injection_inputs(n, 16, hidden, vocab, rank, torch.float32, device="cuda", seed=11)
    layer = AdjacentInjection(hidden, rank, top_k).cuda()
    with torch.no_grad():
        layer.score_proj.weight.copy_(x["score_weight"])
    h = x["h"].bfloat16()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        found = layer.scan_top_k(h, x["table"], x["anchor_ids"])
    peak = torch.cuda.max_memory_allocated() - before
    q = (h[:, 1:15] @ x["score_weight"].bfloat16().T).float()
    table = x["table"].bfloat16().float()
    want = torch.cat([(part @ table.T).topk(top_k, dim=-1).indices for part in q.split(512)])
    bad = (found[:, 1:].sort(-1).values != want.sort(-1).values).any(-1).sum().item()
    assert bad <= n * 14 // 100, f"{bad} rows differ"
    assert peak < 2**30, f"the scan held {peak / 2**30:.1f} GiB"


@gpu
@pytest.mark.parametrize("bs, k", [(1, 8), (64, 8), (32, 16)])
def test_transition_path_gpu(bs, k):
    _check_selection(bs, 15, k, 1.0, device="cuda", seed=bs)


def test_kernel_mode_comes_from_the_declared_variable(monkeypatch):
    """DSPINE_KERNELS through `dspine.env`: a bad value names the variable; `forced` overrides it
    within its block only, nested blocks restore the outer mode, and a bad forced mode is refused."""
    x = torch.zeros(2)
    monkeypatch.setenv("DSPINE_KERNELS", "cuda")
    with pytest.raises(env.EnvError, match="DSPINE_KERNELS='cuda'"):
        dispatch.use_triton(x)
    monkeypatch.setenv("DSPINE_KERNELS", "TORCH")
    assert dispatch.kernel_mode() == "torch" and not dispatch.use_triton(x)
    with dispatch.forced("triton"):
        assert dispatch.kernel_mode() == "triton" and dispatch.use_triton(x)
        with dispatch.forced("auto"):
            assert not dispatch.use_triton(x)                   # auto: CPU tensors take the reference
        assert dispatch.use_triton(x)
    assert dispatch.kernel_mode() == "torch"
    with pytest.raises(ValueError, match="cuda"):
        with dispatch.forced("cuda"):
            pass
    monkeypatch.delenv("DSPINE_KERNELS")
    assert dispatch.kernel_mode() == "auto"


def test_injection_blocks_updated_replaces_launch_fields():
    base = blocks_for(2, 16)
    got = base.updated(hidden={"block_k": 256}, hidden_split=4, mix_tiles_n=2)
    assert got.hidden == Tiles(base.hidden.block_m, base.hidden.block_n, 256, base.hidden.warps, base.hidden.stages)
    assert (got.hidden_split, got.mix_tiles_n) == (4, 2)
    assert (got.topk, got.gate, got.mix) == (base.topk, base.gate, base.mix)
    assert InjectionBlocks().topk == Tiles(block_m=16, block_n=64, block_k=128, warps=4, stages=3)
