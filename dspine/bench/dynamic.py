"""Dynamic verification served: AR vs DSPINE-static vs DSPINE-dynamic on held-out trace replays.

One SGLang server at a time (`dspine.bench.launchers`: a serve script such as `.gpu/host/serve.sh`,
or `--url NAME=URL` for servers already running):

* `AR`: the target alone;
* `DSPINE-static`: `--speculative-algorithm DSPINE`, every decode step drafts a block;
* `DSPINE-dynamic`: the same flags with `DSPINE_DYNAMIC=<--switch>` in the server's environment
  (the speculation switch, `dspine.dynamic.switch`, tuned by `dspine tune-sps --plain-table` on the
  traces' tune split; or, with `--alternating-switch`, an untuned file that makes a server whose drafts
  are rarely accepted take both kinds of step, `write_alternating_switch`: an exactness check, not a
  speed one);
* `DSPINE-plain` (optional, a diagnostic): `DSPINE_DYNAMIC=<a forced switch file>` written to
  --out-dir (`dspine.dynamic.switch.write_forced_switch`: `{"force": "plain", "plain_tokens":
  <--plain-tokens>}`), every decode step plain: what a plain step costs against AR's.

Workload: `--requests` (a JSONL of OpenAI chat requests, e.g. the held-out split written by
`python -m dspine.data.traces heldout TRACES --out FILE`; never the split the switch was tuned on), cycled; at each
concurrency max(--min-requests, --waves x c) requests, greedy (temperature 0), max_tokens capped,
all with `return_meta_info`. Per level: output_tok_per_s = completion tokens / wall time;
accept_len = completion tokens / spec_verify_ct (tokens per decode step, plain steps included; 1 for
AR); mean_verify_tokens = verify tokens per request per decode step: N for a drafting step, 1 for a
plain one (`meta_info.dspine_verify_tokens`, one entry per decode step under the switch). At concurrency 1 the
token ids of every request are compared with AR's (`parity_c1`). With `--parity-gaps` the AR server
then answers those requests once more with its top-2 logprobs, and each other config's first
departure from AR is judged by AR's top-2 gap there (`dspine.bench.parity.verdict`): a near-tie (at
most `--near-tie-nats`), where a multi-token verify forward and a one-token decode may pick
differently, or not.

Each level runs `--repeats` times on the same server and reports its median repeat, with every
repeat's throughput (`levels[*].repeats_tok_per_s`): levels of a few seconds vary from run to run.
`--url NAME=URL` uses a server already running for config NAME (e.g. the plain-step server the
switch's table was measured on) and starts the others.

Writes `--out-dir/dynamic_h200.json` after every level (schema `RESULTS_SCHEMA`) and
`dynamic_h200.png` (throughput ÷ AR against concurrency).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dspine.bench.chat_client import CHAT, completion_tokens, parity_pass
from dspine.bench.launchers import ConfigLaunchers, add_server_arguments, check_server_arguments, detect_device
from dspine.bench.parity import NEAR_TIE_NATS, verdict
from dspine.bench.results import BenchError, check_schema, command_line, write_results
from dspine.dynamic.switch import write_forced_switch, write_switch_file
from dspine.utils.atomic import write_json_atomic
from dspine.utils.http import HttpClient, HttpError
from dspine.utils.plot import pyplot, save_figure

CONFIGS = ("AR", "DSPINE-static", "DSPINE-dynamic", "DSPINE-plain")
RESULTS_NAME = "dynamic_h200"
RESULTS_SCHEMA = {
    "device": str, "date": str, "sglang": str, "command": str,
    "runs": [{"algorithm": str, "concurrency": int, "output_tok_per_s": float, "mean_verify_tokens": float,
              "accept_len": float}],
}
FORCED_PLAIN_FILE = "switch-forced-plain.json"
ALTERNATING_SWITCH_FILE = "switch-alternating.json"


def write_alternating_switch(folder: Path, block_size: int, plain_tokens: int) -> Path:
    """An untuned dynamic switch file in `folder` (with its two step tables) under which a server
    takes both kinds of decode step: a new request drafts (its prior survival, 0.95 per position,
    expects ~11 tokens a round against `plain_tokens` a plain step at equal step rates), a request
    whose drafts fail (random drafter weights) turns to plain steps, and the backoff probes drafting
    again within 8 steps (probe share 0.2). For checking that outputs stay exact across switches;
    its step rates are made up, so it says nothing about speed."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "alternating-round.json",
                      {"sample_batch_tokens": [block_size, 8 * block_size, 32 * block_size],
                       "sample_steps_per_sec": [300.0, 250.0, 120.0], "max_batch_tokens": 32 * block_size})
    write_json_atomic(folder / "alternating-plain.json",
                      {"sample_batch_tokens": [1, 8, 32], "sample_steps_per_sec": [300.0, 280.0, 200.0],
                       "max_batch_tokens": 32})
    path = folder / ALTERNATING_SWITCH_FILE
    write_switch_file(path, round_table="alternating-round.json", plain_table="alternating-plain.json",
                      calibration=None, prior_survival=[0.95 ** (i + 1) for i in range(block_size - 1)],
                      probe_share=0.2, max_backoff=8, plain_tokens=plain_tokens)
    return path


