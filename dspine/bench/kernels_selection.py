"""Kernel benchmark, selection cases: the transition-path kernel, the top-k of the draft logits (its
knobs swept), the whole `select_tokens` and the copy candidates' suffix match, each Triton vs the
PyTorch path."""

from __future__ import annotations

import torch

from dspine.bench.kernels_harness import Run
from dspine.kernels import dispatch
from dspine.kernels.logits_topk import logits_topk, logits_topk_reference, topk_grid
from dspine.kernels.suffix_match import suffix_match, suffix_match_reference
from dspine.kernels.transition_select import transition_path, transition_path_reference
from dspine.model.selection import select_tokens
from dspine.model.transition import TransitionScorer


def sweep_logits_topk(run: Run, logits: torch.Tensor, shape: str, bs: int) -> dict:
    """Time the `logits_topk` knob variants on logits [rows, V]; keep the fastest exact one (the
    kernel and its reference share the tie rule, so indices must match exactly). Returns its overrides."""
    k = run.cfg.top_k
    want_val, want_idx = logits_topk_reference(logits, k)
    rows, vocab = logits.shape

    def one(over):
        values, indices = logits_topk(logits, k, **over)
        ok = bool(torch.equal(indices, want_idx)) and bool(torch.equal(values, want_val))
        ms = run.bench_ms(lambda: logits_topk(logits, k, **over), inner=run.cfg.sweep_inner, reps=run.cfg.sweep_reps)
        grid = {key: over[key] for key in ("slices", "block_m", "block_v", "programs_per_sm") if key in over}
        tiles, slices, _ = topk_grid(rows, vocab, run.cfg.device, **grid)
        return ms, ok, {"ok": ok, "row_tiles": tiles, "slices": slices}, f"{tiles}x{slices} programs  exact {ok}"

    best, best_ms = run.sweep_variants("logits_topk", shape, bs, run.cfg.variants["logits_topk"], one)
    best = {} if best is None else best
    run.details["best_blocks"][f"logits_topk/{shape}/bs{bs}"] = {"override": best, "ms": best_ms}
    run.save()
    return best


def selection_cases(run: Run, shape_name: str, shape: dict, bs: int) -> None:
    cfg, device = run.cfg, run.cfg.device
    g = torch.Generator(device=device).manual_seed(bs)
    n, k, vocab = cfg.block - 1, cfg.top_k, shape["vocab"]
    unary = torch.randn(bs, n, k, generator=g, device=device) * 2
    pair = torch.randn(bs, n, k, k, generator=g, device=device)
    temperature = torch.tensor([0.0, 0.8], device=device)[torch.arange(bs, device=device) % 2]
    uniforms = torch.rand(bs, n, generator=g, device=device)
    choice, q = transition_path(unary, pair, 1.0, temperature, uniforms)
    choice_ref, q_ref = transition_path_reference(unary, pair, 1.0, temperature, uniforms)
    ok = bool(torch.equal(choice, choice_ref)) and float((q - q_ref).abs().max()) < 1e-5
    run.details["correctness"].append({"kernel": "transition_path", "shape": shape_name, "bs": bs, "ok": ok,
                                       "q_max_abs_err": float((q - q_ref).abs().max())})
    args = (unary, pair, 1.0, temperature, uniforms)
    inner = 1 if cfg.smoke else 20
    nbytes = unary.numel() * 4 + pair.numel() * 4 + uniforms.numel() * 4 + bs * n * (8 + 4 * k)
    run.measure("transition_path", shape_name, bs, lambda: transition_path(*args),
                lambda: transition_path_reference(*args), inner, nbytes,
                (transition_path_reference, f"path/{shape_name}/{bs}", lambda f: lambda: f(*args)))

    # The top-K of the draft logits alone (select_tokens' first step): default knobs, then the sweep.
    logits = torch.randn(bs, n, vocab, generator=g, device=device).to(cfg.dtype)
    flat = logits.view(bs * n, vocab)
    values, indices = logits_topk(flat, k)
    want_val, want_idx = logits_topk_reference(flat, k)
    run.details["correctness"].append({
        "kernel": "logits_topk", "shape": shape_name, "bs": bs,
        "ok": bool(torch.equal(indices, want_idx)) and bool(torch.equal(values, want_val)),
        "rows_differ": int((indices != want_idx).any(-1).sum())})

    def eager_logits_topk(x):
        """What select_tokens' PyTorch path runs: torch.topk of the logits, values cast to fp32."""
        top_values, top_indices = x.topk(k, dim=-1)
        return top_values.float(), top_indices

    topk_bytes = flat.numel() * flat.element_size() + flat.shape[0] * k * 12
    run.measure("logits_topk", shape_name, bs, lambda: logits_topk(flat, k), lambda: eager_logits_topk(flat), inner,
                topk_bytes, (eager_logits_topk, f"logits_topk/{shape_name}/{bs}", lambda f: lambda: f(flat)))
    sweep_logits_topk(run, flat, shape_name, bs)

    # The whole selection of a round: top-K of the draft logits (Triton path: `logits_topk` with its
    # default knobs), pair scores, path.
    table = torch.randn(vocab, cfg.rank, generator=g, device=device).to(cfg.dtype)
    scorer = TransitionScorer(cfg.rank).to(device=device, dtype=cfg.dtype)
    with torch.no_grad():
        scorer.weight.normal_(std=cfg.rank**-0.5, generator=g)
    anchors = torch.randint(0, vocab, (bs,), generator=g, device=device)

    def select(mode):
        def go():
            with dispatch.forced(mode):
                return select_tokens(logits, anchors, temperature, mode="transition", top_k=k, lam=1.0,
                                     scorer=scorer, table=table)
        return go

    nbytes = logits.numel() * logits.element_size() + bs * n * k * 2 * cfg.rank * table.element_size()
    with torch.no_grad():
        run.measure("select_tokens", shape_name, bs, select("triton"), select("torch"), inner, nbytes)
        # What the ablation's selection costs (argmax of the same logits): select_tokens minus this
        # is what transition selection adds to a round.
        run.details["argmax_ms"][f"{shape_name}/bs{bs}"] = run.bench_ms(lambda: logits.argmax(-1), inner=inner)
    suffix_match_case(run, shape_name, bs)


def suffix_match_case(run: Run, shape_name: str, bs: int) -> None:
    """The copy candidates' suffix match over an 8k-token history window (512 in the smoke run),
    each row half a copy of its first half (matches run to max_match); goal: <= 0.05 ms at bs 1."""
    cfg, device = run.cfg, run.cfg.device
    g = torch.Generator(device=device).manual_seed(bs + 7)
    window, n = (512 if cfg.smoke else 8192), cfg.block - 1
    history = torch.randint(0, 50000, (bs, window), generator=g, device=device)
    history[:, window // 2:] = history[:, : window - window // 2]
    lengths = torch.full((bs,), window, device=device)
    args = dict(n=n, min_match=2, max_match=32, max_span=n, window=window)
    got, want = suffix_match(history, lengths, **args), suffix_match_reference(history, lengths, **args)
    run.details["correctness"].append({"kernel": "suffix_match", "shape": shape_name, "bs": bs,
                                       "ok": bool(torch.equal(got[0], want[0])) and bool(torch.equal(got[1], want[1]))})
    run.measure("suffix_match", shape_name, bs, lambda: suffix_match(history, lengths, **args),
                lambda: suffix_match_reference(history, lengths, **args), 1 if cfg.smoke else 20,
                history.numel() * history.element_size() + bs * (n + 1) * 8)
