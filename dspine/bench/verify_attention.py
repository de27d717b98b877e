"""Block-verify attention: DSpine's split-KV kernel against SGLang's triton prefill kernel.

For every (shape, batch size, context length, causal or not) it builds one verify problem (a paged
KV pool with each request's prefix at shuffled slots, a 16-token block per request, bf16), checks
DSpine's `verify_attention` against SGLang's `extend_attention_fwd` (the kernel a DSPINE server runs
otherwise) and times both: each captured 20 times in one CUDA graph, the median of `--reps` replays.
Shapes: the attention layers of SmolLM2-135M (9 / 3 heads, dim 64), Qwen3-8B (32 / 8, dim 128) and
Qwen3.8-27B's full-attention layers (24 / 4, dim 256). Causal = the target's verify; not causal =
the drafter's block (its context is the drafter's window, so contexts above 8,192 are skipped).

GPU host:  python scripts/bench_verify_attention.py --out-dir OUT
CPU check: TRITON_INTERPRET=1 python scripts/bench_verify_attention.py --cpu-smoke (tiny shapes,
           the interpreter, DSpine's kernel against its PyTorch reference, no timing)

Writes verify_attention_h200.json ({"device", "date", "command", "versions", "runs": [{"shape",
"bs", "context", "causal", "dspine_us", "sglang_us", "speedup", "max_abs_diff"}]}) and a plot.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
from pathlib import Path

import torch

from dspine.bench.results import DEFAULT_OUT_DIR, command_line, write_results
from dspine.kernels.verify_attention import verify_attention, verify_attention_reference
from dspine.utils.plot import pyplot, save_figure

BLOCK = 16
SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128), "qwen3.8-27b": (24, 4, 256)}
SMOKE_SHAPES = {"tiny": (4, 2, 16)}
GRAPH_CALLS = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Example: python scripts/bench_verify_attention.py --out-dir /tmp/out",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the JSON/PNG go (default benchmarks/results; a temp dir with --cpu-smoke)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--contexts", default="512,2048,8192,32768", help="prefix lengths (default 512,2048,8192,32768)")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays per case (median; default 30)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU through the Triton interpreter (needs TRITON_INTERPRET=1), no timing")
    return p.parse_args(argv)


def problem(bs: int, context: int, hq: int, hkv: int, d: int, device, dtype, seed: int = 0):
    """(q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices) of one verify: every request
    with `context` prefix tokens at shuffled pool slots."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = bs * context
    pool = total + 64
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    k_buffer, v_buffer = make(pool, hkv, d), make(pool, hkv, d)
    kv_indices = torch.randperm(pool, generator=g)[:total].to(device)
    kv_indptr = (torch.arange(bs + 1, dtype=torch.int32) * context).to(device)
    qo_indptr = torch.arange(0, bs * BLOCK + 1, BLOCK, dtype=torch.int32, device=device)
    q, k, v = make(bs * BLOCK, hq, d), make(bs * BLOCK, hkv, d), make(bs * BLOCK, hkv, d)
    return q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices


def sglang_prefill_kernel():
    """SGLang's `extend_attention_fwd`, or None where SGLang is not installed."""
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except ImportError:
        return None
    return extend_attention_fwd