def load_requests(path: Path, max_tokens: int) -> list[dict]:
    """OpenAI chat request bodies, greedy, max_tokens capped at `max_tokens`."""
    bodies = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except ValueError as err:
            raise BenchError(f"{path}:{line_no}: not JSON ({err})") from None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise BenchError(f"{path}:{line_no}: an OpenAI chat request needs a `messages` list")
        body = {k: v for k, v in body.items() if k not in ("stream", "n", "model")}
        body.update(temperature=0, max_tokens=min(int(body.get("max_tokens") or max_tokens), max_tokens))
        bodies.append(body)
    if not bodies:
        raise BenchError(f"{path}: no requests")
    return bodies


def send(base: str, body: dict, model: str, timeout: float, token_ids: bool) -> dict:
    """One non-streamed chat completion with meta_info: completion tokens, verify steps, plain steps."""
    extra = {"model": model, "return_meta_info": True, **({"return_token_ids": True} if token_ids else {})}
    payload = HttpClient(base, timeout, retries=0).post(CHAT, {**body, **extra})
    choice = (payload.get("choices") or [{}])[0]
    meta = choice.get("meta_info") or {}
    return {"tokens": completion_tokens(payload.get("usage"), base),
            "verify_ct": int(meta.get("spec_verify_ct") or 0),
            "verify_tokens": [int(v) for v in meta.get("dspine_verify_tokens") or []],
            "token_ids": choice.get("token_ids")}


def level_stats(replies: list[dict], wall: float, block: int) -> dict:
    """Throughput, tokens per decode step and verify tokens per request-step of one level. A server
    under the switch tags every decode step with its verify width (`dspine_verify_tokens`: N or 1); a
    static one drafts every step (N); AR reports no speculative fields (1)."""
    tokens = sum(r["tokens"] for r in replies)
    steps = sum(r["verify_ct"] for r in replies)
    widths = [w for r in replies for w in r["verify_tokens"]]
    plain = sum(w == 1 for w in widths)
    if steps == 0:
        accept, verify = 1.0, 1.0
    else:
        accept, verify = tokens / steps, (sum(widths) / len(widths) if widths else float(block))
    return {"output_tok_per_s": tokens / wall, "accept_len": accept, "mean_verify_tokens": verify,
            "completion_tokens": tokens, "wall_s": wall, "decode_steps": steps or None,
            "tagged_steps": len(widths), "plain_steps": plain}


