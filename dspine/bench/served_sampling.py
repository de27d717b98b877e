"""Is a speculative server's sampling the target's? A two-sample chi-square test over HTTP.

Speculative sampling is lossless only if every emitted token follows the target's distribution.
This benchmark asks two running SGLang servers of the same target, a plain one (A, e.g. AR) and a
speculative one (B, e.g. DSPINE), for many sampled continuations of one prompt (same temperature,
top-p, top-k; a fresh random seed per request), and compares, position by position, how often each
token id came out. Under losslessness both samples come from one distribution: each position's
chi-square test of homogeneity (ids seen fewer than `--min-expected` times pooled into one cell)
then gives a p-value that is uniform, and the verdict is "indistinguishable" when every p-value
clears `--alpha` divided by the number of positions (Bonferroni).

Position 1 comes from the prefill in both servers, so only positions 2.. exercise speculative
verification; the benchmark prints B's accept length (completion tokens / verify rounds) to show that
the drafts were verified at all — at an accept length of 1.0 the test cannot tell anything.

  python scripts/check_served_sampling.py --url-a http://127.0.0.1:30000 --url-b http://127.0.0.1:30001 \\
      --samples 4000 --max-new-tokens 4 --out check_sampling.json

Needs scipy (chi2_contingency). Writes the verdict and every position's p-value to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dspine.bench.results import command_line
from dspine.utils.atomic import write_json_atomic
from dspine.utils.http import HttpClient, HttpError

PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"


def sample_once(url: str, prompt: str, params: dict, timeout: float) -> tuple[list[int], int, int]:
    """One /generate request: (output ids, completion tokens, verify rounds or 0 without speculation)."""
    reply = HttpClient(url, timeout).post("/generate", {"text": prompt, "sampling_params": params})
    meta = reply["meta_info"]
    return list(reply["output_ids"]), int(meta["completion_tokens"]), int(meta.get("spec_verify_ct") or 0)


def collect(url: str, prompt: str, params: dict, samples: int, concurrency: int, timeout: float) -> dict:
    """`samples` continuations: {"ids": [[int]], "completion_tokens": int, "verify_rounds": int}."""
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda _: sample_once(url, prompt, params, timeout), range(samples)))
    return {"ids": [r[0] for r in replies], "completion_tokens": sum(r[1] for r in replies),
            "verify_rounds": sum(r[2] for r in replies)}


def homogeneity_pvalue(a: Counter, b: Counter, min_expected: float) -> tuple[float, int]:
    """Chi-square test that two samples of token ids share one distribution. Ids whose pooled
    count is under `min_expected` / min(share of each sample) merge into one cell. Returns
    (p-value, cells); p = 1.0 when fewer than two cells are left (nothing to compare)."""
    from scipy.stats import chi2_contingency

    n_a, n_b = sum(a.values()), sum(b.values())
    pooled = a + b
    share = min(n_a, n_b) / (n_a + n_b)
    big = sorted(tok for tok, c in pooled.items() if c * share >= min_expected)
    table = [[a[t] for t in big], [b[t] for t in big]]
    rest = (n_a - sum(table[0]), n_b - sum(table[1]))
    if rest[0] + rest[1] > 0:
        table[0].append(rest[0])
        table[1].append(rest[1])
    if len(table[0]) < 2:
        return 1.0, len(table[0])
    return float(chi2_contingency(table).pvalue), len(table[0])


def compare(ids_a: list[list[int]], ids_b: list[list[int]], positions: int, min_expected: float) -> list[dict]:
    """Per position 1..`positions`: samples that reached it on each side, cells, p-value."""
    rows = []
    for j in range(positions):
        a = Counter(seq[j] for seq in ids_a if len(seq) > j)
        b = Counter(seq[j] for seq in ids_b if len(seq) > j)
        if not a or not b:
            break
        p, cells = homogeneity_pvalue(a, b, min_expected)
        rows.append({"position": j + 1, "samples_a": sum(a.values()), "samples_b": sum(b.values()),
                     "cells": cells, "pvalue": p})
    return rows


def local_device() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "unknown (pass --device)"


def server_summary(url: str, timeout: float) -> dict:
    """What the result must say about a server: SGLang version, algorithm, model and drafter paths."""
    try:
        info = HttpClient(url, timeout).get("/server_info")
    except (HttpError, ValueError) as err:  # unreachable, or not JSON: the verdict does not depend on it
        return {"error": f"/server_info: {err}"}
    keys = ("version", "speculative_algorithm", "model_path", "speculative_draft_model_path",
            "speculative_num_draft_tokens")
    return {k: info.get(k) for k in keys}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url-a", required=True, help="the plain (reference) server, e.g. AR")
    p.add_argument("--url-b", required=True, help="the speculative server, e.g. DSPINE")
    p.add_argument("--prompt", default=PROMPT, help="raw text sent to /generate (no chat template)")
    p.add_argument("--samples", type=int, default=4000, help="continuations per server")
    p.add_argument("--max-new-tokens", type=int, default=4, help="positions compared")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--min-expected", type=float, default=5.0, help="pool ids with fewer expected counts than this")
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise significance level")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--device", default=None, help="the servers' GPU, for the result JSON (default: this "
                                                    "machine's first CUDA device)")
    args = p.parse_args(argv)
    if args.temperature <= 0:
        p.error("--temperature must be > 0: greedy outputs are compared by scripts/bench_serving.py")
    params = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    sides = {}
    for name, url in (("a", args.url_a), ("b", args.url_b)):
        print(f"[{name}] {args.samples} samples from {url} ...", flush=True)
        sides[name] = collect(url, args.prompt, params, args.samples, args.concurrency, args.timeout)
    rows = compare(sides["a"]["ids"], sides["b"]["ids"], args.max_new_tokens, args.min_expected)
    threshold = args.alpha / max(1, len(rows))
    accept = {n: (s["completion_tokens"] / s["verify_rounds"] if s["verify_rounds"] else None) for n, s in sides.items()}
    verdict = "indistinguishable" if rows and all(r["pvalue"] > threshold for r in rows) else "DIFFERENT"
    print(f"{'pos':>4} {'cells':>6} {'p-value':>10}")
    for r in rows:
        print(f"{r['position']:>4} {r['cells']:>6} {r['pvalue']:>10.4f}")
    print(f"accept length: A {accept['a']}, B {accept['b']}; per-position threshold {threshold:.4g}: {verdict}")
    if not accept["b"] or accept["b"] <= 1.0:
        print("warning: B verified no drafted token, so this run says nothing about speculative sampling",
              file=sys.stderr)
    if args.out:
        result = {"command": command_line(argv),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "device": args.device or local_device(), "servers": {n: server_summary(u, args.timeout) for n, u in
                                                                      (("a", args.url_a), ("b", args.url_b))},
                  "url_a": args.url_a, "url_b": args.url_b, "prompt": args.prompt, "sampling": params,
                  "samples": args.samples, "accept_len": accept, "alpha": args.alpha, "positions": rows,
                  "verdict": verdict}
        write_json_atomic(args.out, result)
    return 0 if verdict == "indistinguishable" else 1


if __name__ == "__main__":
    raise SystemExit(main())
