"""Kernel benchmark, injection cases: one layer, five layers, the stages on their own, and the
`injection_candidates = "first_layer"` chain, each fused vs eager (and torch.compile); the launch
configuration swept per size class."""

from __future__ import annotations

import dataclasses
import math

import torch

from dspine.bench.kernels_harness import Run, Settings, cycle
from dspine.kernels.adjacent_injection import (
    InjectionBlocks,
    adjacent_injection,
    adjacent_injection_reference,
    blocks_for,
    inject_features,
    inject_features_reference,
    inject_on_candidates,
    inject_on_candidates_reference,
    transfer_features,
    transfer_features_reference,
)


def injection_bytes(cfg: Settings, hidden: int, vocab: int, bs: int, stage: str = "layer") -> int:
    """Fewest bytes one layer's injection (or one stage of it) must move: every weight and the
    table read once, h read and h_out written once (t, fp32, between the stages). "later": a later
    layer of injection_candidates "first_layer" (W_s, G, W_o, the candidate ids and their U rows)."""
    e, rank, block = cfg.element_size(), cfg.rank, cfg.block
    h_bytes, t_bytes = bs * block * hidden * e, bs * (block - 1) * rank * 4
    features = (vocab * rank + rank * hidden) * e + h_bytes + t_bytes
    gate = (hidden * (hidden + rank) + hidden * rank + hidden) * e + 2 * h_bytes + t_bytes
    later = gate - t_bytes + rank * hidden * e + bs * (block - 1) * cfg.top_k * (8 + rank * e)
    return {"features": features, "gate": gate, "layer": features + gate - 2 * t_bytes, "later": later}[stage]


class InjectionInputs:
    """Random inputs of one (shape, bs): h [bs, B, H], the shared table U [V, r], anchors and
    `draft_layers` sets of per-layer weights (distinct, so five layers do not re-read one set from L2)."""

    def __init__(self, cfg: Settings, shape: dict, bs: int, seed: int = 0):
        device = cfg.device
        g = torch.Generator(device=device).manual_seed(seed)
        hidden, vocab, rank = shape["hidden"], shape["vocab"], cfg.rank

        def rnd(*size, scale=1.0):
            return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * scale).to(cfg.dtype)

        self.cfg, self.bs, self.hidden, self.vocab = cfg, bs, hidden, vocab
        self.h = rnd(bs, cfg.block, hidden)
        self.table = rnd(vocab, rank)
        self.anchor_ids = torch.randint(0, vocab, (bs,), generator=g, device=device)
        self.layers = [dict(score_weight=rnd(rank, hidden, scale=hidden**-0.5),
                            gate_weight=rnd(hidden, hidden + rank, scale=(hidden + rank) ** -0.5),
                            gate_bias=rnd(hidden), out_weight=rnd(hidden, rank, scale=rank**-0.5))
                       for _ in range(cfg.draft_layers)]

    def args(self, layer: int, h=None, top_k: int | None = None) -> tuple:
        w = self.layers[layer]
        return (self.h if h is None else h, w["score_weight"], self.table, self.anchor_ids, w["gate_weight"],
                w["gate_bias"], w["out_weight"], top_k or self.cfg.top_k)

    def later_args(self, layer: int, candidates: torch.Tensor, h=None) -> tuple:
        """Arguments of `inject_on_candidates` (a later layer re-weighting `candidates`)."""
        w = self.layers[layer]
        return (self.h if h is None else h, w["score_weight"], self.table, self.anchor_ids, candidates,
                w["gate_weight"], w["gate_bias"], w["out_weight"])

    def features(self, layer: int, blocks: InjectionBlocks, candidates_out: torch.Tensor | None = None):
        return transfer_features(self.h, self.layers[layer]["score_weight"], self.table, self.anchor_ids,
                                 self.cfg.top_k, blocks, candidates_out=candidates_out)

    def candidates(self, blocks: InjectionBlocks | None = None) -> torch.Tensor:
        """Layer 1's top-k ids [bs, B-1, k] (the fused scan's `candidates_out`)."""
        found = torch.empty(self.bs, self.cfg.block - 1, self.cfg.top_k, dtype=torch.int64, device=self.cfg.device)
        self.features(0, blocks, candidates_out=found)
        return found

    def oracle_t(self, layer: int = 0) -> torch.Tensor:
        """Reference features with fp32 scores (q by the reference's own op), [bs, B-1, r]."""
        q = (self.h @ self.layers[layer]["score_weight"].T).float()
        eye = torch.eye(self.cfg.rank, device=self.cfg.device)
        t, _ = transfer_features_reference(q, eye, self.table.float(), self.anchor_ids, self.cfg.top_k)
        return t[:, :-1]

    def later_rel_err(self, candidates: torch.Tensor, blocks: InjectionBlocks, layer: int = 1) -> float:
        """Relative error of the fused later layer against its reference (NaN -> inf)."""
        out = inject_on_candidates(*self.later_args(layer, candidates), blocks=blocks).float()
        ref = inject_on_candidates_reference(*self.later_args(layer, candidates)).float()
        err = float((out - ref).norm() / ref.norm())
        return err if math.isfinite(err) else float("inf")


