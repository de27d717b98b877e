"""The kernel benchmark's run: settings from the command line, CUDA-graph timing, the result files.

`Settings` holds what a run measures (shapes, batch sizes, sweep variants: the CPU smoke run's tiny
versions with --cpu-smoke); `Run` holds what it found (`results`, written to kernels_<device>.json, and
`details`, to kernels_<device>_details.json, both rewritten atomically after every measurement so a
timeout still leaves results; <device> is `results.device_slug` of the GPU's name, e.g. h200, or cpu)
and the budget clock.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspine.bench.results import DEFAULT_OUT_DIR, device_slug
from dspine.utils.atomic import write_json_atomic

GB = 1e9
SHAPES = {  # drafter = target shapes; transfer rank 256, injection/selection top-k 8, blocks of 16
    "qwen3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=151936, ffn=12288, target_layers=36),
    "smollm2-135m": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, vocab=49152, ffn=1536, target_layers=30),
}
SMOKE_SHAPES = {
    "tiny-a": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=600, ffn=128, target_layers=4),
    "tiny-b": dict(hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=400, ffn=64, target_layers=3),
}
# Launch-config variants swept on the device: `InjectionBlocks.updated` changes of `blocks_for`'s
# defaults. (Register use on sm_90 from an offline compile with Triton 3.9: the default top-k tile
# takes 154 registers, 3 programs per SM; block_n 128 needs 8 warps not to spill.)
TOPK_VARIANTS = [{}, {"topk": {"warps": 8}}, {"topk": {"block_n": 128, "warps": 8}}, {"topk": {"block_n": 32}},
                 {"programs_per_sm": 6}, {"programs_per_sm": 2}]
TOPK_VARIANTS_LARGE = [{}, {"topk": {"warps": 8}}, {"topk": {"block_n": 32}}]
GATE_VARIANTS = [{}, {"gate": {"block_n": 16, "block_k": 256}}, {"gate": {"block_n": 64, "block_k": 64}},
                 {"gate": {"block_k": 256, "stages": 3}}]
# A later layer of injection_candidates "first_layer" (`inject_on_candidates`): its pass over h (hidden: the
# gate's GEMM plus W_s; hidden_split programs per dot, split-K), then its features-and-gate kernel (mix),
# each swept on top of the best of the one before. (sm_90, offline: the default mix program takes 185
# registers at 8 warps and spills at 4.)
LATER_HIDDEN_VARIANTS = [{}, {"hidden_split": 2}, {"hidden_split": 4, "hidden": {"block_k": 256}},
                         {"hidden": {"block_k": 256, "stages": 3}}, {"hidden": {"block_n": 16, "block_k": 256}},
                         {"hidden_split": 2, "hidden": {"block_n": 64}}]
LATER_HIDDEN_VARIANTS_LARGE = [{}, {"hidden_split": 2}, {"hidden": {"block_k": 256, "stages": 3}}]
LATER_MIX_VARIANTS = [{}, {"mix": {"warps": 4}}, {"mix": {"block_n": 64}}, {"mix": {"block_n": 16}},
                      {"mix_tiles_n": 2}]
LATER_MIX_VARIANTS_LARGE = [{}, {"mix_tiles_n": 8}, {"mix": {"block_n": 32}, "mix_tiles_n": 8}, {"mix_tiles_n": 1}]
# Knob variants of the logits top-k (keyword overrides of `logits_topk`'s defaults: programs_per_sm 4,
# block_v 1024, warps 4, block_m 1, merge "ticket"). programs_per_sm and slices set the slices per row
# (the default is ceil(programs_per_sm * SMs / rows)); merge "kernel" is the two-launch merge.
LOGITS_TOPK_VARIANTS = [{}, {"programs_per_sm": 2}, {"programs_per_sm": 8}, {"programs_per_sm": 16},
                        {"block_v": 2048, "warps": 8}, {"block_v": 512}, {"block_v": 4096, "warps": 8},
                        {"warps": 8}, {"merge": "kernel"}, {"block_m": 2, "block_v": 512}, {"slices": 1}]
SMOKE_VARIANTS = dict(topk=[{}, {"topk": {"block_n": 32}}], topk_large=[{}], gate=[{}],
                      later_hidden=[{}, {"hidden_split": 2, "hidden": {"block_k": 32}}], later_hidden_large=[{}],
                      later_mix=[{}, {"mix_tiles_n": 2}], later_mix_large=[{}],
                      logits_topk=[{}, {"block_v": 128, "slices": 4}, {"block_v": 128, "slices": 4, "merge": "kernel"}])


@dataclass
class Settings:
    """What one run measures. `variants`: the sweep lists by stage (see the module constants)."""

    smoke: bool
    quick: bool
    compile: bool
    device: torch.device
    reps: int
    budget_s: float
    batches: list[int]
    context: int
    rank: int
    top_k: int
    out_dir: Path
    shapes: dict
    variants: dict
    dtype: torch.dtype = torch.bfloat16
    block: int = 16
    draft_layers: int = 5

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        smoke, quick = args.cpu_smoke, args.quick
        variants = dict(topk=TOPK_VARIANTS, topk_large=TOPK_VARIANTS_LARGE, gate=GATE_VARIANTS,
                        later_hidden=LATER_HIDDEN_VARIANTS, later_hidden_large=LATER_HIDDEN_VARIANTS_LARGE,
                        later_mix=LATER_MIX_VARIANTS, later_mix_large=LATER_MIX_VARIANTS_LARGE,
                        logits_topk=LOGITS_TOPK_VARIANTS)
        if smoke:
            variants = SMOKE_VARIANTS
        elif quick:
            keep = dict(topk=4, topk_large=3, gate=2, later_hidden=3, later_mix=2, later_hidden_large=2,
                        later_mix_large=2)
            variants = {name: runs[:keep[name]] if name in keep else runs for name, runs in variants.items()}
            variants["logits_topk"] = LOGITS_TOPK_VARIANTS[:6] + [{"merge": "kernel"}]
        out_dir = args.out_dir or (Path(tempfile.gettempdir()) / "dspine_bench_smoke" if smoke else DEFAULT_OUT_DIR)
        return cls(smoke=smoke, quick=quick, compile=not (args.no_compile or smoke),
                   device=torch.device("cpu" if smoke else "cuda"), reps=args.reps or (2 if smoke else 50),
                   budget_s=args.budget_s or (600.0 if smoke else 150.0 if quick else 270.0),
                   batches=[1, 2] if smoke else [1, 32] if quick else [1, 8, 32], context=32 if smoke else 1024,
                   rank=32 if smoke else 256, top_k=4 if smoke else 8, out_dir=out_dir,
                   shapes=SMOKE_SHAPES if smoke else SHAPES, variants=variants)

    @property
    def sweep_reps(self) -> int:
        return self.reps if self.smoke else max(20, self.reps // 2)

    @property
    def sweep_inner(self) -> int:
        return 1 if self.smoke else 10

    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "missing"
    return triton.__version__


@dataclass
class Run:
    """One benchmark run: its settings, what it measured so far, its start time and its compile queue."""

    cfg: Settings
    command: str
    start: float = field(default_factory=time.time)
    results: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    compiled: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)   # torch.compile baselines, run last, most important first
    stem: str = field(default="", init=False)      # kernels_<device>: the result files' name

    def __post_init__(self) -> None:
        device = (torch.cuda.get_device_name() if self.cfg.device.type == "cuda"
                  else "cpu (Triton interpreter smoke run)")
        provenance = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "torch": torch.__version__, "triton": _triton_version(), "command": self.command}
        self.stem = f"kernels_{device_slug(device)}"
        # RESULTS (<stem>.json): provenance, "copy_bandwidth_gbs",
        #   "cases": [{"name", "shape", "bs", "triton_ms", "eager_ms", "compile_ms" (null: not compiled or
        #              failed), "gbs" (bytes floor of the case / triton_ms)}],
        #   "round": [{"shape", "bs", "dspine_ms", "ablation_ms", "dspine_first_layer_ms"}],
        #   "verify": [{"shape", "bs", "tokens", "context", "verify_ms", "dspine_round_ms", "ablation_round_ms",
        #               "round_ratio", "verify_inclusive_ratio", "first_layer_round_ms", "first_layer_round_ratio",
        #               "first_layer_verify_inclusive_ratio"}],
        #   "targets": {name: {"target", "value", "met"}}
        # dspine_ms is the drafter with injection_candidates "per_layer" (a vocabulary scan in every layer),
        # dspine_first_layer_ms with "first_layer" (one scan; later layers re-weight layer 1's top-k).
        self.results = {**provenance, "copy_bandwidth_gbs": None, "cases": [], "round": [], "verify": [],
                        "targets": {}}
        self.details = {**provenance, "budget_s": self.cfg.budget_s, "reps": self.cfg.reps, "sweep": [],
                        "best_blocks": {}, "correctness": [], "argmax_ms": {}, "compile_s": {},
                        "round_torch_kernels": [], "errors": [], "notes": [], "floors_ms": {}}

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.start:6.1f}s] {msg}", flush=True)

    def remaining(self) -> float:
        return self.cfg.budget_s - (time.time() - self.start)

    def save(self) -> None:
        write_json_atomic(self.cfg.out_dir / f"{self.stem}.json", self.results, indent=1)
        write_json_atomic(self.cfg.out_dir / f"{self.stem}_details.json", self.details, indent=1)

    def record_error(self, where: str, exc: BaseException) -> None:
        self.log(f"ERROR in {where}: {type(exc).__name__}: {exc}")
        self.details["errors"].append({"where": where, "error": f"{type(exc).__name__}: {exc}",
                                       "trace": traceback.format_exc(limit=6)})
        self.save()

    def synchronize(self) -> None:
        if self.cfg.device.type == "cuda":
            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        if self.cfg.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------- timing
    def bench_ms(self, fn, inner: int = 1, reps: int | None = None) -> float:
        """Median milliseconds of one `fn()` call. CUDA: `inner` calls captured in one CUDA graph,
        `reps` replays enqueued back to back, each between two events (launch gaps excluded);
        falls back to timing plain launches when capture fails. CPU: wall clock."""
        reps = reps or self.cfg.reps
        if self.cfg.device.type != "cuda":
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
            self.details["notes"].append(
                f"graph capture failed, timed launches instead: {type(exc).__name__}: {exc}"[:300])
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

    def copy_bandwidth_gbs(self) -> float:
        """Device-to-device copy, bytes read + written, GB/s."""
        n = (1 << 30) if self.cfg.device.type == "cuda" else (1 << 22)
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=self.cfg.device)
        dst = torch.empty_like(src)
        ms = self.bench_ms(lambda: dst.copy_(src), inner=5)
        return 2 * n / (ms * 1e-3) / GB

    # ------------------------------------------------------------------------- torch.compile
    def compiled_fn(self, fn, key: str):
        """torch.compile of a reference (cached per key), or None when it failed."""
        if key not in self.compiled:
            try:
                import torch._dynamo

                torch._dynamo.config.cache_size_limit = 64
                self.compiled[key] = torch.compile(fn, dynamic=False)
            except Exception as exc:  # noqa: BLE001
                self.record_error(f"torch.compile({key})", exc)
                self.compiled[key] = None
        return self.compiled[key]

    def defer_compile(self, case: dict, fn, key: str, make_run, inner: int) -> None:
        """Queue the compiled baseline of `case`: make_run(compiled_fn) -> a runner to time. Compiling
        takes tens of seconds a shape, so it runs last (`run_compiles`) and only while budget is left."""
        if not self.cfg.compile:
            return
        shapes = list(self.cfg.shapes)
        priority = ([1, 32, 8].index(case["bs"]) if case["bs"] in (1, 32, 8) else 9, shapes.index(case["shape"]))
        self.pending.append((priority, len(self.pending), case, fn, key, make_run, inner))

    def run_compiles(self) -> None:
        for _, _, case, fn, key, make_run, inner in sorted(self.pending, key=lambda p: p[:2]):
            tag = f"{case['name']}/{case['shape']}/bs{case['bs']}"
            if self.remaining() < 40:
                self.details["notes"].append(f"compile baseline {tag} skipped: {self.remaining():.0f} s of budget left")
                continue
            cfn = self.compiled_fn(fn, key)
            if cfn is None:
                continue
            try:
                run = make_run(cfn)
                t0 = time.time()
                run()
                self.synchronize()
                self.details["compile_s"][tag] = round(time.time() - t0, 1)
                case["compile_ms"] = round(self.bench_ms(run, inner=inner), 5)
                self.log(f"  compiled {tag:<45} {case['compile_ms']:8.4f} ms (triton {case['triton_ms']:.4f}, "
                         f"compile took {self.details['compile_s'][tag]} s)")
            except Exception as exc:  # noqa: BLE001
                self.compiled[key] = None
                self.record_error(f"compiled {tag}", exc)
            self.save()

    # --------------------------------------------------------------------------------- cases
    def measure(self, name: str, shape: str, bs: int, triton_run, eager_run, inner: int, nbytes: int,
                compile_spec: tuple | None = None) -> dict | None:
        """Time the fused runner and the eager one, record the case (None when either fails) and
        queue its torch.compile baseline: compile_spec = (reference fn, cache key, make_run)."""
        try:
            tri = self.bench_ms(triton_run, inner=inner)
            eag = self.bench_ms(eager_run, inner=inner)
        except Exception as exc:  # noqa: BLE001
            self.record_error(f"{name} {shape} bs={bs}", exc)
            return None
        case = {"name": name, "shape": shape, "bs": bs, "triton_ms": round(tri, 5), "eager_ms": round(eag, 5),
                "compile_ms": None, "gbs": round(nbytes / (tri * 1e-3) / GB, 1)}
        self.results["cases"].append(case)
        self.log(f"  {name:<28} {shape:<13} bs={bs:<3} triton {tri:8.4f} ms  eager {eag:8.4f}  "
                 f"compile    n/a  {case['gbs']:7.1f} GB/s  x{eag / tri:5.2f} vs eager")
        self.save()
        if compile_spec is not None:
            self.defer_compile(case, *compile_spec, inner)
        return case

    def sweep_variants(self, stage: str, shape: str, bs: int, variants: list[dict], run) -> tuple[dict | None, float]:
        """Time each change of `variants` with `run(change) -> (ms, ok, fields, note)` (the first, {},
        always; the others while budget is left), record it in details["sweep"] (with `fields`) and
        log it. Returns the fastest change with `ok` and its ms; (None, inf) when none was ok."""
        best, best_ms = None, float("inf")
        for over in variants:
            if self.remaining() < 90 and over:
                break
            try:
                ms, ok, fields, note = run(over)
            except Exception as exc:  # noqa: BLE001
                self.record_error(f"sweep {stage} {shape} bs={bs} {over}", exc)
                continue
            self.details["sweep"].append({"stage": stage, "shape": shape, "bs": bs, "override": over, "ms": ms,
                                          **fields})
            self.log(f"  sweep {stage} {str(over):<42} {ms:8.4f} ms  {note}")
            if ok and ms < best_ms:
                best, best_ms = over, ms
        return best, best_ms


def cycle(fn, items: list):
    """A runner calling fn(item) with the next item on each call (rotating weight sets, so
    repeated timing does not serve one layer's weights from L2)."""
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(items)
        return fn(items[state["i"]])
    return run
