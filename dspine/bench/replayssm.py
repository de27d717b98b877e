"""ReplaySSM vs per-token state snapshots at 27B-like Gated-DeltaNet shapes.

Measures, per request, the verify scratch memory of both schemes (analytic and allocated), the
commit time of both (ReplaySSM: replay the accepted records into the checkpoint, one kernel over
all layers; snapshots: gather the selected per-token state back into the live state), the extra
verify traffic snapshots pay (writing T states per layer) against ReplaySSM's output-only verify
kernel, and the kernels' error against the PyTorch references at full shapes.

On a GPU:  python scripts/bench_replayssm.py    -> benchmarks/results/replayssm_h200.json (`--out` elsewhere)
CPU check: TRITON_INTERPRET=1 python scripts/bench_replayssm.py --cpu-smoke   (tiny shapes, no JSON)
Exit status 1 when a kernel departs from its reference by more than 1e-4.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from dspine import env
from dspine.bench.results import DEFAULT_OUT_DIR, command_line
from dspine.engine.replay_ssm import ReplaySSMState, verify_scratch_bytes
from dspine.kernels.gated_delta_replay import (
    gated_delta_replay,
    gated_delta_replay_reference,
    gated_delta_verify_outputs,
    gated_delta_verify_outputs_reference,
)
from dspine.utils.atomic import write_json_atomic

MiB = 2**20
RESULTS_FILE = "replayssm_h200.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter); no JSON")
    p.add_argument("--layers", type=int, default=48, help="GDN layers")
    p.add_argument("--tokens", type=int, default=16, help="verified tokens per round (T)")
    p.add_argument("--k-heads", type=int, default=16)
    p.add_argument("--v-heads", type=int, default=16, help="HV")
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--conv-kernel", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--reps", type=int, default=100, help="timed repetitions (median reported)")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak for the %%-of-peak column (H200)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default: {DEFAULT_OUT_DIR / RESULTS_FILE}"
                   " on CUDA, none with --cpu-smoke)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.layers, args.tokens, args.k_heads, args.v_heads, args.head_dim = 2, 4, 2, 2, 16
        args.batch_sizes, args.reps = [1, 2], 3
    elif args.out is None:
        args.out = DEFAULT_OUT_DIR / RESULTS_FILE
    return args


def bench(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of `fn` over `reps` runs (CUDA events, L2 flushed before each run)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    flush = torch.empty(256 * MiB, dtype=torch.int8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def records(rows: int, T: int, HV: int, K: int, V: int, device: torch.device, seed: int = 0):
    """Checkpoint state [rows, HV, K, V] fp32 and bf16 k (unit-norm), v; fp32 g <= 0, beta."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = torch.randn(rows, HV, K, V, generator=gen, device=device)
    k = torch.nn.functional.normalize(torch.randn(rows, T, HV, K, generator=gen, device=device), dim=-1)
    v = torch.randn(rows, T, HV, V, generator=gen, device=device)
    g = -torch.rand(rows, T, HV, generator=gen, device=device)
    beta = torch.rand(rows, T, HV, generator=gen, device=device)
    return state, k.bfloat16(), v.bfloat16(), g, beta


