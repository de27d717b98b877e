"""`real_shapes_h200.json`: the published presets served at their shapes, from one host's run.

The run (see `benchmarks/results/README.md`) leaves, per preset, the server's log and a soak file
(`scripts/soak.py`), plus one round-cost file (`scripts/bench_round_cost.py --results-name
real_shapes_rounds`, greedy then `--temperature 1`) holding DSPINE's rounds and AR's steps of each
shape. This report joins them:

  python scripts/report_real_shapes.py --rounds DIR/real_shapes_rounds.json \\
      --preset qwen3.8-27b=DIR/soak_P27.json,DIR/P27.log --preset qwen3-8b=DIR/soak_P8.json,DIR/P8.log \\
      --hybrid-switch DIR/hybrid_switch/dynamic_h200.json   # or --dynamic-switch-hybrid "the reason it cannot run"

- `presets[i].rounds`: per (concurrency, temperature) DSPINE's ms per round (`ms_per_round`, its
  step profile: one scheduler step is one round) and AR's ms per step of the same target
  (`ms_per_step`); a DSPINE row without its AR row is an error that names the missing run; a run
  (config, temperature) one of whose levels measured a mean batch far from its concurrency is left
  out, both configs at that temperature, and listed under `rounds_left_out` with the reason;
- `presets[i]`: the soak's minutes, requests, errors, tail and health, the memory SGLang logged at
  start-up (weights, KV, mamba state, ReplaySSM ring; GB) and how many preset flags the worker
  logged in effect;
- `replayssm_scratch`: the DSPINE worker's start-up line of the hybrid preset (ReplaySSM's verify
  scratch per request as allocated, against per-token snapshots at the pool's shapes);
- a preset the file already holds from an earlier run and this run did not serve is kept, and a
  rounds-only rerun of a preset (`--preset NAME=-,LOG`, the script's `DSPINE_REAL_SOAK_MINUTES=0`)
  keeps its earlier soak (`keep_earlier`), so the presets may be measured in different sessions;
- `dynamic_switch_hybrid`: true when `--hybrid-switch` (`scripts/bench_dynamic.py` on a hybrid
  target: AR, DSPINE-plain and DSPINE-dynamic servers, DSPINE-static as the control; one file or
  several runs of the same pair, `merge_switch_runs`) shows the switch served it exactly, its rounds'
  departures from AR near-ties or ones the never-switching DSPINE-static server makes too
  (`switch_verdict`), else what the runs show went wrong; `--dynamic-switch-hybrid REASON` instead
  when no such server could run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from dspine.bench.results import DEFAULT_OUT_DIR, BenchError, check_schema, command_line, write_results
from dspine.bench.round_cost import check_phase_batch
from dspine.utils.plot import pyplot, save_figure

RESULTS_NAME = "real_shapes_h200"
ROUND_SCHEMA = {"concurrency": int, "temperature": float, "ms_per_step": float, "ms_per_round": float}
RESULTS_SCHEMA = {"device": str, "date": str, "command": str, "sglang": str,
                  "presets": [{"preset": str, "served_minutes": float, "requests": int, "errors": int,
                               "rounds": [ROUND_SCHEMA]}],
                  "replayssm_scratch": {"snapshot_bytes": int, "replayssm_bytes": int}}
SCRATCH_LINE = re.compile(r"DSPINE ReplaySSM verify scratch per request: (\d+) bytes .*? against (\d+) bytes "
                          r"of per-token snapshots")
MEMORY_LINES = {   # SGLang 0.5.17's start-up lines -> the `memory_gb` key their sizes go to
    re.compile(r"Load weight end\..*type=(\w+),.*mem usage=([\d.]+) GB"): "weights",
    re.compile(r"KV Cache is allocated\..*K size: ([\d.]+) GB, V size: ([\d.]+) GB"): "kv",
    re.compile(r"Mamba Cache is allocated\..*conv_state size: ([\d.]+)GB, ssm_state size: ([\d.]+)GB"): "mamba_state",
    re.compile(r"GDN ReplaySSM ring buffers allocated .*?: (.*)$"): "replayssm_ring",
}
SERVE_FLAG_LINE = "DSPINE serve flag "


def memory_gb(log: str) -> dict:
    """GB per part from a server log: weights per model class, KV pools summed (target and draft),
    the mamba conv + SSM states, the ReplaySSM ring tensors summed."""
    out: dict = {}
    for line in log.splitlines():
        for pattern, key in MEMORY_LINES.items():
            match = pattern.search(line)
            if match is None:
                continue
            if key == "weights":
                out.setdefault("weights", {})[match.group(1)] = float(match.group(2))
            elif key == "replayssm_ring":
                out[key] = round(sum(float(x) for x in re.findall(r"=([\d.]+)GB", match.group(1))), 3)
            else:
                out[key] = round(out.get(key, 0.0) + sum(float(x) for x in match.groups()), 3)
    return out


def scratch_bytes(log: str) -> dict | None:
    """The worker's ReplaySSM scratch line, as {"replayssm_bytes", "snapshot_bytes", "ratio"}."""
    match = SCRATCH_LINE.search(log)
    if match is None:
        return None
    replay, snapshot = int(match.group(1)), int(match.group(2))
    return {"replayssm_bytes": replay, "snapshot_bytes": snapshot, "ratio": round(snapshot / replay, 2)}