def median_level(levels: list[dict]) -> dict:
    """The repeat with the median throughput (the lower middle one for an even count), plus every
    repeat's throughput in `repeats_tok_per_s` (the run-to-run spread of one server)."""
    ranked = sorted(levels, key=lambda level: level["output_tok_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "repeats_tok_per_s": [level["output_tok_per_s"] for level in levels]}


def run_level(base: str, bodies: list[dict], c: int, args) -> tuple[dict, list[dict]]:
    count = max(args.min_requests, args.waves * c)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=c) as pool:
        replies = list(pool.map(lambda i: send(base, bodies[i % len(bodies)], args.served_model,
                                               args.request_timeout, token_ids=c == 1), range(count)))
    return {"concurrency": c, "requests": count, **level_stats(replies, time.perf_counter() - t0,
                                                             args.num_draft_tokens)}, replies


def server_configs(args) -> dict[str, tuple[list[str], dict[str, str]]]:
    """(SGLang flags, variables added to the server's environment) per chosen config. DSPINE-plain
    writes its forced switch file (`FORCED_PLAIN_FILE` in --out-dir) here."""
    common = ["--model-path", args.model_path, *shlex.split(args.extra_flags)]
    spec = [*common, "--speculative-algorithm", "DSPINE", "--speculative-num-draft-tokens", str(args.num_draft_tokens),
            "--speculative-draft-attention-backend", "triton", "--speculative-draft-model-path", args.draft,
            *shlex.split(args.spec_flags)]
    chosen = {}
    for name in args.configs:
        env: dict[str, str] = {}
        if name == "DSPINE-dynamic":
            if args.alternating_switch:
                args.switch = str(write_alternating_switch(Path(args.out_dir).resolve(), args.num_draft_tokens,
                                                           args.plain_tokens))
            if not args.switch:
                raise BenchError("DSPINE-dynamic needs --switch (the switch.json of `dspine tune-sps --plain-table`)")
            env = {"DSPINE_DYNAMIC": str(Path(args.switch).resolve())}
        elif name == "DSPINE-plain":
            forced = Path(args.out_dir).resolve() / FORCED_PLAIN_FILE
            write_forced_switch(forced, "plain", plain_tokens=args.plain_tokens)
            env = {"DSPINE_DYNAMIC": str(forced)}
        chosen[name] = (common if name == "AR" else spec, env)
    return chosen


def parity_c1(passes: dict[str, list[dict]], ar_top2: list[list[float]] | None = None,
              near_tie_nats: float = NEAR_TIE_NATS) -> dict:
    """Per config: requests whose token ids equal AR's at concurrency 1, and the first differing
    position of the others. With `ar_top2` (per request, AR's top-2 logprobs at each position of its
    answer: `--parity-gaps`) also each departure's AR gap and verdict ("near_tie" at most
    `near_tie_nats`, else "other") in `divergences`, and their counts."""
    out = {}
    ar = passes.get("AR")
    for name, replies in passes.items():
        if name == "AR" or ar is None:
            continue
        firsts = []
        for a, b in zip(ar, replies):
            x, y = a["token_ids"] or [], b["token_ids"] or []
            firsts.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q),
                               None if len(x) == len(y) else min(len(x), len(y))))
        block = {"requests": len(firsts), "identical": sum(f is None for f in firsts),
                 "first_difference": [f for f in firsts if f is not None]}
        if ar_top2 is not None:
            divergences = []
            for request, (k, top2) in enumerate(zip(firsts, ar_top2)):
                if k is not None:
                    top = top2[k] if k < len(top2) else []
                    gap = top[0] - top[1] if len(top) >= 2 else None
                    divergences.append({"request": request, "position": k, "gap": gap,
                                        "kind": verdict(gap, near_tie_nats)})
            kinds = [d["kind"] for d in divergences]
            block.update(near_tie=kinds.count("near_tie"), other=kinds.count("other"), near_tie_nats=near_tie_nats,
                         divergences=divergences)
        out[name] = block
    return out


def ar_gaps(base: str, bodies: list[dict], replies: list[dict], args) -> list[list[float]]:
    """AR's top-2 logprobs at each position of its concurrency-1 answers (`--parity-gaps`): the same
    requests once more, one at a time, with logprobs. Greedy AR answers itself identically; an answer
    that differs now is an error (its gaps would belong to other tokens)."""
    sent = [{**bodies[i % len(bodies)], "model": args.served_model} for i in range(len(replies))]
    again = parity_pass(base, sent, args.request_timeout, logprobs=True)
    for i, (first, second) in enumerate(zip(replies, again)):
        if first["token_ids"] != second.token_ids:
            raise BenchError(f"AR answered request {i} differently when asked for logprobs: its greedy decoding is "
                             "not repeatable on this server, so no gap can judge the other configs' departures")
    return [reply.top2 or [] for reply in again]


