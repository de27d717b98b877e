"""Kernel benchmark, the summary: the goals met or not (results["targets"]), the table printed at
the end, and the plot (kernels_<device>.png)."""

from __future__ import annotations

import json

from dspine.bench.kernels_harness import GB, Run
from dspine.bench.kernels_injection import injection_bytes
from dspine.utils.plot import pyplot, save_figure


def _find(rows: list, **keys) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items())), None)


def targets(run: Run) -> None:
    """The goals of the kernels at the first shape and batch size (results["targets"])."""
    results, details = run.results, run.details
    name = next(iter(run.cfg.shapes))
    bs = run.cfg.batches[0]
    t = {}
    five = _find(results["cases"], name="injection_5layers", shape=name, bs=bs)
    if five:
        t["injection_5layers_ms"] = {"target": "<= 0.15", "value": five["triton_ms"], "met": five["triton_ms"] <= 0.15}
        speed = five["eager_ms"] / five["triton_ms"]
        t["injection_5layers_speedup_vs_eager"] = {"target": ">= 3", "value": round(speed, 3), "met": speed >= 3}
    sel = _find(results["cases"], name="select_tokens", shape=name, bs=bs)
    path = _find(results["cases"], name="transition_path", shape=name, bs=bs)
    if sel:
        t["selection_ms"] = {"target": "<= 0.05", "value": sel["triton_ms"], "met": sel["triton_ms"] <= 0.05,
                             "note": "whole select_tokens (top-K of the logits, pair scores, path kernel)"}
        argmax = details["argmax_ms"].get(f"{name}/bs{bs}")
        if argmax is not None:
            extra = sel["triton_ms"] - argmax
            t["selection_over_argmax_ms"] = {"target": "<= 0.05", "value": round(extra, 5), "met": extra <= 0.05,
                                             "note": "select_tokens minus the ablation's argmax of the same logits"}
    first = _find(results["cases"], name="injection_5layers_first_layer", shape=name, bs=bs)
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
    rnd = _find(results["round"], shape=name, bs=bs)
    if rnd:
        ratio = rnd["dspine_ms"] / rnd["ablation_ms"]
        t["round_ratio"] = {"target": "<= 1.10", "value": round(ratio, 4), "met": ratio <= 1.10}
        if "dspine_first_layer_ms" in rnd:
            ratio = rnd["dspine_first_layer_ms"] / rnd["ablation_ms"]
            t["first_layer_round_ratio"] = {"target": "<= 1.10", "value": round(ratio, 4), "met": ratio <= 1.10}
    ver = _find(results["verify"], shape=name, bs=bs)
    if ver and "verify_inclusive_ratio" in ver:
        t["verify_inclusive_ratio"] = {"target": "<= 1.03 (goal)", "value": ver["verify_inclusive_ratio"],
                                       "met": ver["verify_inclusive_ratio"] <= 1.03}
    if ver and "first_layer_verify_inclusive_ratio" in ver:
        value = ver["first_layer_verify_inclusive_ratio"]
        t["first_layer_verify_inclusive_ratio"] = {"target": "<= 1.03 (goal)", "value": value, "met": value <= 1.03}
    bw = results["copy_bandwidth_gbs"]
    if bw:
        shape = run.cfg.shapes[name]
        floor = run.cfg.draft_layers * injection_bytes(run.cfg, shape["hidden"], shape["vocab"], bs) / (bw * GB) * 1e3
        t["injection_5layers_bytes_floor_ms"] = {"target": "<= 0.15 possible at all", "value": round(floor, 4),
                                                 "met": floor <= 0.15}
    t["kernels_correct"] = {"target": "all checks pass", "value": all(c.get("ok", False)
                                                                      for c in details["correctness"]),
                            "met": all(c.get("ok", False) for c in details["correctness"])}
    results["targets"] = {"shape": name, "bs": bs, **t}
    run.save()


def print_table(run: Run) -> None:
    results = run.results
    print("\n=== kernels (ms, median) ===", flush=True)
    print(f"{'case':<28} {'shape':<13} {'bs':>3} {'triton':>9} {'eager':>9} {'compile':>9} {'GB/s':>8} {'x eager':>8}")
    for c in results["cases"]:
        comp = "-" if c["compile_ms"] is None else f"{c['compile_ms']:.4f}"
        print(f"{c['name']:<28} {c['shape']:<13} {c['bs']:>3} {c['triton_ms']:>9.4f} {c['eager_ms']:>9.4f} "
              f"{comp:>9} {c['gbs']:>8.1f} {c['eager_ms'] / c['triton_ms']:>8.2f}")
    print("=== draft round / verify (ms) ===")
    for r in results["verify"] or results["round"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"copy bandwidth {results['copy_bandwidth_gbs']} GB/s")
    print("targets: " + json.dumps(results["targets"], indent=1))
    print(f"errors: {len(run.details['errors'])}; files in {run.cfg.out_dir}", flush=True)


def plot(run: Run) -> None:
    results = run.results
    plt = pyplot()
    if plt is None:
        run.details["notes"].append("matplotlib missing: no plot")
        return
    try:
        fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
        name, bs = next(iter(run.cfg.shapes)), run.cfg.batches[0]
        cases = [c for c in results["cases"] if c["shape"] == name and c["bs"] == bs]
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
        rows = results["round"]
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
        ax.set_title(f"draft round (5 layers + lm_head + selection), context {run.cfg.context}")
        ax.legend(fontsize=8)
        fig.suptitle(f"DSpine kernels on {results['device']} (copy {results['copy_bandwidth_gbs']} GB/s)")
        save_figure(fig, run.cfg.out_dir / f"{run.stem}.png", dpi=120)
    except Exception as exc:  # noqa: BLE001
        run.record_error("plot", exc)