def misaligned_runs(runs: list[dict], shape: str) -> dict[tuple[str, float], str]:
    """(config, temperature) of `shape` whose step-profile phases other steps filled: one of that
    run's levels has a mean batch far from its concurrency (`round_cost.check_phase_batch`). Its
    phases are consecutive, so once one is off every row of the run is suspect -> the reason."""
    bad: dict[tuple[str, float], str] = {}
    for r in runs:
        if r["shape"] != shape or "mean_batch_size" not in r:
            continue
        try:
            check_phase_batch(r["config"], 0, r["concurrency"], float(r["mean_batch_size"]))
        except BenchError:
            key = (r["config"], float(r.get("temperature", 0.0)))
            bad[key] = bad.get(key, "") + f"c={r['concurrency']} measured a mean batch of {r['mean_batch_size']:g}; "
    return {key: reason + "the run's step-profile phases held other decode steps" for key, reason in bad.items()}


def preset_rounds(runs: list[dict], shape: str, left_out: list[dict] | None = None) -> list[dict]:
    """DSPINE's rounds of `shape` with AR's step at the same concurrency and temperature. Runs whose
    phases other steps filled (`misaligned_runs`) are left out of both sides and, when `left_out` is
    given, appended to it with the reason."""
    misaligned = misaligned_runs(runs, shape)
    for (config, temperature), reason in sorted(misaligned.items()):
        if left_out is not None:
            left_out.append({"shape": shape, "config": config, "temperature": temperature, "reason": reason})
    lost = {temperature for _, temperature in misaligned}      # gone from both configs
    runs = [r for r in runs if float(r.get("temperature", 0.0)) not in lost]
    key = lambda r: (r["concurrency"], float(r.get("temperature", 0.0)))  # noqa: E731
    ar = {key(r): r for r in runs if r["shape"] == shape and r["config"] == "AR" and "ms_per_step" in r}
    rows = []
    for r in sorted((r for r in runs if r["shape"] == shape and r["config"] == "DSPINE" and "ms_per_step" in r),
                    key=key):
        step = ar.get(key(r))
        if step is None:
            raise BenchError(f"{shape}: DSPINE at c={r['concurrency']}, T={key(r)[1]:g} has no AR step beside it. "
                             "Fix: run scripts/bench_round_cost.py for that shape with --url AR=... too")
        rows.append({"concurrency": r["concurrency"], "temperature": key(r)[1], "ms_per_step": step["ms_per_step"],
                     "ms_per_round": r["ms_per_step"], "round_over_step": round(r["ms_per_step"] / step["ms_per_step"], 3),
                     "accept_len": r["accept_len"]})
    if not rows:
        raise BenchError(f"{shape}: no DSPINE rounds in the rounds file. Fix: run scripts/bench_round_cost.py "
                         f"--shape {shape} --url DSPINE=... --profile-dir DSPINE=...")
    return rows