def speedups(runs: list[dict], ar: dict[int, float] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Per config: (concurrency, output tok/s ÷ AR's at that concurrency), sorted; AR from `runs`
    unless given (e.g. the mean of several AR runs)."""
    if ar is None:
        ar = {r["concurrency"]: r["output_tok_per_s"] for r in runs if r["algorithm"] == "AR"}
    out: dict[str, list[tuple[int, float]]] = {}
    for r in runs:
        if r["algorithm"] != "AR" and r["concurrency"] in ar:
            out.setdefault(r["algorithm"], []).append((r["concurrency"], r["output_tok_per_s"] / ar[r["concurrency"]]))
    return {name: sorted(points) for name, points in out.items()}


def plot(results: dict, out_dir: Path) -> Path | None:
    """Throughput ÷ AR against concurrency. With `ar_runs` (several AR runs of the host: {"runs": {name:
    {c: tok/s}}, "mean": {c: tok/s}}) the ratios are taken against their mean and AR's own spread is
    drawn as a grey band; `previous_runs` (earlier code, other hosts) are drawn thin and dashed; an
    optional `label` names the main run in the legend, and plain-step lines carry their K (the switch
    file's `plain_tokens`, 1 when absent)."""
    plt = pyplot("redraw it with --plot-only where it is installed")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colours = dict(zip(CONFIGS[1:], ("tab:blue", "tab:orange", "tab:green")))
    ar_runs = results.get("ar_runs")
    mean = {int(c): v for c, v in ar_runs["mean"].items()} if ar_runs else None
    if mean:
        cs = sorted(mean)
        runs = ar_runs["runs"].values()
        ax.fill_between(cs, [min(r[str(c)] for r in runs) / mean[c] for c in cs],
                        [max(r[str(c)] for r in runs) / mean[c] for c in cs], color="grey", alpha=0.2,
                        label=f"AR, {len(ar_runs['runs'])} runs (spread)")
    def named(name: str, block: dict, tag: str) -> str:
        tokens = (block.get("switch") or {}).get("plain_tokens", 1)
        k = f", K={tokens}" if name in ("DSPINE-plain", "DSPINE-dynamic") else ""
        return f"{name} ({tag}{k})" if tag or k else name

    for name, points in speedups(results["runs"], mean).items():
        ax.plot([p[0] for p in points], [p[1] for p in points], "-", marker="o", color=colours.get(name),
                label=named(name, results, results.get("label", "")))
    for previous in results.get("previous_runs", []):
        for name, points in speedups(previous["runs"]).items():
            ax.plot([p[0] for p in points], [p[1] for p in points], "--", lw=0.8, alpha=0.6, marker=".",
                    color=colours.get(name), label=named(name, previous, previous["label"].split(",")[0]))
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s ÷ AR",
           title=f"{Path(str(results.get('target', ''))).name or 'target'}: speculation vs AR ({results['device']})")
    if ax.get_legend_handles_labels()[0]:          # nothing to name when no config was measured against AR
        ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, Path(out_dir) / f"{RESULTS_NAME}.png", dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=Path, help="held-out OpenAI chat requests (JSONL)")
    p.add_argument("--switch", default=None, help="switch.json for DSPINE-dynamic (dspine tune-sps --plain-table)")
    p.add_argument("--alternating-switch", action="store_true",
                   help="DSPINE-dynamic with an untuned switch file that alternates drafting and plain steps "
                        "(written to --out-dir; for exactness checks with a random drafter, not for speed)")
    p.add_argument("--plain-tokens", type=int, default=1,
                   help="DSPINE-plain: target tokens per plain step (the forced switch file's plain_tokens; use "
                        "the tuned switch file's); with --alternating-switch, its plain steps' too")
    p.add_argument("--spec-flags", default="",
                   help="SGLang flags of the DSPINE configs only, e.g. '--enable-linear-replayssm-spec "
                        "--linear-replayssm-cache-len 32' for a hybrid target")
    add_server_arguments(p, configs=CONFIGS, default_configs=CONFIGS[:3],
                         extra_flags="--cuda-graph-max-bs-decode 128 --max-running-requests 128",
                         url_help="NAME=URL of a running server for config NAME (the others are started with "
                                  "--serve-script)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 128])
    p.add_argument("--min-requests", type=int, default=32)
    p.add_argument("--waves", type=int, default=2, help="each level sends at least waves x concurrency requests")
    p.add_argument("--repeats", type=int, default=3,
                   help="run each level this many times on the same server; report the median repeat (levels "
                        "of a few seconds vary from run to run)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--parity-gaps", action="store_true",
                   help="after AR's levels, ask the AR server for its top-2 logprobs on the concurrency-1 requests "
                        "and judge every other config's first departure from AR by AR's gap there")
    p.add_argument("--near-tie-nats", type=float, default=NEAR_TIE_NATS,
                   help="with --parity-gaps: the largest AR top-2 gap (nats) of a near-tie departure (two bf16 "
                        "steps of a top logit in [16, 32); dspine.bench.parity)")
    p.add_argument("--plot-only", action="store_true", help="redraw dynamic_h200.png from the JSON in --out-dir")
    args = p.parse_args(argv)
    if args.requests is None and not args.plot_only:
        p.error("--requests FILE is required (a held-out workload: python -m dspine.data.traces heldout TRACES --out FILE)")
    if args.switch and args.alternating_switch:
        p.error("--switch and --alternating-switch both name DSPINE-dynamic's switch file: give one")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1")
    check_server_arguments(p, args, CONFIGS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        print(plot(json.loads((args.out_dir / f"{RESULTS_NAME}.json").read_text()), args.out_dir))
        return 0
    bodies = load_requests(args.requests, args.max_tokens)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    configs = server_configs(args)
    launcher = ConfigLaunchers(args)
    results = {"device": args.device or "unknown", "date": datetime.date.today().isoformat(), "sglang": "unknown",
               "command": command_line(argv), "target": args.model_path, "drafter": args.draft,
               "requests": {"file": str(args.requests), "count": len(bodies), "max_tokens": args.max_tokens},
               "switch": json.loads(Path(args.switch).read_text()) if args.switch else None,
               "runs": [], "levels": [], "configs": {}, "errors": []}
    passes: dict[str, list[dict]] = {}
    ar_top2 = None
    for name, (flags, env) in configs.items():
        results["configs"][name] = {"flags": flags, "env": env}
        try:
            base = launcher.start(name, flags, env)
            info = HttpClient(base, timeout=10.0, retries=0).get_or_none("/server_info") or {}
            results["sglang"] = info.get("version") or results["sglang"]
            if results["device"] == "unknown":
                results["device"] = detect_device(info)
            send(base, bodies[0], args.served_model, args.request_timeout, token_ids=False)   # warm-up
            for c in args.concurrency:
                repeats = [run_level(base, bodies, c, args) for _ in range(args.repeats)]
                level = median_level([rep[0] for rep in repeats])
                if c == 1:
                    passes[name] = repeats[0][1]
                results["levels"].append({"algorithm": name, **level})
                results["runs"].append({"algorithm": name, "concurrency": c,
                                        **{k: level[k] for k in ("output_tok_per_s", "mean_verify_tokens",
                                                                 "accept_len")}})
                results["parity_c1"] = parity_c1(passes, ar_top2, args.near_tie_nats)
                write_results(results, args.out_dir, RESULTS_NAME)
                spread = "/".join(f"{x:.0f}" for x in level["repeats_tok_per_s"])
                print(f"[{name}] c={c}: {level['output_tok_per_s']:.0f} tok/s (repeats {spread}), "
                      f"{level['accept_len']:.2f} tokens/step, {level['mean_verify_tokens']:.2f} verify "
                      f"tokens/request-step, {level['wall_s']:.1f} s", flush=True)
            if name == "AR" and args.parity_gaps and "AR" in passes:
                ar_top2 = ar_gaps(base, bodies, passes["AR"], args)
        except (BenchError, HttpError, OSError) as err:
            results["errors"].append(f"{name}: {err}")
            print(f"[{name}] FAILED: {err}", flush=True)
        finally:
            launcher.stop(name)
    results["parity_c1"] = parity_c1(passes, ar_top2, args.near_tie_nats)   # every config judged by AR's gaps
    results["speedup_vs_ar"] = {name: {str(c): round(x, 3) for c, x in points}
                                for name, points in speedups(results["runs"]).items()}
    path = write_results(results, args.out_dir, RESULTS_NAME)
    plot(results, args.out_dir)
    ar = {r["concurrency"]: r["output_tok_per_s"] for r in results["runs"] if r["algorithm"] == "AR"}
    print(f"{'config':<16}" + "".join(f"{'c=' + str(c):>10}" for c in args.concurrency) + "   (÷ AR)")
    for name in configs:
        row = {r["concurrency"]: r["output_tok_per_s"] for r in results["runs"] if r["algorithm"] == name}
        print(f"{name:<16}" + "".join(f"{row[c] / ar[c]:>10.3f}" if c in row and c in ar else f"{'-':>10}"
                                      for c in args.concurrency))
    print(f"wrote {path}")
    if results["errors"]:
        print("errors:\n  " + "\n  ".join(results["errors"]), file=sys.stderr)
        return 1
    check_schema(results, RESULTS_SCHEMA)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