def check_features(t: torch.Tensor, t_ref: torch.Tensor) -> dict:
    rows_bad = int(((t - t_ref).abs().amax(-1) > 1e-3).sum())
    return {"bad_rows": rows_bad, "rows": int(t.shape[0] * (t.shape[1] - 1)),
            "max_abs_err": float((t - t_ref).abs().max()), "nan": bool(t.isnan().any())}


def features_ok(check: dict) -> bool:
    return not check["nan"] and check["bad_rows"] <= max(1, check["rows"] // 100)


def eager_layer(*args):
    return adjacent_injection_reference(*args)[0]


def eager_features(h, score_weight, table, anchor_ids, top_k):
    return transfer_features_reference(h, score_weight, table, anchor_ids, top_k)[0]


def sweep_blocks(run: Run, x: InjectionInputs, shape: str) -> InjectionBlocks:
    """Time launch-config variants of the stages on this input; keep the fastest correct ones."""
    cfg, variants = run.cfg, run.cfg.variants
    reps, inner = cfg.sweep_reps, cfg.sweep_inner
    base = blocks_for(x.bs, cfg.block)
    t_ref = x.oracle_t()
    large = x.bs * (cfg.block - 2) > 64

    def topk(over):
        blocks = base.updated(**over)
        check = check_features(x.features(0, blocks), t_ref)
        ms = run.bench_ms(cycle(lambda w: transfer_features(x.h, w["score_weight"], x.table, x.anchor_ids, cfg.top_k,
                                                            blocks), x.layers), inner=inner, reps=reps)
        return ms, features_ok(check), check, f"bad rows {check['bad_rows']}/{check['rows']}"

    over, _ = run.sweep_variants("topk", shape, x.bs, variants["topk_large" if large else "topk"], topk)
    best = best_topk = base if over is None else base.updated(**over)
    t = t_ref.contiguous()

    def gate(over):
        blocks = best_topk.updated(**over)
        ms = run.bench_ms(cycle(lambda w: inject_features(x.h, t, w["gate_weight"], w["gate_bias"], w["out_weight"],
                                                          blocks), x.layers), inner=inner, reps=reps)
        return ms, True, {}, ""

    over, _ = run.sweep_variants("gate", shape, x.bs, variants["gate"], gate)
    best = best if over is None else best_topk.updated(**over)
    # A later layer (inject_on_candidates): its pass over h, then its features-and-gate kernel.
    candidates = x.candidates(best)
    for stage in ("later_hidden", "later_mix"):
        start = best

        def later(over, start=start):
            blocks = start.updated(**over)
            err = x.later_rel_err(candidates, blocks)
            ms = run.bench_ms(cycle(lambda i: inject_on_candidates(*x.later_args(i, candidates), blocks=blocks),
                                    list(range(1, cfg.draft_layers))), inner=inner, reps=reps)
            return ms, err < 2e-2, {"h_rel_err": err}, f"rel err {err:.2e}"

        over, _ = run.sweep_variants(stage, shape, x.bs, variants[stage + ("_large" if large else "")], later)
        best = best if over is None else start.updated(**over)
    return best


def check_injection(run: Run, x: InjectionInputs, shape_name: str, blocks: InjectionBlocks) -> torch.Tensor:
    """Correctness of the configuration timed, at these shapes (recorded in details); returns
    layer 1's candidates for the later-layer cases."""
    t_ref = x.oracle_t()
    check = check_features(x.features(0, blocks), t_ref)
    out = adjacent_injection(*x.args(0), blocks=blocks)
    w = x.layers[0]
    ref = inject_features_reference(x.h, t_ref, w["gate_weight"], w["gate_bias"], w["out_weight"])
    check["h_rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
    check.update(shape=shape_name, bs=x.bs, ok=features_ok(check) and check["h_rel_err"] < 2e-2)
    found = x.candidates(blocks)
    later = {"kernel": "inject_on_candidates", "shape": shape_name, "bs": x.bs,
             "h_rel_err": x.later_rel_err(found, blocks)}
    later["ok"] = later["h_rel_err"] < 2e-2
    for entry in (check, later):
        run.details["correctness"].append(entry)
        run.log(f"  correctness {shape_name} bs={x.bs}: {entry}")
    run.save()
    return found


def injection_cases(run: Run, shape_name: str, shape: dict, bs: int, blocks: InjectionBlocks | None) -> InjectionBlocks:
    """All injection cases of one (shape, bs); `blocks` None: sweep them first. Returns the blocks timed."""
    cfg = run.cfg
    layers_n, top_k, block = cfg.draft_layers, cfg.top_k, cfg.block
    x = InjectionInputs(cfg, shape, bs, seed=bs)
    if blocks is None:
        blocks = sweep_blocks(run, x, shape_name)
        run.details["best_blocks"][f"{shape_name}/bs{bs}"] = dataclasses.asdict(blocks)
        run.save()
    found = check_injection(run, x, shape_name, blocks)

    def chain(fn, count, top_k=None):  # `count` layers, each with its own weights, chained through h
        def go():
            h = x.h
            for i in range(count):
                h = fn(*x.args(i, h, top_k))
            return h
        return go

    def fused(*args):
        return adjacent_injection(*args, blocks=blocks)

    def one(fn):  # one layer per call, cycling through the weight sets
        return cycle(lambda i: fn(*x.args(i)), list(range(layers_n)))

    inner, inner5 = (1, 1) if cfg.smoke else (10, 2)
    layer_bytes = injection_bytes(cfg, x.hidden, x.vocab, bs)
    key = f"layer/{shape_name}/{bs}"
    run.measure("injection_layer", shape_name, bs, one(fused), one(eager_layer), inner, layer_bytes,
                (eager_layer, key, one))
    run.measure("injection_5layers", shape_name, bs, chain(fused, layers_n), chain(eager_layer, layers_n),
                inner5, layers_n * layer_bytes, (eager_layer, key, lambda f: chain(f, layers_n)))

    # Five layers with one stage changed or dropped: where the time goes. no_topk: top-1 (the argmax,
    # its U row exactly) instead of the top-k and its softmax, fused and eager alike.
    run.measure("injection_5layers_no_topk", shape_name, bs, chain(fused, layers_n, top_k=1),
                chain(eager_layer, layers_n, top_k=1), inner5, layers_n * layer_bytes)

    def features_only(fn):
        def go():
            for i in range(layers_n):
                fn(x.h, x.layers[i]["score_weight"], x.table, x.anchor_ids, top_k)
        return go

    run.measure("injection_5layers_no_gate", shape_name, bs,
                features_only(lambda *a: transfer_features(*a, blocks=blocks)), features_only(eager_features), inner5,
                layers_n * injection_bytes(cfg, x.hidden, x.vocab, bs, "features"))
    t_ref = x.oracle_t().contiguous()

    def gate_only(fn):
        def go():
            for w in x.layers:
                fn(x.h, t_ref, w["gate_weight"], w["gate_bias"], w["out_weight"])
        return go

    run.measure("injection_5layers_gate_only", shape_name, bs,
                gate_only(lambda *a: inject_features(*a, blocks=blocks)), gate_only(inject_features_reference), inner5,
                layers_n * injection_bytes(cfg, x.hidden, x.vocab, bs, "gate"))

    # injection_candidates = "first_layer": one vocabulary scan (layer 1), later layers re-weight its top-k.
    def later_one(fn):  # one later layer per call on layer 1's candidates, cycling through layers 2..
        return cycle(lambda i: fn(*x.later_args(i, found)), list(range(1, layers_n)))

    def fused_later(*args):
        return inject_on_candidates(*args, blocks=blocks)

    later_bytes = injection_bytes(cfg, x.hidden, x.vocab, bs, "later")
    run.measure("injection_later_layer", shape_name, bs, later_one(fused_later),
                later_one(inject_on_candidates_reference), inner, later_bytes,
                (inject_on_candidates_reference, f"later/{shape_name}/{bs}", later_one))

    def first_layer_chain(first, later):
        def go():
            h, candidates = first(*x.args(0))
            for i in range(1, layers_n):
                h = later(*x.later_args(i, candidates, h))
            return h
        return go

    def fused_first(*args):
        out_ids = torch.empty(bs, block - 1, top_k, dtype=torch.int64, device=cfg.device)
        return adjacent_injection(*args, blocks=blocks, candidates_out=out_ids), out_ids

    def eager_first(*args):
        out, scores = adjacent_injection_reference(*args)
        return out, scores[:, :-1].topk(top_k, dim=-1).indices

    run.measure("injection_5layers_first_layer", shape_name, bs, first_layer_chain(fused_first, fused_later),
                first_layer_chain(eager_first, inject_on_candidates_reference), inner5,
                layer_bytes + (layers_n - 1) * later_bytes)
    return blocks