def merge_switch_runs(runs: list[dict]) -> dict:
    """One `bench_dynamic` results object from several runs on the same hybrid target and drafter
    (e.g. AR with DSPINE-plain on one host, AR with DSPINE-dynamic and AR with DSPINE-static on
    another: every run carries its own AR pass, so each parity block is against AR of its run).
    A config's parity block and levels come from the last run that served it (AR's levels from the
    first run); errors add up; `sources` keeps each run's command, device and date. Runs of other
    targets or drafters are refused."""
    pairs = {(run.get("target"), run.get("drafter")) for run in runs}
    if len(pairs) != 1:
        raise BenchError(f"--hybrid-switch files name different targets or drafters {sorted(map(str, pairs))}. "
                         "Fix: pass runs of one hybrid pair (dspine.bench.hybrid_pair with one seed)")
    merged = {"target": runs[0].get("target"), "drafter": runs[0].get("drafter"), "parity_c1": {}, "levels": [],
              "errors": [], "switch": None, "command": " ; ".join(str(run.get("command")) for run in runs),
              "sources": [{key: run.get(key) for key in ("command", "device", "date")} for run in runs]}
    for i, run in enumerate(runs):
        served = {level["algorithm"] for level in run.get("levels", []) if level["algorithm"] != "AR" or i == 0}
        merged["levels"] = [level for level in merged["levels"] if level["algorithm"] not in served]
        merged["levels"] += [level for level in run.get("levels", []) if level["algorithm"] in served]
        merged["parity_c1"].update(run.get("parity_c1", {}))
        merged["errors"] += list(run.get("errors", []))
        merged["switch"] = run.get("switch") or merged["switch"]
    return merged


def departures_without_the_switch(parity: dict, block: dict) -> list[dict]:
    """The dynamic server's departures from AR that are neither AR near-ties nor departures the
    DSPINE-static server (the same rounds, never switched) makes at the same request and position:
    the ones the switch could have caused. Without a static block every non-near-tie counts."""
    static = {(d["request"], d["position"]) for d in parity.get("DSPINE-static", {}).get("divergences", [])}
    return [d for d in block["divergences"] if d["kind"] != "near_tie" and (d["request"], d["position"]) not in static]


def switch_verdict(dynamic: dict) -> bool | str:
    """True when a `bench_dynamic` results file (or `merge_switch_runs` of several) shows the
    speculation switch serving exactly: the forced-plain server's greedy token ids equal AR's on every
    request at concurrency 1 (its plain steps are the decodes AR runs); the dynamic server's do too,
    or each of its departures is a near-tie by AR's top-2 gap (`--parity-gaps`: where its rounds'
    multi-token verify forward and AR's one-token decode may pick differently, as on every speculative
    server) or one the DSPINE-static server, which never switches, makes at the same request and
    position (`departures_without_the_switch`); the forced-plain server took only plain steps and the
    dynamic one both kinds. Else a sentence naming each check that failed."""
    problems = list(dynamic.get("errors", []))
    parity = dynamic.get("parity_c1", {})
    for name in ("DSPINE-plain", "DSPINE-dynamic"):
        block = parity.get(name)
        if block is None:
            problems.append(f"{name}: no parity against AR at concurrency 1")
        elif block["identical"] != block["requests"]:
            differ = block["requests"] - block["identical"]
            if name == "DSPINE-dynamic" and "divergences" in block and not departures_without_the_switch(parity, block):
                continue
            judged = (f"{block['near_tie']} at AR near-ties (top-2 gap <= {block['near_tie_nats']} nats), "
                      f"{block['other']} elsewhere; " if "divergences" in block else "")
            problems.append(f"{name}: {differ} of {block['requests']} requests differ from AR's tokens ({judged}"
                            f"first differences at {block['first_difference'][:5]})")
        levels = [level for level in dynamic.get("levels", []) if level["algorithm"] == name]
        tagged, plain = sum(level["tagged_steps"] for level in levels), sum(level["plain_steps"] for level in levels)
        if name == "DSPINE-plain" and not 0 < plain == tagged:
            problems.append(f"{name}: {plain} of {tagged} tagged decode steps plain (expected all)")
        if name == "DSPINE-dynamic" and not 0 < plain < tagged:
            problems.append(f"{name}: {plain} of {tagged} tagged decode steps plain (expected both kinds)")
    return True if not problems else "; ".join(dict.fromkeys(problems))