def graph_us(fn, reps: int) -> float:
    """Median microseconds of one `fn()`: GRAPH_CALLS calls captured in one CUDA graph, replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / GRAPH_CALLS)
    return statistics.median(times)


def measure_case(shape: tuple[int, int, int], bs: int, context: int, causal: bool, *, smoke: bool, reps: int,
                 prefill) -> dict:
    hq, hkv, d = shape
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices = problem(bs, context, hq, hkv, d, device, dtype)
    scale = d ** -0.5
    ours = torch.empty_like(q)

    def run_ours():
        verify_attention(q, k, v, ours, k_buffer, v_buffer, kv_indptr, kv_indices, block=BLOCK, causal=causal,
                         scale=scale)

    run_ours()
    row = {"bs": bs, "context": context, "causal": causal, "dspine_us": None, "sglang_us": None, "speedup": None}
    if prefill is None:
        want = verify_attention_reference(q, k, v, k_buffer, v_buffer, kv_indptr, kv_indices, block=BLOCK,
                                          causal=causal, scale=scale)
    else:
        want = torch.empty_like(q)

        def run_sglang():
            prefill(q, k, v, want, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, None, causal, None, BLOCK,
                    1.0, 1.0, scale)

        run_sglang()
    row["max_abs_diff"] = float((ours.float() - want.float()).abs().max())
    if not smoke:
        row["dspine_us"] = round(graph_us(run_ours, reps), 2)
        if prefill is not None:
            row["sglang_us"] = round(graph_us(run_sglang, reps), 2)
            row["speedup"] = round(row["sglang_us"] / row["dspine_us"], 3)
    return row


def plot(results: dict, path: Path) -> Path | None:
    plt = pyplot(f"python scripts/bench_verify_attention.py --out-dir {path.parent} (reruns the measurement)")
    runs = [r for r in results["runs"] if r.get("speedup")]
    if plt is None or not runs:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in runs))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for causal, style in ((True, "-"), (False, "--")):
            for bs in sorted({r["bs"] for r in runs}):
                cells = sorted((r["context"], r["speedup"]) for r in runs
                               if r["shape"] == shape and r["bs"] == bs and r["causal"] == causal)
                if cells:
                    ax.plot(*zip(*cells), style, marker="o",
                            label=f"bs {bs}, {'verify (causal)' if causal else 'draft (bidirectional)'}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prefix tokens per request")
        ax.set_ylabel("SGLang prefill kernel time / DSpine kernel time")
        ax.set_title(shape, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"16-token block attention on {results['device']}")
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_verify_attention: no CUDA device here. Run it on the GPU host, or check the "
                         "script on CPU with TRITON_INTERPRET=1 and --cpu-smoke.")
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) / "dspine_verify_attention_smoke" if smoke
                               else DEFAULT_OUT_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefill = None if smoke else sglang_prefill_kernel()
    versions = {"torch": torch.__version__}
    for name in ("triton", "sglang"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    results = {"device": "CPU (Triton interpreter)" if smoke else torch.cuda.get_device_name(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": command_line(argv), "versions": versions,
               "baseline": "sglang.kernels.ops.attention.extend_attention.extend_attention_fwd" if prefill
               else "dspine.kernels.verify_attention.verify_attention_reference (no timing)", "runs": []}
    shapes = SMOKE_SHAPES if smoke else SHAPES
    batches = [1, 2] if smoke else [int(x) for x in args.batches.split(",")]
    contexts = [0, 40] if smoke else [int(x) for x in args.contexts.split(",")]
    stem = "verify_attention_smoke" if smoke else "verify_attention_h200"
    print(f"{'shape':14s} {'bs':>3s} {'context':>7s} {'mask':>6s} {'dspine us':>10s} {'sglang us':>10s} "
          f"{'speedup':>8s} {'max |diff|':>10s}")
    for name, shape in shapes.items():
        for bs in batches:
            for context in contexts:
                for causal in (True, False):
                    if not causal and context > 8192:
                        continue
                    row = {"shape": name, **measure_case(shape, bs, context, causal, smoke=smoke, reps=args.reps,
                                                         prefill=prefill)}
                    results["runs"].append(row)
                    fmt = lambda x, spec: "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)  # noqa: E731
                    print(f"{name:14s} {bs:3d} {context:7d} {'causal' if causal else 'bidir':>6s} "
                          f"{fmt(row['dspine_us'], '10.1f')} {fmt(row['sglang_us'], '10.1f')} "
                          f"{fmt(row['speedup'], '8.2f')} {row['max_abs_diff']:10.2e}", flush=True)
                    write_results(results, out_dir, stem)
    picture = plot(results, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / (stem + '.json')}" + (f" and {picture}" if picture else ""))
    return 0