def allocated_bytes(make, device: torch.device) -> int:
    """Bytes that `make()` allocates (CUDA allocator delta; storage sizes on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        keep = make()
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated(device) - before
        del keep
        return used
    return sum(t.untyped_storage().nbytes() for t in make())


def memory(a: argparse.Namespace, conv_dim: int, device: torch.device) -> dict:
    L, T, HV, D, W = a.layers, a.tokens, a.v_heads, a.head_dim, a.conv_kernel
    analytic = verify_scratch_bytes(num_layers=L, num_tokens=T, num_v_heads=HV, head_k_dim=D, head_v_dim=D,
                                    conv_dim=conv_dim, conv_kernel=W, state_bytes=4, record_bytes=2, conv_bytes=2)
    snapshot = allocated_bytes(lambda: [
        torch.empty(L, T, HV, D, D, device=device),  # a state per layer and token
        torch.empty(L, T, conv_dim, W - 1, dtype=torch.bfloat16, device=device),  # a conv window per layer and token
    ], device)
    ssm = ReplaySSMState(L, 1, HV, D, D, conv_dim, W, device=device, act_dtype=torch.bfloat16)

    def begin():  # the checkpoint exists in both schemes: only the round's records are scratch
        ssm.begin(T)
        return [ssm.record.k, ssm.record.v, ssm.record.g, ssm.record.beta, ssm.record.conv_in]

    replay = allocated_bytes(begin, device)
    return {
        "analytic": {"snapshot_bytes": analytic.snapshot, "replayssm_bytes": analytic.replayssm,
                     "snapshot_state_bytes": analytic.snapshot_state, "snapshot_conv_bytes": analytic.snapshot_conv,
                     "replay_record_bytes": analytic.replay_records, "replay_conv_bytes": analytic.replay_conv,
                     "ratio": analytic.ratio},
        "allocated": {"snapshot_bytes": snapshot, "replayssm_bytes": replay, "ratio": snapshot / replay},
    }


def timing(a: argparse.Namespace, bs: int, device: torch.device) -> dict:
    L, T, HV, D = a.layers, a.tokens, a.v_heads, a.head_dim
    rows = L * bs
    state, k, v, g, beta = records(rows, T, HV, D, D, device)
    out = torch.empty_like(state)
    gen = torch.Generator(device="cpu").manual_seed(bs)
    accept = torch.randint(1, T + 1, (bs,), generator=gen).to(device).repeat(L)  # [L * bs], layer-major rows
    full = torch.full((rows,), T, device=device)
    state_bytes = state.numel() * 4
    records_read = int(accept.sum()) * HV * (2 * D * 2 + 2 * 4)  # accepted k, v (bf16), g, beta (fp32)

    replay_rand = bench(lambda: gated_delta_replay(state, k, v, g, beta, accept, out=out), a.reps, device)
    replay_full = bench(lambda: gated_delta_replay(state, k, v, g, beta, full, out=out), a.reps, device)
    verify = torch.empty(rows, T, HV, D, device=device)  # ReplaySSM's verify recurrence: outputs only
    verify_ms = bench(lambda: gated_delta_verify_outputs(state, k, k, v, g, beta, out=verify), a.reps, device)
    del verify
    snaps = torch.empty(rows * T, HV * D * D, device=device)  # per-token snapshots of every layer/request
    index = torch.arange(rows, device=device) * T + accept - 1
    gather_ms = bench(lambda: torch.index_select(snaps, 0, index, out=out.view(rows, -1)), a.reps, device)
    write = state.view(rows, 1, -1).expand(rows, T, -1)  # what snapshots add to verify: T states written
    write_ms = bench(lambda: snaps.view(rows, T, -1).copy_(write), a.reps, device)
    del snaps, write
    gbps = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
    r = {
        "batch_size": bs,
        "replay_ms_random_accept": replay_rand,
        "replay_ms_full_accept": replay_full,
        "snapshot_gather_ms": gather_ms,
        "replay_gbps_random_accept": gbps(2 * state_bytes + records_read, replay_rand),
        "snapshot_gather_gbps": gbps(2 * state_bytes, gather_ms),
        "verify_outputs_ms": verify_ms,
        "snapshot_write_ms": write_ms,
        "snapshot_write_gbps": gbps(T * state_bytes, write_ms),
        "mean_accept": float(accept.float().mean()),
    }
    r["replay_pct_peak"] = 100 * r["replay_gbps_random_accept"] / a.peak_gbps
    return r


def correctness(a: argparse.Namespace, device: torch.device) -> dict:
    bs = min(8, max(a.batch_sizes))
    L, T, HV, D = a.layers, a.tokens, a.v_heads, a.head_dim
    state, k, v, g, beta = records(L * bs, T, HV, D, D, device, seed=1)
    accept = torch.randint(0, T + 1, (L * bs,), generator=torch.Generator().manual_seed(2)).to(device)
    accept[0], accept[-1] = 0, T
    out = torch.full_like(state, float("nan"))
    gated_delta_replay(state, k, v, g, beta, accept, out=out)
    replay_err = (out - gated_delta_replay_reference(state, k, v, g, beta, accept)).abs().max().item()
    q = (k.float() * D**-0.5).contiguous()
    o = torch.full((L * bs, T, HV, D), float("nan"), device=device)
    gated_delta_verify_outputs(state, q, k, v, g, beta, out=o)
    verify_err = (o - gated_delta_verify_outputs_reference(state, q, k, v, g, beta)).abs().max().item()
    return {"batch_size": bs, "replay_max_abs_err": replay_err, "verify_max_abs_err": verify_err,
            "ok": replay_err <= 1e-4 and verify_err <= 1e-4}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.cpu_smoke and not env.TRITON_INTERPRET.get():
        print("--cpu-smoke runs the Triton kernels in the interpreter, which is chosen before they load: "
              "TRITON_INTERPRET=1 python scripts/bench_replayssm.py --cpu-smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    if a.cpu_smoke:
        torch.set_num_threads(1)
    conv_dim = 2 * a.k_heads * a.head_dim + a.v_heads * a.head_dim
    shape = {"gdn_layers": a.layers, "tokens": a.tokens, "k_heads": a.k_heads, "v_heads": a.v_heads,
             "head_k_dim": a.head_dim, "head_v_dim": a.head_dim, "conv_dim": conv_dim, "conv_kernel": a.conv_kernel,
             "state_dtype": "float32", "record_dtype": "bfloat16"}
    mem = memory(a, conv_dim, device)
    times = [timing(a, bs, device) for bs in a.batch_sizes]
    check = correctness(a, device)

    print(f"shape: {shape}")
    for kind in ("analytic", "allocated"):
        m = mem[kind]
        print(f"verify scratch / request ({kind}): snapshots {m['snapshot_bytes'] / MiB:.3f} MiB, "
              f"ReplaySSM {m['replayssm_bytes'] / MiB:.3f} MiB, {m['ratio']:.1f}x smaller")
    print(f"{'bs':>4} {'replay ms':>10} {'(full T)':>9} {'GB/s':>7} {'%peak':>6} {'snap gather ms':>15} "
          f"{'GB/s':>7} {'verify ms':>10} {'snap write ms':>14}")
    for r in times:
        print(f"{r['batch_size']:>4} {r['replay_ms_random_accept']:>10.4f} {r['replay_ms_full_accept']:>9.4f} "
              f"{r['replay_gbps_random_accept']:>7.0f} {r['replay_pct_peak']:>6.1f} {r['snapshot_gather_ms']:>15.4f} "
              f"{r['snapshot_gather_gbps']:>7.0f} {r['verify_outputs_ms']:>10.4f} {r['snapshot_write_ms']:>14.4f}")
    print(f"correctness (bs {check['batch_size']}): replay max abs err {check['replay_max_abs_err']:.2e}, "
          f"verify {check['verify_max_abs_err']:.2e} -> {'ok' if check['ok'] else 'FAIL'}")

    if a.out is not None:
        result = {
            "command": command_line(argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "shape": shape,
            "reps": a.reps,
            "peak_gbps": a.peak_gbps,
            "memory_per_request": mem,
            "commit_and_verify_time": times,
            "correctness": check,
            "sglang_e2e": None,
        }
        write_json_atomic(a.out, result)
        print(f"wrote {a.out}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