def switch_run(dynamic: dict) -> dict:
    """What `switch_verdict` read, kept beside the verdict: the run's command (its runs' `sources`
    when merged), parity at concurrency 1 and each config's tagged and plain decode steps."""
    steps = {}
    for level in dynamic.get("levels", []):
        row = steps.setdefault(level["algorithm"], {"tagged_steps": 0, "plain_steps": 0})
        row["tagged_steps"] += level["tagged_steps"]
        row["plain_steps"] += level["plain_steps"]
    out = {"command": dynamic.get("command"), "target": dynamic.get("target"), "switch": dynamic.get("switch"),
           "parity_c1": dynamic.get("parity_c1"), "steps": steps}
    if "sources" in dynamic:
        out["sources"] = dynamic["sources"]
    return out


def soak_fields(soak: dict) -> dict:
    """A preset entry's soak part from `scripts/soak.py`'s results."""
    return {"served_minutes": float(soak["minutes"]), "requests": int(soak["requests"]), "errors": int(soak["errors"]),
            "max_latency_over_p99": soak["max_latency_over_p99"], "health_non_200": soak["health_non_200"],
            "soak_passed": bool(soak.get("passed"))}


def report(rounds: dict, presets: dict[str, tuple[dict | None, str]], dynamic_switch_hybrid, command: str,
           hybrid_switch: dict | None = None, no_hybrid_preset: str | None = None, earlier: dict | None = None) -> dict:
    """The results object (see the module docstring); `presets`: name -> (soak results, or None for a
    rounds-only run, server log); `hybrid_switch`: the `bench_dynamic` file the verdict came from,
    summarised beside it; `no_hybrid_preset`: why the run served no hybrid preset (then
    `replayssm_scratch` is that reason); `earlier`: the results file this run adds to (`keep_earlier`)."""
    entries, scratch, left_out = [], None, []
    for name, (soak, log) in presets.items():
        entries.append({"preset": name, **(soak_fields(soak) if soak is not None else {}),
                        "flags_logged_in_effect": log.count(SERVE_FLAG_LINE), "memory_gb": memory_gb(log),
                        "rounds": preset_rounds(rounds["runs"], name, left_out),
                        "device": rounds["device"], "date": rounds["date"], "rounds_command": rounds["command"]})
        found = scratch_bytes(log)
        if found is not None:
            scratch = {"preset": name, **found}
    if scratch is None and no_hybrid_preset:
        scratch = f"not measured: {no_hybrid_preset}"
    elif scratch is None:
        raise BenchError("no server log holds the DSPINE worker's ReplaySSM scratch line. Fix: pass the hybrid "
                         "preset's log (a DSPINE server started with --enable-linear-replayssm-spec), or say why the run had none "
                         "with --no-hybrid-preset REASON")
    results = {"device": rounds["device"], "date": rounds["date"], "command": command, "sglang": rounds["sglang"],
               "rounds_command": rounds["command"], "presets": entries, "replayssm_scratch": scratch,
               "dynamic_switch_hybrid": dynamic_switch_hybrid}
    if left_out:
        results["rounds_left_out"] = left_out
    if hybrid_switch is not None:
        results["hybrid_switch_run"] = switch_run(hybrid_switch)
    results = keep_earlier(results, earlier)
    scratch = results["replayssm_scratch"]
    check_schema(results, RESULTS_SCHEMA if isinstance(scratch, dict) else
                 {k: v for k, v in RESULTS_SCHEMA.items() if k != "replayssm_scratch"})
    return results


