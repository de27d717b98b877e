"""Fused injection and selection kernels vs eager and torch.compile references; the draft round.

Measures, at Qwen3-8B and SmolLM2-135M shapes and bs 1/8/32: the fused adjacent injection (one
layer, five layers, and variants that drop a stage; with injection_candidates "first_layer", one
later layer and the five-layer chain), the transition-path kernel, the top-k of the draft logits
(`kernels.logits_topk` vs torch.topk; its knobs swept) and the whole `select_tokens` (whose Triton
path takes its candidates from that top-k), each against the eager PyTorch reference and
`torch.compile` of it (CUDA-graph replays, median of >= 50); a full draft round
(`DSpineProposer.propose`, context 1024) of DSpine vs the ablation (no injection, argmax
selection); and a 16-token verify of a target of the same shape (lean Llama-style layers + SDPA, a
lower bound) for the verify-inclusive ratio. Achieved GB/s are against the fewest bytes each case
must move, next to a measured device copy.

GPU host:  PYTHONPATH=. python dspine/bench/kernels.py --out-dir $OUT    (< 5 min on an H200)
CPU check: python dspine/bench/kernels.py --cpu-smoke                     (tiny shapes, interpreter)

Writes kernels_h200.json (schema in the module `RESULTS` comment), kernels_h200.png and
kernels_h200_details.json (config sweep, correctness checks, compile times, errors) to
--out-dir, rewriting them after every measurement so a timeout still leaves results. Runs from a
plain checkout: no `pip install` needed (see `_kernels_shim`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START = time.time()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the JSON/PNG go (default benchmarks/results; a temp dir with --cpu-smoke)")
    p.add_argument("--quick", action="store_true", help="bs 1 and 32 only, smaller config sweep")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting optional work after this many seconds (default 270, quick 150)")
    p.add_argument("--reps", type=int, default=None, help="timed samples per case (median; default 50)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines (compile_ms null)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.cpu_smoke:  # before Triton builds any kernel
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DSPINE_KERNELS"] = "triton"


def _kernels_shim() -> None:
    """`dspine.kernels` is the top-level `kernels/` folder (pyproject's package-dir mapping). Without
    an install, register it by hand before `dspine` is imported: the repo root goes on sys.path."""
    sys.path.insert(0, str(ROOT))
    if "dspine.kernels" in sys.modules:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("dspine.kernels", ROOT / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dspine.kernels"] = module
    spec.loader.exec_module(module)
    import dspine

    dspine.kernels = module


_kernels_shim()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dspine.model.config import DSpineConfig  # noqa: E402
from dspine.model.drafter import DSpineDrafter  # noqa: E402
from dspine.kernels.adjacent_injection import (  # noqa: E402
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
from dspine.kernels.logits_topk import logits_topk, logits_topk_reference, topk_grid  # noqa: E402
from dspine.kernels.transition_select import transition_path, transition_path_reference  # noqa: E402
from dspine.engine.proposer import DSpineProposer  # noqa: E402
from dspine.model.transition import TransitionScorer, select_tokens  # noqa: E402

# RESULTS (kernels_h200.json): {"device", "date", "torch", "triton", "command", "copy_bandwidth_gbs",
#   "cases": [{"name", "shape", "bs", "triton_ms", "eager_ms", "compile_ms" (null: not compiled or
#              failed), "gbs" (bytes floor of the case / triton_ms)}],
#   "round": [{"shape", "bs", "dspine_ms", "ablation_ms", "dspine_first_layer_ms"}],
#   "verify": [{"shape", "bs", "tokens", "context", "verify_ms", "dspine_round_ms", "ablation_round_ms",
#               "round_ratio", "verify_inclusive_ratio", "first_layer_round_ms", "first_layer_round_ratio",
#               "first_layer_verify_inclusive_ratio"}],
# dspine_ms is the drafter with injection_candidates "per_layer" (a vocabulary scan in every layer),
# dspine_first_layer_ms with "first_layer" (one scan; later layers re-weight layer 1's top-k).
#   "targets": {name: {"target", "value", "met"}}}

SHAPES = {  # drafter = target shapes; transfer rank 256, injection/selection top-k 8, blocks of 16
    "qwen3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=151936, ffn=12288, target_layers=36),
    "smollm2-135m": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, vocab=49152, ffn=1536, target_layers=30),
}
SMOKE_SHAPES = {
    "tiny-a": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=600, ffn=128, target_layers=4),
    "tiny-b": dict(hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=400, ffn=64, target_layers=3),
}
RANK, TOP_K, BLOCK, DRAFT_LAYERS = 256, 8, 16, 5
# Launch-config variants swept on the device (overrides of `blocks_for`'s defaults).
# (Register use on sm_90 from an offline compile with Triton 3.9: the default top-k tile takes 154
# registers, 3 programs per SM; block_v 128 needs 8 warps not to spill.)
TOPK_VARIANTS = [{}, {"warps": 8}, {"block_v": 128, "warps": 8}, {"block_v": 32}, {"programs_per_sm": 6},
                 {"programs_per_sm": 2}, {"early_exit": False}]
TOPK_VARIANTS_LARGE = [{}, {"warps": 8}, {"block_v": 32}, {"early_exit": False}]
GATE_VARIANTS = [{}, {"gate_block_n": 16, "gate_block_k": 256}, {"gate_block_n": 64, "gate_block_k": 64},
                 {"gate_block_k": 256, "gate_stages": 3}]
# A later layer of injection_candidates "first_layer" (`inject_on_candidates`): its pass over h (hidden_*: the
# gate's GEMM plus W_s; hidden_split programs per dot, split-K), then its features-and-gate kernel (mix_*),
# each swept on top of the best of the one before. (sm_90, offline: the default mix program takes 185
# registers at 8 warps and spills at 4.)
LATER_HIDDEN_VARIANTS = [{}, {"hidden_split": 2}, {"hidden_split": 4, "hidden_block_k": 256},
                         {"hidden_block_k": 256, "hidden_stages": 3}, {"hidden_block_n": 16, "hidden_block_k": 256},
                         {"hidden_split": 2, "hidden_block_n": 64}]
LATER_HIDDEN_VARIANTS_LARGE = [{}, {"hidden_split": 2}, {"hidden_block_k": 256, "hidden_stages": 3}]
LATER_MIX_VARIANTS = [{}, {"mix_warps": 4}, {"mix_block_n": 64}, {"mix_block_n": 16}, {"mix_tiles_n": 2}]
LATER_MIX_VARIANTS_LARGE = [{}, {"mix_tiles_n": 8}, {"mix_block_n": 32, "mix_tiles_n": 8}, {"mix_tiles_n": 1}]
# Knob variants of the logits top-k (keyword overrides of `logits_topk`'s defaults: programs_per_sm 4,
# block_v 1024, warps 4, block_m 1, merge "ticket"). programs_per_sm and slices set the slices per row
# (the default is ceil(programs_per_sm * SMs / rows)); merge "kernel" is the two-launch merge.
LOGITS_TOPK_VARIANTS = [{}, {"programs_per_sm": 2}, {"programs_per_sm": 8}, {"programs_per_sm": 16},
                        {"block_v": 2048, "warps": 8}, {"block_v": 512}, {"block_v": 4096, "warps": 8},
                        {"warps": 8}, {"merge": "kernel"}, {"block_m": 2, "block_v": 512}, {"slices": 1}]

SMOKE = ARGS.cpu_smoke
DEVICE = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.bfloat16
REPS = ARGS.reps or (2 if SMOKE else 50)
SWEEP_REPS, SWEEP_INNER = (REPS, 1) if SMOKE else (max(20, REPS // 2), 10)
BUDGET_S = ARGS.budget_s or (600.0 if SMOKE else 150.0 if ARGS.quick else 270.0)
BATCHES = [1, 2] if SMOKE else [1, 32] if ARGS.quick else [1, 8, 32]
CONTEXT = 32 if SMOKE else 1024
if SMOKE:
    RANK, TOP_K, TOPK_VARIANTS, TOPK_VARIANTS_LARGE, GATE_VARIANTS = 32, 4, [{}, {"early_exit": False}], [{}], [{}]
    LATER_HIDDEN_VARIANTS = [{}, {"hidden_split": 2, "hidden_block_k": 32}]
    LATER_MIX_VARIANTS = [{}, {"mix_tiles_n": 2}]
    LATER_HIDDEN_VARIANTS_LARGE, LATER_MIX_VARIANTS_LARGE = [{}], [{}]
    LOGITS_TOPK_VARIANTS = [{}, {"block_v": 128, "slices": 4}, {"block_v": 128, "slices": 4, "merge": "kernel"}]
elif ARGS.quick:
    TOPK_VARIANTS, TOPK_VARIANTS_LARGE, GATE_VARIANTS = TOPK_VARIANTS[:4], TOPK_VARIANTS_LARGE[:3], GATE_VARIANTS[:2]
    LATER_HIDDEN_VARIANTS, LATER_MIX_VARIANTS = LATER_HIDDEN_VARIANTS[:3], LATER_MIX_VARIANTS[:2]
    LATER_HIDDEN_VARIANTS_LARGE = LATER_HIDDEN_VARIANTS_LARGE[:2]
    LATER_MIX_VARIANTS_LARGE = LATER_MIX_VARIANTS_LARGE[:2]
    LOGITS_TOPK_VARIANTS = LOGITS_TOPK_VARIANTS[:6] + [{"merge": "kernel"}]
OUT_DIR = ARGS.out_dir or (Path("/tmp/dspine_bench_smoke") if SMOKE else ROOT / "benchmarks" / "results")
GB = 1e9


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def remaining() -> float:
    return BUDGET_S - (time.time() - START)


# ------------------------------------------------------------------------------------ results
def _versions() -> tuple[str, str]:
    try:
        import triton

        return torch.__version__, triton.__version__
    except ImportError:
        return torch.__version__, "missing"


RESULTS: dict = {
    "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (Triton interpreter smoke run)",
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "torch": _versions()[0], "triton": _versions()[1],
    "command": " ".join(["python"] + sys.argv),
    "copy_bandwidth_gbs": None, "cases": [], "round": [], "verify": [], "targets": {},
}
DETAILS: dict = {**{k: RESULTS[k] for k in ("command", "device", "date", "torch", "triton")},  # provenance, as RESULTS
                 "budget_s": BUDGET_S, "reps": REPS, "sweep": [], "best_blocks": {}, "correctness": [], "argmax_ms": {},
                 "compile_s": {}, "round_torch_kernels": [], "errors": [], "notes": [], "floors_ms": {}}


def save() -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, data in (("kernels_h200.json", RESULTS), ("kernels_h200_details.json", DETAILS)):
        tmp = OUT_DIR / (name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(OUT_DIR / name)


def record_error(where: str, exc: BaseException) -> None:
    log(f"ERROR in {where}: {type(exc).__name__}: {exc}")
    DETAILS["errors"].append({"where": where, "error": f"{type(exc).__name__}: {exc}",
                              "trace": traceback.format_exc(limit=6)})
    save()


# ------------------------------------------------------------------------------------- timing
def bench_ms(fn, inner: int = 1, reps: int = REPS) -> float:
    """Median milliseconds of one `fn()` call. CUDA: `inner` calls captured in one CUDA graph,
    `reps` replays enqueued back to back, each between two events (launch gaps excluded);
    falls back to timing plain launches when capture fails. CPU: wall clock."""
    if DEVICE.type != "cuda":
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compilation, caches, cuBLAS handles
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize()
        DETAILS["notes"].append(f"graph capture failed, timed launches instead: {type(exc).__name__}: {exc}"[:300])
        graph = None

        def run():
            for _ in range(inner):
                fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    run()
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in events) / inner


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, bytes read + written, GB/s."""
    n = (1 << 30) if DEVICE.type == "cuda" else (1 << 22)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), inner=5)
    return 2 * n / (ms * 1e-3) / GB