def keep_earlier(results: dict, earlier: dict | None) -> dict:
    """`results` with what an earlier run wrote to the same file and this one did not measure, so
    presets measured in different sessions (the 27B one needs an H200, the 8B one fits an H100)
    gather in one file:

    - its presets of other names, as they were (each entry names its own device, date and rounds
      command), with their `rounds_left_out` rows;
    - for a preset this run served without a soak (a rounds-only rerun), the earlier entry's soak
      (`soak_device`, `soak_date` say where it ran) and its rounds at the (concurrency, temperature)
      this run did not measure, with the earlier left-out rows of temperatures still unmeasured;
    - its ReplaySSM scratch where this run served no hybrid preset.
    A preset without a soak here or before is an error that names the fix."""
    before = {entry["preset"]: entry for entry in (earlier or {}).get("presets", [])}
    names = {entry["preset"] for entry in results["presets"]}
    measured = {(entry["preset"], r["temperature"]) for entry in results["presets"] for r in entry["rounds"]}
    entries = [entry for entry in before.values() if entry["preset"] not in names]
    rounds_only = set()
    for entry in results["presets"]:
        if "served_minutes" in entry:
            entries.append(entry)
            continue
        old = before.get(entry["preset"])
        if old is None or "served_minutes" not in old:
            raise BenchError(f"{entry['preset']}: this run has no soak and the results file none to keep. Fix: pass "
                             "the soak file (--preset NAME=SOAK_JSON,LOG), or soak the preset first")
        rounds_only.add(entry["preset"])
        new_keys = {(r["concurrency"], r["temperature"]) for r in entry["rounds"]}
        rounds = [r for r in old["rounds"] if (r["concurrency"], r["temperature"]) not in new_keys] + entry["rounds"]
        entries.append({**old, **entry,
                        "rounds": sorted(rounds, key=lambda r: (r["temperature"], r["concurrency"])),
                        "soak_device": old.get("soak_device", old["device"]), "soak_date": old.get("soak_date", old["date"])})
    merged = {**results, "presets": entries, "device": devices_of(entries)}
    left_out = [row for row in (earlier or {}).get("rounds_left_out", []) if row["shape"] not in names
                or (row["shape"] in rounds_only and (row["shape"], row["temperature"]) not in measured)]
    left_out += results.get("rounds_left_out", [])
    merged.pop("rounds_left_out", None)
    if left_out:
        merged["rounds_left_out"] = left_out
    if earlier and not isinstance(results["replayssm_scratch"], dict) \
            and isinstance(earlier.get("replayssm_scratch"), dict):
        merged["replayssm_scratch"] = earlier["replayssm_scratch"]
    return merged


def devices_of(entries: list[dict]) -> str:
    """The file's `device`: the presets' card when they share one, else each card with the presets it
    served, e.g. "NVIDIA H200 (qwen3.8-27b); NVIDIA H100 80GB HBM3 (qwen3-8b)"."""
    by_device: dict[str, list[str]] = {}
    for entry in entries:
        by_device.setdefault(entry["device"], []).append(entry["preset"])
    if len(by_device) == 1:
        return next(iter(by_device))
    return "; ".join(f"{device} ({', '.join(names)})" for device, names in by_device.items())


def plot(results: dict, out_dir: Path, name: str = RESULTS_NAME) -> Path | None:
    """One panel per preset: DSPINE's ms per round and AR's ms per step against concurrency, greedy
    and T=1."""
    plt = pyplot("install matplotlib to draw it")
    if plt is None:
        return None
    presets = results["presets"]
    fig, axes = plt.subplots(1, len(presets), figsize=(max(6.5, 5.2 * len(presets)), 3.8), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for temperature, style in ((0.0, "-"), (1.0, "--")):
            rows = [r for r in preset["rounds"] if r["temperature"] == temperature]
            if not rows:
                continue
            xs = [r["concurrency"] for r in rows]
            ax.plot(xs, [r["ms_per_round"] for r in rows], style, marker="o", label=f"DSPINE round, T={temperature:g}")
            ax.plot(xs, [r["ms_per_step"] for r in rows], style, marker="s", color="grey",
                    label=f"AR step, T={temperature:g}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.set_title(f"{preset['preset']} ({preset['device']}): {preset['requests']} soak requests, "
                     f"{preset['errors']} errors", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"Published presets at their shapes, dummy weights (SGLang {results['sglang']})", fontsize=10)
    return save_figure(fig, out_dir / f"{name}.png", dpi=110)


def parse_args(argv):
    p = argparse.ArgumentParser(description="Join a preset run's round-cost file, soak files and server logs into "
                                            "real_shapes_h200.json (see the module docstring).")
    p.add_argument("--rounds", type=Path, required=True, help="bench_round_cost's results file of the run")
    p.add_argument("--preset", action="append", required=True, metavar="NAME=SOAK_JSON,SERVER_LOG",
                   help="per preset: its soak file and its server's log; SOAK_JSON '-' for a rounds-only rerun "
                        "(DSPINE_REAL_SOAK_MINUTES=0), which keeps the soak the results file holds")
    switch = p.add_mutually_exclusive_group(required=True)
    switch.add_argument("--hybrid-switch", type=Path, nargs="+", metavar="DYNAMIC_JSON",
                        help="scripts/bench_dynamic.py's results on a hybrid target (AR, DSPINE-plain, DSPINE-dynamic; "
                             "DSPINE-static as the control), one file or several runs of the same pair")
    switch.add_argument("--dynamic-switch-hybrid", metavar="REASON",
                        help="why no switch server could run with the hybrid target (the measured reason)")
    p.add_argument("--no-hybrid-preset", metavar="REASON",
                   help="the run served no hybrid preset (e.g. the 8B preset alone on an 80-GB card): "
                        "replayssm_scratch records REASON instead of the worker's line")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--results-name", default=RESULTS_NAME,
                   help=f"results file stem (default {RESULTS_NAME}; e.g. real_shapes_h100 for a run on an H100)")
    args = p.parse_args(argv)
    args.presets = {}
    for item in args.preset:
        name, _, files = item.partition("=")
        soak, _, log = files.partition(",")
        if not (name and soak and log):
            p.error(f"--preset {item}: expected NAME=SOAK_JSON,SERVER_LOG")
        args.presets[name] = (None if soak == "-" else Path(soak), Path(log))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        presets = {name: (None if soak is None else json.loads(soak.read_text()), log.read_text(errors="replace"))
                   for name, (soak, log) in args.presets.items()}
        earlier_path = args.out_dir / f"{args.results_name}.json"
        earlier = json.loads(earlier_path.read_text()) if earlier_path.is_file() else None
        dynamic = (merge_switch_runs([json.loads(path.read_text()) for path in args.hybrid_switch])
                   if args.hybrid_switch else None)
        switch = switch_verdict(dynamic) if dynamic is not None else args.dynamic_switch_hybrid
        results = report(json.loads(args.rounds.read_text()), presets, switch, command_line(argv), dynamic,
                         args.no_hybrid_preset, earlier)
    except (OSError, ValueError, KeyError, BenchError) as exc:
        print(f"real shapes: {exc}", file=sys.stderr)
        return 1
    path = write_results(results, args.out_dir, args.results_name)
    for preset in results["presets"]:
        print(f"{preset['preset']}: {preset['served_minutes']:.1f} min, {preset['requests']} requests, "
              f"{preset['errors']} errors, memory {preset['memory_gb']}")
        for r in preset["rounds"]:
            print(f"  c={r['concurrency']:<3} T={r['temperature']:g}  round {r['ms_per_round']:.2f} ms  "
                  f"AR step {r['ms_per_step']:.2f} ms  ({r['round_over_step']:.2f}x)")
    for row in results.get("rounds_left_out", []):
        print(f"  left out: {row['shape']} {row['config']} T={row['temperature']:g}: {row['reason']}")
    s = results["replayssm_scratch"]
    if isinstance(s, dict):
        print(f"ReplaySSM scratch per request ({s['preset']}): {s['replayssm_bytes']} against {s['snapshot_bytes']} "
              f"bytes ({s['ratio']}x smaller)")
    else:
        print(f"ReplaySSM scratch: {s}")
    print(f"dynamic switch with the hybrid target: {results['dynamic_switch_hybrid']}")
    plot(results, args.out_dir, args.results_name)
    print(f"wrote {path}")
    return 0