# ------------------------------------------------------------------------------- kernel inputs
def shape_table() -> dict:
    return SMOKE_SHAPES if SMOKE else SHAPES


def injection_bytes(hidden: int, vocab: int, bs: int, stage: str = "layer") -> int:
    """Fewest bytes one layer's injection (or one stage of it) must move: every weight and the
    table read once, h read and h_out written once (t, fp32, between the stages). "later": a later
    layer of injection_candidates "first_layer" (W_s, G, W_o, the candidate ids and their U rows)."""
    e = torch.tensor([], dtype=DTYPE).element_size()
    h_bytes, t_bytes = bs * BLOCK * hidden * e, bs * (BLOCK - 1) * RANK * 4
    features = (vocab * RANK + RANK * hidden) * e + h_bytes + t_bytes
    gate = (hidden * (hidden + RANK) + hidden * RANK + hidden) * e + 2 * h_bytes + t_bytes
    later = gate - t_bytes + RANK * hidden * e + bs * (BLOCK - 1) * TOP_K * (8 + RANK * e)
    return {"features": features, "gate": gate, "layer": features + gate - 2 * t_bytes, "later": later}[stage]


class InjectionInputs:
    """Random inputs of one (shape, bs): h [bs, B, H], the shared table U [V, r], anchors and
    DRAFT_LAYERS sets of per-layer weights (distinct, so five layers do not re-read one set from L2)."""

    def __init__(self, shape: dict, bs: int, seed: int = 0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        hidden, vocab = shape["hidden"], shape["vocab"]

        def rnd(*size, scale=1.0):
            return (torch.randn(*size, generator=g, device=DEVICE, dtype=torch.float32) * scale).to(DTYPE)

        self.bs, self.hidden, self.vocab = bs, hidden, vocab
        self.h = rnd(bs, BLOCK, hidden)
        self.table = rnd(vocab, RANK)
        self.anchor_ids = torch.randint(0, vocab, (bs,), generator=g, device=DEVICE)
        self.layers = [dict(score_weight=rnd(RANK, hidden, scale=hidden**-0.5),
                            gate_weight=rnd(hidden, hidden + RANK, scale=(hidden + RANK) ** -0.5),
                            gate_bias=rnd(hidden), out_weight=rnd(hidden, RANK, scale=RANK**-0.5))
                       for _ in range(DRAFT_LAYERS)]

    def args(self, layer: int, h=None) -> tuple:
        w = self.layers[layer]
        return (self.h if h is None else h, w["score_weight"], self.table, self.anchor_ids, w["gate_weight"],
                w["gate_bias"], w["out_weight"], TOP_K)

    def later_args(self, layer: int, candidates: torch.Tensor, h=None) -> tuple:
        """Arguments of `inject_on_candidates` (a later layer re-weighting `candidates`)."""
        w = self.layers[layer]
        return (self.h if h is None else h, w["score_weight"], self.table, self.anchor_ids, candidates,
                w["gate_weight"], w["gate_bias"], w["out_weight"])

    def candidates(self, blocks: InjectionBlocks | None = None) -> torch.Tensor:
        """Layer 1's top-k ids [bs, B-1, k] (the fused scan's `candidates_out`)."""
        found = torch.empty(self.bs, BLOCK - 1, TOP_K, dtype=torch.int64, device=DEVICE)
        transfer_features(self.h, self.layers[0]["score_weight"], self.table, self.anchor_ids, TOP_K, blocks,
                          candidates_out=found)
        return found


def _oracle_t(x: InjectionInputs, layer: int = 0) -> torch.Tensor:
    """Reference features with fp32 scores (q by the reference's own op), [bs, B-1, r]."""
    q = (x.h @ x.layers[layer]["score_weight"].T).float()
    eye = torch.eye(RANK, device=DEVICE)
    t, _ = transfer_features_reference(q, eye, x.table.float(), x.anchor_ids, TOP_K)
    return t[:, :-1]


def check_features(t: torch.Tensor, t_ref: torch.Tensor) -> dict:
    rows_bad = int(((t - t_ref).abs().amax(-1) > 1e-3).sum())
    return {"bad_rows": rows_bad, "rows": int(t.shape[0] * (t.shape[1] - 1)),
            "max_abs_err": float((t - t_ref).abs().max()), "nan": bool(t.isnan().any())}


def features_ok(check: dict) -> bool:
    return not check["nan"] and check["bad_rows"] <= max(1, check["rows"] // 100)


def later_rel_err(x: InjectionInputs, candidates: torch.Tensor, blocks: InjectionBlocks, layer: int = 1) -> float:
    """Relative error of the fused later layer against its reference (NaN -> inf)."""
    out = inject_on_candidates(*x.later_args(layer, candidates), blocks=blocks).float()
    ref = inject_on_candidates_reference(*x.later_args(layer, candidates)).float()
    err = float((out - ref).norm() / ref.norm())
    return err if math.isfinite(err) else float("inf")


# ------------------------------------------------------------------------------ reference fns
def eager_layer(*args):
    return adjacent_injection_reference(*args)[0]


def eager_no_topk(h, score_weight, table, anchor_ids, gate_weight, gate_bias, out_weight, top_k):
    """The reference with top-1 (argmax) instead of top-k + softmax: what the top-k stage costs."""
    scores = (h @ score_weight.T) @ table.T
    t = table[scores.argmax(-1)].float()
    t = torch.cat([table[anchor_ids].float()[:, None], t[:, 1:]], dim=1)
    return inject_features_reference(h, t, gate_weight, gate_bias, out_weight)


def eager_features(h, score_weight, table, anchor_ids, top_k):
    return transfer_features_reference(h, score_weight, table, anchor_ids, top_k)[0]


def eager_logits_topk(logits):
    """What select_tokens' PyTorch path runs: torch.topk of the logits, values cast to fp32."""
    values, indices = logits.topk(TOP_K, dim=-1)
    return values.float(), indices


COMPILED: dict = {}
PENDING: list = []  # torch.compile baselines, run after everything else, most important first


def compiled(fn, key: str):
    """torch.compile of a reference (cached per key), or None when it failed."""
    if key not in COMPILED:
        try:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = 64
            COMPILED[key] = torch.compile(fn, dynamic=False)
        except Exception as exc:  # noqa: BLE001
            record_error(f"torch.compile({key})", exc)
            COMPILED[key] = None
    return COMPILED[key]


def defer_compile(case: dict, fn, key: str, make_run, inner: int) -> None:
    """Queue the compiled baseline of `case`: make_run(compiled_fn) -> a runner to time. Compiling
    takes tens of seconds a shape, so it runs last (`run_compiles`) and only while budget is left."""
    if ARGS.no_compile or SMOKE:
        return
    shapes = list(shape_table())
    priority = ([1, 32, 8].index(case["bs"]) if case["bs"] in (1, 32, 8) else 9, shapes.index(case["shape"]))
    PENDING.append((priority, len(PENDING), case, fn, key, make_run, inner))


def run_compiles() -> None:
    for _, _, case, fn, key, make_run, inner in sorted(PENDING, key=lambda p: p[:2]):
        tag = f"{case['name']}/{case['shape']}/bs{case['bs']}"
        if remaining() < 40:
            DETAILS["notes"].append(f"compile baseline {tag} skipped: {remaining():.0f} s of budget left")
            continue
        cfn = compiled(fn, key)
        if cfn is None:
            continue
        try:
            run = make_run(cfn)
            t0 = time.time()
            run()
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            DETAILS["compile_s"][tag] = round(time.time() - t0, 1)
            case["compile_ms"] = round(bench_ms(run, inner=inner), 5)
            log(f"  compiled {tag:<45} {case['compile_ms']:8.4f} ms (triton {case['triton_ms']:.4f}, "
                f"compile took {DETAILS['compile_s'][tag]} s)")
        except Exception as exc:  # noqa: BLE001
            COMPILED[key] = None
            record_error(f"compiled {tag}", exc)
        save()


def add_case(name: str, shape: str, bs: int, triton_ms: float, eager_ms: float, compile_ms: float | None,
             nbytes: int) -> dict:
    case = {"name": name, "shape": shape, "bs": bs, "triton_ms": round(triton_ms, 5), "eager_ms": round(eager_ms, 5),
            "compile_ms": None if compile_ms is None else round(compile_ms, 5),
            "gbs": round(nbytes / (triton_ms * 1e-3) / GB, 1)}
    RESULTS["cases"].append(case)
    comp = "   n/a" if compile_ms is None else f"{compile_ms:8.4f}"
    log(f"  {name:<28} {shape:<13} bs={bs:<3} triton {triton_ms:8.4f} ms  eager {eager_ms:8.4f}  "
        f"compile {comp}  {case['gbs']:7.1f} GB/s  x{eager_ms / triton_ms:5.2f} vs eager")
    save()
    return case


def measure(name: str, shape: str, bs: int, triton_run, eager_run, inner: int, nbytes: int,
            compile_spec: tuple | None = None) -> dict | None:
    """Time the fused runner and the eager one, record the case (None when either fails) and
    queue its torch.compile baseline: compile_spec = (reference fn, cache key, make_run)."""
    try:
        tri = bench_ms(triton_run, inner=inner)
        eag = bench_ms(eager_run, inner=inner)
    except Exception as exc:  # noqa: BLE001
        record_error(f"{name} {shape} bs={bs}", exc)
        return None
    case = add_case(name, shape, bs, tri, eag, None, nbytes)
    if compile_spec is not None:
        defer_compile(case, *compile_spec, inner)
    return case


# ------------------------------------------------------------------------------ config sweep
def cycle(fn, items: list):
    """A runner calling fn(item) with the next item on each call (rotating weight sets, so
    repeated timing does not serve one layer's weights from L2)."""
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(items)
        return fn(items[state["i"]])
    return run


def sweep_variants(stage: str, shape: str, bs: int, variants: list[dict], run) -> tuple[dict | None, float]:
    """Time each override of `variants` with `run(over) -> (ms, ok, fields, note)` (the first, {},
    always; the others while budget is left), record it in DETAILS["sweep"] (with `fields`) and log it.
    Returns the fastest override with `ok` and its ms; (None, inf) when none was ok."""
    best, best_ms = None, float("inf")
    for over in variants:
        if remaining() < 90 and over:
            break
        try:
            ms, ok, fields, note = run(over)
        except Exception as exc:  # noqa: BLE001
            record_error(f"sweep {stage} {shape} bs={bs} {over}", exc)
            continue
        DETAILS["sweep"].append({"stage": stage, "shape": shape, "bs": bs, "override": over, "ms": ms, **fields})
        log(f"  sweep {stage} {str(over):<42} {ms:8.4f} ms  {note}")
        if ok and ms < best_ms:
            best, best_ms = over, ms
    return best, best_ms


def sweep_blocks(x: InjectionInputs, shape: str) -> InjectionBlocks:
    """Time launch-config variants of the two stages on this input; keep the fastest correct ones."""
    base = blocks_for(x.bs, BLOCK)
    t_ref = _oracle_t(x)

    def topk(over):
        blocks = dataclasses.replace(base, **over)
        t = transfer_features(x.h, x.layers[0]["score_weight"], x.table, x.anchor_ids, TOP_K, blocks)
        check = check_features(t, t_ref)
        ms = bench_ms(cycle(lambda w: transfer_features(x.h, w["score_weight"], x.table, x.anchor_ids, TOP_K,
                                                        blocks), x.layers), inner=SWEEP_INNER, reps=SWEEP_REPS)
        return ms, features_ok(check), check, f"bad rows {check['bad_rows']}/{check['rows']}"

    over, _ = sweep_variants("topk", shape, x.bs, TOPK_VARIANTS if x.bs * (BLOCK - 2) <= 64 else TOPK_VARIANTS_LARGE,
                             topk)
    best = best_topk = base if over is None else dataclasses.replace(base, **over)
    t = t_ref.contiguous()

    def gate(over):
        blocks = dataclasses.replace(best_topk, **over)
        ms = bench_ms(cycle(lambda w: inject_features(x.h, t, w["gate_weight"], w["gate_bias"], w["out_weight"],
                                                      blocks), x.layers), inner=SWEEP_INNER, reps=SWEEP_REPS)
        return ms, True, {}, ""

    over, _ = sweep_variants("gate", shape, x.bs, GATE_VARIANTS, gate)
    best = best if over is None else dataclasses.replace(best_topk, **over)
    # A later layer (inject_on_candidates): its pass over h, then its features-and-gate kernel.
    candidates = x.candidates(best)
    large = x.bs * (BLOCK - 2) > 64
    for stage, variants in (("later_hidden", LATER_HIDDEN_VARIANTS_LARGE if large else LATER_HIDDEN_VARIANTS),
                            ("later_mix", LATER_MIX_VARIANTS_LARGE if large else LATER_MIX_VARIANTS)):
        start = best

        def later(over, start=start):
            blocks = dataclasses.replace(start, **over)
            err = later_rel_err(x, candidates, blocks)
            ms = bench_ms(cycle(lambda i: inject_on_candidates(*x.later_args(i, candidates), blocks=blocks),
                                list(range(1, DRAFT_LAYERS))), inner=SWEEP_INNER, reps=SWEEP_REPS)
            return ms, err < 2e-2, {"h_rel_err": err}, f"rel err {err:.2e}"

        over, _ = sweep_variants(stage, shape, x.bs, variants, later)
        best = best if over is None else dataclasses.replace(start, **over)
    DETAILS["best_blocks"][f"{shape}/bs{x.bs}"] = dataclasses.asdict(best)
    save()
    return best


def sweep_logits_topk(logits: torch.Tensor, shape: str, bs: int) -> dict:
    """Time the `logits_topk` knob variants on logits [rows, V]; keep the fastest exact one (the
    kernel and its reference share the tie rule, so indices must match exactly). Returns its overrides."""
    want_val, want_idx = logits_topk_reference(logits, TOP_K)
    rows, vocab = logits.shape

    def run(over):
        values, indices = logits_topk(logits, TOP_K, **over)
        ok = bool(torch.equal(indices, want_idx)) and bool(torch.equal(values, want_val))
        ms = bench_ms(lambda: logits_topk(logits, TOP_K, **over), inner=SWEEP_INNER, reps=SWEEP_REPS)
        grid = {key: over[key] for key in ("slices", "block_m", "block_v", "programs_per_sm") if key in over}
        tiles, slices, _ = topk_grid(rows, vocab, DEVICE, **grid)
        return ms, ok, {"ok": ok, "row_tiles": tiles, "slices": slices}, f"{tiles}x{slices} programs  exact {ok}"

    best, best_ms = sweep_variants("logits_topk", shape, bs, LOGITS_TOPK_VARIANTS, run)
    best = {} if best is None else best
    DETAILS["best_blocks"][f"logits_topk/{shape}/bs{bs}"] = {"override": best, "ms": best_ms}
    save()
    return best


# --------------------------------------------------------------------------- kernel sections
def injection_cases(shape_name: str, shape: dict, bs: int, blocks: InjectionBlocks | None) -> None:
    x = InjectionInputs(shape, bs, seed=bs)
    if blocks is None:
        blocks = sweep_blocks(x, shape_name)
    # Correctness of the configuration we time, at these shapes.
    t_ref = _oracle_t(x)
    check = check_features(transfer_features(x.h, x.layers[0]["score_weight"], x.table, x.anchor_ids, TOP_K,
                                             blocks), t_ref)
    out = adjacent_injection(*x.args(0), blocks=blocks)
    ref = inject_features_reference(x.h, t_ref, x.layers[0]["gate_weight"], x.layers[0]["gate_bias"],
                                    x.layers[0]["out_weight"])
    check["h_rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
    check.update(shape=shape_name, bs=bs, ok=features_ok(check) and check["h_rel_err"] < 2e-2)
    DETAILS["correctness"].append(check)
    log(f"  correctness {shape_name} bs={bs}: {check}")
    found = x.candidates(blocks)
    later = {"kernel": "inject_on_candidates", "shape": shape_name, "bs": bs,
             "h_rel_err": later_rel_err(x, found, blocks)}
    later["ok"] = later["h_rel_err"] < 2e-2
    DETAILS["correctness"].append(later)
    log(f"  correctness {shape_name} bs={bs}: {later}")
    save()

    def layers(fn, count):  # `count` layers, each with its own weights, chained through h
        def run():
            h = x.h
            for i in range(count):
                h = fn(*x.args(i, h))
            return h
        return run

    def fused(*args):
        return adjacent_injection(*args, blocks=blocks)

    def one(fn):  # one layer per call, cycling through the weight sets
        return cycle(lambda i: fn(*x.args(i)), list(range(DRAFT_LAYERS)))

    inner, inner5 = (1, 1) if SMOKE else (10, 2)
    layer_bytes = injection_bytes(x.hidden, x.vocab, bs)
    key = f"layer/{shape_name}/{bs}"
    measure("injection_layer", shape_name, bs, one(fused), one(eager_layer), inner, layer_bytes,
            (eager_layer, key, one))
    measure("injection_5layers", shape_name, bs, layers(fused, DRAFT_LAYERS), layers(eager_layer, DRAFT_LAYERS),
            inner5, DRAFT_LAYERS * layer_bytes, (eager_layer, key, lambda f: layers(f, DRAFT_LAYERS)))

    # Variants that drop one stage (five layers): where the time goes.
    no_topk = dataclasses.replace(blocks, topk=False)
    measure("injection_5layers_no_topk", shape_name, bs,
            layers(lambda *a: adjacent_injection(*a, blocks=no_topk), DRAFT_LAYERS),
            layers(eager_no_topk, DRAFT_LAYERS), inner5, DRAFT_LAYERS * layer_bytes)

    def features_only(fn):
        def run():
            for i in range(DRAFT_LAYERS):
                fn(x.h, x.layers[i]["score_weight"], x.table, x.anchor_ids, TOP_K)
        return run

    measure("injection_5layers_no_gate", shape_name, bs,
            features_only(lambda *a: transfer_features(*a, blocks=blocks)), features_only(eager_features), inner5,
            DRAFT_LAYERS * injection_bytes(x.hidden, x.vocab, bs, "features"))
    t_ref = t_ref.contiguous()

    def gate_only(fn):
        def run():
            for i in range(DRAFT_LAYERS):
                w = x.layers[i]
                fn(x.h, t_ref, w["gate_weight"], w["gate_bias"], w["out_weight"])
        return run

    measure("injection_5layers_gate_only", shape_name, bs,
            gate_only(lambda *a: inject_features(*a, blocks=blocks)), gate_only(inject_features_reference), inner5,
            DRAFT_LAYERS * injection_bytes(x.hidden, x.vocab, bs, "gate"))

    # injection_candidates = "first_layer": one vocabulary scan (layer 1), later layers re-weight its top-k.
    def later_one(fn):  # one later layer per call on layer 1's candidates, cycling through layers 2..
        return cycle(lambda i: fn(*x.later_args(i, found)), list(range(1, DRAFT_LAYERS)))

    def fused_later(*args):
        return inject_on_candidates(*args, blocks=blocks)

    later_bytes = injection_bytes(x.hidden, x.vocab, bs, "later")
    measure("injection_later_layer", shape_name, bs, later_one(fused_later), later_one(inject_on_candidates_reference),
            inner, later_bytes, (inject_on_candidates_reference, f"later/{shape_name}/{bs}", later_one))

    def first_layer_chain(first, later):
        def run():
            h, candidates = first(*x.args(0))
            for i in range(1, DRAFT_LAYERS):
                h = later(*x.later_args(i, candidates, h))
            return h
        return run

    def fused_first(*args):
        found = torch.empty(bs, BLOCK - 1, TOP_K, dtype=torch.int64, device=DEVICE)
        return adjacent_injection(*args, blocks=blocks, candidates_out=found), found

    def eager_first(*args):
        out, scores = adjacent_injection_reference(*args)
        return out, scores[:, :-1].topk(TOP_K, dim=-1).indices

    measure("injection_5layers_first_layer", shape_name, bs, first_layer_chain(fused_first, fused_later),
            first_layer_chain(eager_first, inject_on_candidates_reference), inner5,
            layer_bytes + (DRAFT_LAYERS - 1) * later_bytes)


def selection_cases(shape_name: str, shape: dict, bs: int) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(bs)
    n, k, vocab = BLOCK - 1, TOP_K, shape["vocab"]
    unary = torch.randn(bs, n, k, generator=g, device=DEVICE) * 2
    pair = torch.randn(bs, n, k, k, generator=g, device=DEVICE)
    temperature = torch.tensor([0.0, 0.8], device=DEVICE)[torch.arange(bs, device=DEVICE) % 2]
    uniforms = torch.rand(bs, n, generator=g, device=DEVICE)
    choice, q = transition_path(unary, pair, 1.0, temperature, uniforms)
    choice_ref, q_ref = transition_path_reference(unary, pair, 1.0, temperature, uniforms)
    ok = bool(torch.equal(choice, choice_ref)) and float((q - q_ref).abs().max()) < 1e-5
    DETAILS["correctness"].append({"kernel": "transition_path", "shape": shape_name, "bs": bs, "ok": ok,
                                   "q_max_abs_err": float((q - q_ref).abs().max())})
    args = (unary, pair, 1.0, temperature, uniforms)
    inner = 1 if SMOKE else 20
    nbytes = unary.numel() * 4 + pair.numel() * 4 + uniforms.numel() * 4 + bs * n * (8 + 4 * k)
    measure("transition_path", shape_name, bs, lambda: transition_path(*args),
            lambda: transition_path_reference(*args), inner, nbytes,
            (transition_path_reference, f"path/{shape_name}/{bs}", lambda f: lambda: f(*args)))

    # The top-K of the draft logits alone (select_tokens' first step): default knobs, then the sweep.
    logits = torch.randn(bs, n, vocab, generator=g, device=DEVICE).to(DTYPE)
    flat = logits.view(bs * n, vocab)
    values, indices = logits_topk(flat, k)
    want_val, want_idx = logits_topk_reference(flat, k)
    DETAILS["correctness"].append({"kernel": "logits_topk", "shape": shape_name, "bs": bs,
                                   "ok": bool(torch.equal(indices, want_idx)) and bool(torch.equal(values, want_val)),
                                   "rows_differ": int((indices != want_idx).any(-1).sum())})
    topk_bytes = flat.numel() * flat.element_size() + flat.shape[0] * k * 12
    measure("logits_topk", shape_name, bs, lambda: logits_topk(flat, k), lambda: eager_logits_topk(flat), inner,
            topk_bytes, (eager_logits_topk, f"logits_topk/{shape_name}/{bs}", lambda f: lambda: f(flat)))
    sweep_logits_topk(flat, shape_name, bs)

    # The whole selection of a round: top-K of the draft logits (Triton path: `logits_topk` with its
    # default knobs), pair scores, path.
    table = torch.randn(vocab, RANK, generator=g, device=DEVICE).to(DTYPE)
    scorer = TransitionScorer(RANK).to(device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        scorer.weight.normal_(std=RANK**-0.5, generator=g)
    anchors = torch.randint(0, vocab, (bs,), generator=g, device=DEVICE)

    def select(mode):
        def run():
            os.environ["DSPINE_KERNELS"] = mode
            return select_tokens(logits, anchors, temperature, mode="transition", top_k=k, lam=1.0, scorer=scorer,
                                 table=table)
        return run

    nbytes = logits.numel() * logits.element_size() + bs * n * k * 2 * RANK * table.element_size()
    with torch.no_grad():
        measure("select_tokens", shape_name, bs, select("triton"), select("torch"), inner, nbytes)
        # What the ablation's selection costs (argmax of the same logits): select_tokens minus this
        # is what transition selection adds to a round.
        DETAILS["argmax_ms"][f"{shape_name}/bs{bs}"] = bench_ms(lambda: logits.argmax(-1), inner=inner)
    os.environ["DSPINE_KERNELS"] = "triton" if SMOKE else "auto"


# ------------------------------------------------------------------------------- draft round
def drafter_config(shape: dict, **overrides) -> DSpineConfig:
    return DSpineConfig(hidden_size=shape["hidden"], vocab_size=shape["vocab"], num_attention_heads=shape["heads"],
                        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                        intermediate_size=shape["ffn"], num_target_layers=shape["target_layers"], mask_token_id=0,
                        num_hidden_layers=DRAFT_LAYERS, block_size=BLOCK, transfer_rank=RANK,
                        injection_top_k=TOP_K, selection_top_k=TOP_K, sliding_window=max(2048, 2 * CONTEXT),
                        max_position_embeddings=max(8192, 4 * CONTEXT), **overrides)


class Round:
    """One drafter (DSpine or ablation) with a proposer holding a CONTEXT-token context per row."""

    def __init__(self, shape: dict, embeddings: tuple, bs: int, ablation: bool, seed: int = 0,
                 candidates: str = "per_layer"):
        torch.manual_seed(seed)
        cfg = drafter_config(shape, **({"injection": False, "selection": "argmax"} if ablation
                                       else {"injection_candidates": candidates}))
        with torch.device(DEVICE):
            self.model = DSpineDrafter(cfg).to(DTYPE).eval()
        with torch.no_grad():  # no all-zero parameters in what we time
            self.model.mask_embedding.normal_()
            if self.model.transition is not None:
                self.model.transition.weight.normal_(std=RANK**-0.5)
        self.model.attach_target(*embeddings)
        self.proposer = DSpineProposer(self.model)
        self.proposer.successors = None  # pair scores on the fly: the lazy table syncs with the host
        self.resize(bs)

    @torch.no_grad()
    def resize(self, bs: int) -> None:
        cfg = self.model.config
        g = torch.Generator(device=DEVICE).manual_seed(bs)
        tokens = torch.randint(0, cfg.vocab_size, (bs, CONTEXT), generator=g, device=DEVICE)
        hidden = torch.randn(bs, CONTEXT, cfg.num_context_features * cfg.hidden_size, generator=g,
                             device=DEVICE).to(DTYPE)
        self.proposer.start(tokens, hidden, torch.full((bs,), CONTEXT, device=DEVICE))
        self.anchor = torch.randint(0, cfg.vocab_size, (bs,), generator=g, device=DEVICE)
        self.temperature = torch.zeros(bs, device=DEVICE)

    @torch.no_grad()
    def propose(self):
        return self.proposer.propose(self.anchor, self.temperature, None)


def round_section(shape_name: str, shape: dict) -> dict:
    """Draft-round ms per bs: {bs: (dspine_ms, ablation_ms, dspine_first_layer_ms)}."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    embeddings = tuple(torch.randn(shape["vocab"], shape["hidden"], generator=g, device=DEVICE).to(DTYPE)
                       for _ in range(2))
    out = {}
    dspine = ablation = first = None
    try:
        dspine = Round(shape, embeddings, BATCHES[0], ablation=False)
        ablation = Round(shape, embeddings, BATCHES[0], ablation=True)
        first = Round(shape, embeddings, BATCHES[0], ablation=False, candidates="first_layer")
        for bs in BATCHES:
            if remaining() < 30:
                DETAILS["notes"].append(f"round {shape_name} bs={bs} skipped: out of budget")
                break
            for r in (dspine, ablation, first):
                r.resize(bs)
            d_ms, a_ms, f_ms = (bench_ms(r.propose) for r in (dspine, ablation, first))
            out[bs] = (d_ms, a_ms, f_ms)
            RESULTS["round"].append({"shape": shape_name, "bs": bs, "dspine_ms": round(d_ms, 4),
                                     "ablation_ms": round(a_ms, 4), "dspine_first_layer_ms": round(f_ms, 4)})
            log(f"  round {shape_name:<13} bs={bs:<3} DSpine {d_ms:8.4f} ms  first-layer {f_ms:8.4f} ms  "
                f"ablation {a_ms:8.4f} ms  ratios {d_ms / a_ms:5.3f} / {f_ms / a_ms:5.3f}")
            save()
            if not SMOKE:  # the same round with the PyTorch references in place of the kernels
                os.environ["DSPINE_KERNELS"] = "torch"
                try:
                    t_ms = bench_ms(dspine.propose)
                finally:
                    os.environ["DSPINE_KERNELS"] = "auto"
                DETAILS["round_torch_kernels"].append({"shape": shape_name, "bs": bs, "dspine_torch_ms": t_ms})
                log(f"  round {shape_name:<13} bs={bs:<3} DSpine with torch references {t_ms:8.4f} ms")
                save()
    except Exception as exc:  # noqa: BLE001
        record_error(f"round {shape_name}", exc)
    del dspine, ablation, first, embeddings
    return out


# ------------------------------------------------------------------------------------- verify
class LeanTarget:
    """A Llama/Qwen3-shaped target without the frills (no RoPE, no q/k norms, no mask): per layer
    RMSNorm, fused QKV GEMM, KV-cache write, SDPA over the context + block, O GEMM, RMSNorm,
    fused gate/up GEMM, SiLU·up, down GEMM; then the lm_head. A lower bound of a real verify."""

    def __init__(self, shape: dict, bs: int, tokens: int, seed: int = 0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        hd, nh, nkv, hidden = shape["head_dim"], shape["heads"], shape["kv_heads"], shape["hidden"]

        def rnd(*size):
            return (torch.randn(*size, generator=g, device=DEVICE) * 0.02).to(DTYPE)

        self.shape, self.tokens = shape, tokens
        self.layers = [dict(qkv=rnd((nh + 2 * nkv) * hd, hidden), o=rnd(hidden, nh * hd),
                            gate_up=rnd(2 * shape["ffn"], hidden), down=rnd(hidden, shape["ffn"]),
                            norm1=torch.ones(hidden, device=DEVICE, dtype=DTYPE),
                            norm2=torch.ones(hidden, device=DEVICE, dtype=DTYPE))
                       for _ in range(shape["target_layers"])]
        self.lm_head = rnd(shape["vocab"], hidden)
        self.resize(bs)

    def resize(self, bs: int) -> None:
        s = self.shape
        self.kv = [torch.randn(2, bs, s["kv_heads"], CONTEXT + self.tokens, s["head_dim"], device=DEVICE).to(DTYPE)
                   for _ in self.layers]
        self.x = torch.randn(bs, self.tokens, s["hidden"], device=DEVICE).to(DTYPE)

    @torch.no_grad()
    def forward(self) -> torch.Tensor:
        s, x = self.shape, self.x
        bs, t, hidden = x.shape
        hd, nh, nkv = s["head_dim"], s["heads"], s["kv_heads"]
        for w, kv in zip(self.layers, self.kv):
            qkv = F.rms_norm(x, (hidden,), w["norm1"]) @ w["qkv"].T
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            kv[0, :, :, CONTEXT:].copy_(k.view(bs, t, nkv, hd).transpose(1, 2))
            kv[1, :, :, CONTEXT:].copy_(v.view(bs, t, nkv, hd).transpose(1, 2))
            o = F.scaled_dot_product_attention(q.view(bs, t, nh, hd).transpose(1, 2), kv[0], kv[1], enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(bs, t, nh * hd) @ w["o"].T
            gate, up = (F.rms_norm(x, (hidden,), w["norm2"]) @ w["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["down"].T
        return x @ self.lm_head.T

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.layers for t in w.values()) + \
            self.lm_head.numel() * self.lm_head.element_size()


def verify_section(shape_name: str, shape: dict, rounds: dict) -> None:
    target = None
    try:
        target = LeanTarget(shape, BATCHES[0], BLOCK)
        for bs in BATCHES:
            if remaining() < 20:
                DETAILS["notes"].append(f"verify {shape_name} bs={bs} skipped: out of budget")
                break
            target.resize(bs)
            v_ms = bench_ms(target.forward)
            floor_ms = target.weight_bytes() / (RESULTS["copy_bandwidth_gbs"] * GB) * 1e3
            entry = {"shape": shape_name, "bs": bs, "tokens": BLOCK, "context": CONTEXT, "verify_ms": round(v_ms, 4),
                     "weight_bytes_floor_ms": round(floor_ms, 4)}
            if bs in rounds:
                d_ms, a_ms, f_ms = rounds[bs]
                entry.update(dspine_round_ms=round(d_ms, 4), ablation_round_ms=round(a_ms, 4),
                             round_ratio=round(d_ms / a_ms, 4),
                             verify_inclusive_ratio=round((v_ms + d_ms) / (v_ms + a_ms), 4),
                             first_layer_round_ms=round(f_ms, 4), first_layer_round_ratio=round(f_ms / a_ms, 4),
                             first_layer_verify_inclusive_ratio=round((v_ms + f_ms) / (v_ms + a_ms), 4))
            RESULTS["verify"].append(entry)
            log(f"  verify {shape_name:<13} bs={bs:<3} {v_ms:8.4f} ms  {entry}")
            save()
    except Exception as exc:  # noqa: BLE001
        record_error(f"verify {shape_name}", exc)
    del target


# ------------------------------------------------------------------------------------ summary
def _find(rows: list, **keys) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items())), None)


def targets() -> None:
    name = next(iter(shape_table()))
    bs = BATCHES[0]
    t = {}
    five = _find(RESULTS["cases"], name="injection_5layers", shape=name, bs=bs)
    if five:
        t["injection_5layers_ms"] = {"target": "<= 0.15", "value": five["triton_ms"], "met": five["triton_ms"] <= 0.15}
        speed = five["eager_ms"] / five["triton_ms"]
        t["injection_5layers_speedup_vs_eager"] = {"target": ">= 3", "value": round(speed, 3), "met": speed >= 3}
    sel = _find(RESULTS["cases"], name="select_tokens", shape=name, bs=bs)
    path = _find(RESULTS["cases"], name="transition_path", shape=name, bs=bs)
    if sel:
        t["selection_ms"] = {"target": "<= 0.05", "value": sel["triton_ms"], "met": sel["triton_ms"] <= 0.05,
                             "note": "whole select_tokens (top-K of the logits, pair scores, path kernel)"}
        argmax = DETAILS["argmax_ms"].get(f"{name}/bs{bs}")
        if argmax is not None:
            extra = sel["triton_ms"] - argmax
            t["selection_over_argmax_ms"] = {"target": "<= 0.05", "value": round(extra, 5), "met": extra <= 0.05,
                                             "note": "select_tokens minus the ablation's argmax of the same logits"}
    first = _find(RESULTS["cases"], name="injection_5layers_first_layer", shape=name, bs=bs)
    if first and five:
        t["injection_5layers_first_layer_ms"] = {"target": "<= 0.15", "value": first["triton_ms"],
                                                 "met": first["triton_ms"] <= 0.15}
        speed = five["eager_ms"] / first["triton_ms"]
        t["injection_5layers_first_layer_speedup_vs_eager"] = {
            "target": ">= 3", "value": round(speed, 3), "met": speed >= 3,
            "note": "vs the eager per-layer reference (the PyTorch path of the default drafter before first_layer); "
                    f"vs the eager first-layer chain: {first['eager_ms'] / first['triton_ms']:.3f}"}
    if path:
        t["transition_path_kernel_ms"] = {"target": "<= 0.05", "value": path["triton_ms"],
                                          "met": path["triton_ms"] <= 0.05}
    rnd = _find(RESULTS["round"], shape=name, bs=bs)
    if rnd:
        ratio = rnd["dspine_ms"] / rnd["ablation_ms"]
        t["round_ratio"] = {"target": "<= 1.10", "value": round(ratio, 4), "met": ratio <= 1.10}
        if "dspine_first_layer_ms" in rnd:
            ratio = rnd["dspine_first_layer_ms"] / rnd["ablation_ms"]
            t["first_layer_round_ratio"] = {"target": "<= 1.10", "value": round(ratio, 4), "met": ratio <= 1.10}
    ver = _find(RESULTS["verify"], shape=name, bs=bs)
    if ver and "verify_inclusive_ratio" in ver:
        t["verify_inclusive_ratio"] = {"target": "<= 1.03 (goal)", "value": ver["verify_inclusive_ratio"],
                                       "met": ver["verify_inclusive_ratio"] <= 1.03}
    if ver and "first_layer_verify_inclusive_ratio" in ver:
        value = ver["first_layer_verify_inclusive_ratio"]
        t["first_layer_verify_inclusive_ratio"] = {"target": "<= 1.03 (goal)", "value": value, "met": value <= 1.03}
    bw = RESULTS["copy_bandwidth_gbs"]
    if bw:
        shape = shape_table()[name]
        floor = DRAFT_LAYERS * injection_bytes(shape["hidden"], shape["vocab"], bs) / (bw * GB) * 1e3
        t["injection_5layers_bytes_floor_ms"] = {"target": "<= 0.15 possible at all", "value": round(floor, 4),
                                                 "met": floor <= 0.15}
    t["kernels_correct"] = {"target": "all checks pass", "value": all(c.get("ok", False)
                                                                      for c in DETAILS["correctness"]),
                            "met": all(c.get("ok", False) for c in DETAILS["correctness"])}
    RESULTS["targets"] = {"shape": name, "bs": bs, **t}
    save()


def print_table() -> None:
    print("\n=== kernels (ms, median) ===", flush=True)
    print(f"{'case':<28} {'shape':<13} {'bs':>3} {'triton':>9} {'eager':>9} {'compile':>9} {'GB/s':>8} {'x eager':>8}")
    for c in RESULTS["cases"]:
        comp = "-" if c["compile_ms"] is None else f"{c['compile_ms']:.4f}"
        print(f"{c['name']:<28} {c['shape']:<13} {c['bs']:>3} {c['triton_ms']:>9.4f} {c['eager_ms']:>9.4f} "
              f"{comp:>9} {c['gbs']:>8.1f} {c['eager_ms'] / c['triton_ms']:>8.2f}")
    print("=== draft round / verify (ms) ===")
    for r in RESULTS["verify"] or RESULTS["round"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"copy bandwidth {RESULTS['copy_bandwidth_gbs']} GB/s")
    print("targets: " + json.dumps(RESULTS["targets"], indent=1))
    print(f"errors: {len(DETAILS['errors'])}; files in {OUT_DIR}", flush=True)


def plot() -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        DETAILS["notes"].append("matplotlib missing: no plot")
        return
    try:
        fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
        name, bs = next(iter(shape_table())), BATCHES[0]
        cases = [c for c in RESULTS["cases"] if c["shape"] == name and c["bs"] == bs]
        xs = range(len(cases))
        w = 0.27
        ax = axes[0]
        ax.bar([i - w for i in xs], [c["triton_ms"] for c in cases], w, label="Triton (fused)")
        ax.bar(list(xs), [c["eager_ms"] for c in cases], w, label="eager reference")
        ax.bar([i + w for i in xs], [c["compile_ms"] or 0 for c in cases], w, label="torch.compile (0 = n/a)")
        ax.set_xticks(list(xs), [c["name"] for c in cases], rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms (median, CUDA graph replay)")
        ax.set_title(f"kernels, {name}, bs={bs}")
        ax.legend(fontsize=8)
        ax = axes[1]
        rows = RESULTS["round"]
        labels = [f"{r['shape']}\nbs={r['bs']}" for r in rows]
        xs = range(len(rows))
        ax.bar([i - w for i in xs], [r["ablation_ms"] for r in rows], w, label="ablation round")
        ax.bar(list(xs), [r["dspine_ms"] for r in rows], w, label="DSpine round, per-layer candidates")
        ax.bar([i + w for i in xs], [r.get("dspine_first_layer_ms", 0) for r in rows], w,
               label="DSpine round, first-layer candidates")
        for i, r in enumerate(rows):
            ratios = f"x{r['dspine_ms'] / r['ablation_ms']:.2f}"
            if "dspine_first_layer_ms" in r:
                ratios += f"\nx{r['dspine_first_layer_ms'] / r['ablation_ms']:.2f}"
            ax.text(i, max(r["dspine_ms"], r["ablation_ms"]) * 1.02, ratios, ha="center", fontsize=7)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("ms per draft round")
        ax.set_title(f"draft round (5 layers + lm_head + selection), context {CONTEXT}")
        ax.legend(fontsize=8)
        fig.suptitle(f"DSpine kernels on {RESULTS['device']} (copy {RESULTS['copy_bandwidth_gbs']} GB/s)")
        fig.tight_layout()
        fig.savefig(OUT_DIR / "kernels_h200.png", dpi=120)
        plt.close(fig)
    except Exception as exc:  # noqa: BLE001
        record_error("plot", exc)


# --------------------------------------------------------------------------------------- main
def main() -> None:
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU host, or use --cpu-smoke here")
    torch.manual_seed(0)
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    log(f"DSpine kernel bench on {RESULTS['device']}; torch {RESULTS['torch']}, triton {RESULTS['triton']}; "
        f"budget {BUDGET_S:.0f} s; out {OUT_DIR}")
    RESULTS["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 1)
    log(f"copy bandwidth {RESULTS['copy_bandwidth_gbs']} GB/s")
    save()
    rounds, best = {}, {}
    for name, shape in shape_table().items():
        log(f"== injection / selection kernels: {name}")
        for bs in BATCHES:
            if remaining() < 60 and bs != BATCHES[0]:
                DETAILS["notes"].append(f"kernels {name} bs={bs} skipped: out of budget")
                continue
            if bw := RESULTS["copy_bandwidth_gbs"]:
                DETAILS["floors_ms"][f"{name}/bs{bs}/injection_5layers"] = round(
                    DRAFT_LAYERS * injection_bytes(shape["hidden"], shape["vocab"], bs) / (bw * GB) * 1e3, 4)
            size_class = "large" if bs * (BLOCK - 2) > 64 else "small"  # swept once per class, then reused
            try:
                injection_cases(name, shape, bs, best.get(size_class))
                if size_class not in best and f"{name}/bs{bs}" in DETAILS["best_blocks"]:
                    best[size_class] = InjectionBlocks(**DETAILS["best_blocks"][f"{name}/bs{bs}"])
            except Exception as exc:  # noqa: BLE001
                record_error(f"injection {name} bs={bs}", exc)
            try:
                selection_cases(name, shape, bs)
            except Exception as exc:  # noqa: BLE001
                record_error(f"selection {name} bs={bs}", exc)
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
        log(f"== draft round: {name}")
        rounds[name] = round_section(name, shape)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        log(f"== verify: {name}")
        verify_section(name, shape, rounds[name])
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        targets()
    log("== torch.compile baselines")
    run_compiles()
    targets()
    plot()
    save()
    print_table()
    log("done")


if __name__ == "__main__":
    main()
