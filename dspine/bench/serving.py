"""Serving benchmark: AR vs DSPINE vs DSPINE-ablation SGLang servers, over HTTP.

For each server config (a set of extra sglang flags) the script starts the server through a
launcher, measures, stops it, and rewrites the results file after every measurement (a timeout
leaves what was measured):

* Throughput levels (concurrency 1, 4, 16, 64 by default): max(--prompts, --waves x c) prompts (a
  round-robin mix of the five evaluation sets, `dspine.data.datasets.EVAL_SETS`; several waves per
  level, so that a level is not one burst timed by its longest request) go to `/v1/chat/completions` (the server
  applies the chat template) with temperature 0, fixed `max_tokens`, EOS honoured.
  output_tok_per_s = total completion tokens / wall time of the level. Even-numbered requests are
  streamed (`stream_options.include_usage`) and give TTFT (mean and p50: time to the first content
  chunk); odd-numbered ones are not streamed and ask SGLang for `return_meta_info`, whose
  `spec_verify_ct` gives the level's accept length (sum completion tokens / sum spec_verify_ct;
  1.0 for AR). SGLang 0.5.17 rejects `return_meta_info` with `stream=true` and puts no spec
  fields in streamed chunks, hence the split: both halves load the server the same way.
* Greedy parity (after the levels, one request at a time): every prompt is sent once more, not streamed, with `return_meta_info` and `return_token_ids` (and, on the AR server only,
  `logprobs` with `top_logprobs=2`). The route is the chat one rather than native `/generate` so that the server applies the chat
  template (native `/generate` takes raw text or token ids) and the prompts match the levels'; in
  0.5.17 the choice's `meta_info` is the native `/generate` meta_info (`completion_tokens`,
  `spec_verify_ct`, ...). The DSPINE server's token ids are compared with the AR server's, prompt
  by prompt. At the first differing position the AR server's top-2 logprob gap decides: a gap
  of at most `--near-tie-nats` is a "near-tie" divergence, anything else (a larger gap, or no AR
  logprobs there, e.g. AR stopped) is "other". The default, 0.25 nats, is two bf16 steps: the
  target's top logits (16-32 for SmolLM2) are bf16 numbers 0.125 apart, so a gap of 0, 0.125 or
  0.25 means the two best tokens are adjacent or equal in bf16, and the different accumulation
  order of an N-token verify against a 1-token decode flips such choices (shared/gpu/README.md:
  SGLang's own DFLASH does the same). `gap_histogram` counts the gaps; `--reclassify` recomputes
  the verdicts of a results file for another threshold from the stored gaps, without measuring.
  `--ar-control C` measures that band instead of assuming it: the AR server answers the parity
  prompts a second time with C in flight, and `parity_ar_control` judges those answers against its
  serial ones exactly as the DSPINE server's (plain decoding against itself at another batch size).
  `--prefill-check` asks the target itself, at each divergence: the AR server (measured last, so
  the speculative tokens are known) flushes its radix cache and prefills prompt + the common prefix
  in one multi-token forward (the kind of forward a verify is), and its greedy next token is recorded with
  its top-2 logprobs (`prefill` in each divergence: `picks` "spec", "ar" or "neither";
  `prefill_picks` counts them per parity block). A divergence whose prefill picks the speculative
  server's token is a choice the target's own multi-token forward makes: bf16 forward-mode noise,
  not a fault of the drafter or the commit path.
* Ceiling, from the non-streamed requests of the concurrency-1 level (one at a time, no logprobs):
  T_step = AR wall / AR completion tokens, T_round = DSPINE wall / DSPINE spec_verify_ct (client
  wall times, prefill and HTTP included on both sides), tau = DSPINE completion tokens /
  spec_verify_ct, speedup = tau * T_step / T_round (what a round of T_round ms yielding tau tokens
  buys over one T_step per token); `achieved_fraction` = the concurrency-1 level's measured
  throughput speedup (all its requests) / that speedup.

Launchers: `--url URL` (or `--url NAME=URL` per config) for servers already running; otherwise
`bash .gpu/host/serve.sh start|stop` with `SGL_PORT` (the GPU host, see shared/gpu/README.md),
logs in --out-dir. `--spec-flags` adds sglang flags to the speculative configs only (e.g. ReplaySSM
on a hybrid target). Results: `serving_h200.json` (schema: `RESULTS_SCHEMA`), `serving_h200.png`;
`--results-name` picks another stem (e.g. `serving_hybrid_h200`).
Prompts come from `$DSPINE_PROMPTS_DIR` exports where the data packages are absent (GPU host).
Needs only the standard library (matplotlib for the plot; without it, `--plot-only` later).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("AR", "DSPINE", "DSPINE-ablation")
RESULTS_NAME = "serving_h200"
RESULTS_SCHEMA = {
    "device": str, "date": str, "sglang": str, "target": str, "drafter": str, "command": str,
    "runs": [{"algorithm": str, "concurrency": int, "output_tok_per_s": float, "accept_len": float, "ttft_ms": float}],
    "ceiling": {"t_step_ms": float, "t_round_ms": float, "accept_len": float, "speedup": float},
    "parity": {"prompts": int, "identical": int, "near_tie_divergences": int, "other_divergences": int},
}
SERVER_START_S = 75.0  # a warm start on the GPU host (~50-75 s; the host's first start ~140 s)
SERVER_STOP_S = 8.0


class BenchError(RuntimeError):
    """A server answered something this benchmark cannot use; the message says what and where."""


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

def _datasets_module():
    """`dspine/data/datasets.py`, loaded from its file: pure Python, so no torch import (and no install)
    is needed on the GPU host."""
    if "_dspine_datasets" in sys.modules:
        return sys.modules["_dspine_datasets"]
    spec = importlib.util.spec_from_file_location("_dspine_datasets", ROOT / "dspine" / "datasets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_prompt_mix(n: int) -> list[dict]:
    """`n` prompts, round-robin over the five evaluation sets (each set's first prompts, file order):
    dicts `{"id", "source", "messages"}`."""
    datasets = _datasets_module()
    per_set = math.ceil(n / len(datasets.EVAL_SETS))
    sets = [datasets.load_eval_set(name, per_set) for name in datasets.EVAL_SETS]
    mixed = [s[i] for i in range(per_set) for s in sets if i < len(s)]
    if len(mixed) < n:
        raise BenchError(f"only {len(mixed)} evaluation prompts available, {n} asked for")
    return [{"id": p.id, "source": p.source, "messages": p.messages} for p in mixed[:n]]


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------

def _post(url: str, body: dict, timeout: float) -> urllib.request.addinfourl:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise BenchError(f"POST {url}: HTTP {e.code}: {e.read()[:500]!r}") from None
    except urllib.error.URLError as e:
        raise BenchError(f"POST {url}: {e.reason}") from None


def _get_json(url: str, timeout: float = 10.0) -> dict | None:
    """GET a JSON document, None when the server has no such endpoint or it is not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ValueError, OSError):
        return None


def chat_body(prompt: dict, args: argparse.Namespace, **extra) -> dict:
    """Greedy chat request for `prompt`: temperature 0, fixed max_tokens, EOS honoured."""
    return {"model": args.served_model, "messages": prompt["messages"], "temperature": 0,
            "max_tokens": args.max_tokens, **extra}


@dataclass
class Reply:
    """One finished request: completion tokens, client wall time, TTFT (streamed only), meta_info
    (`return_meta_info` only), token ids and AR-side top-2 logprobs (parity requests only)."""

    completion_tokens: int
    wall_s: float
    ttft_s: float | None = None
    meta_info: dict = field(default_factory=dict)
    token_ids: list[int] | None = None
    top2: list[list[float]] | None = None
    prompt_token_ids: list[int] | None = None


def _completion_tokens(usage: dict | None, where: str) -> int:
    if not usage or not isinstance(usage.get("completion_tokens"), int):
        raise BenchError(f"{where}: response has no usage.completion_tokens")
    return usage["completion_tokens"]


def send_streamed(base: str, body: dict, timeout: float) -> Reply:
    """Stream a chat completion (SSE); TTFT = time to the first chunk with content (text,
    reasoning or a tool call), completion tokens from the final usage chunk."""
    url = f"{base}/v1/chat/completions"
    t0 = time.perf_counter()
    ttft, usage = None, None
    with _post(url, {**body, "stream": True, "stream_options": {"include_usage": True}}, timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"{url}: error in stream: {chunk['error']}")
            usage = chunk.get("usage") or usage
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if ttft is None and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
                ttft = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return Reply(_completion_tokens(usage, url + " (stream)"), wall, ttft if ttft is not None else wall)


def send_with_meta(base: str, body: dict, timeout: float, parity: bool = False, logprobs: bool = False) -> Reply:
    """A non-streamed chat completion with SGLang's `return_meta_info`; for parity also the
    generated token ids (`return_token_ids`), and with `logprobs` each position's top-2 logprobs."""
    url = f"{base}/v1/chat/completions"
    extra = {"return_meta_info": True}
    if parity:
        extra["return_token_ids"] = True
    if logprobs:
        extra.update(logprobs=True, top_logprobs=2)
    t0 = time.perf_counter()
    with _post(url, {**body, **extra}, timeout) as r:
        payload = json.loads(r.read())
    wall = time.perf_counter() - t0
    choices = payload.get("choices") or []
    if not choices:
        raise BenchError(f"{url}: response has no choices: {str(payload)[:300]}")
    choice = choices[0]
    reply = Reply(_completion_tokens(payload.get("usage"), url), wall, meta_info=choice.get("meta_info") or {})
    if parity:
        reply.token_ids = choice.get("token_ids")
        if not isinstance(reply.token_ids, list):
            raise BenchError(f"{url}: no choices[0].token_ids although return_token_ids was set")
        reply.prompt_token_ids = choice.get("prompt_token_ids")  # SGLang adds them with return_token_ids
    if logprobs:
        content = (choice.get("logprobs") or {}).get("content")
        if content is None:
            raise BenchError(f"{url}: no choices[0].logprobs.content although logprobs were asked for")
        reply.top2 = [sorted((t["logprob"] for t in item.get("top_logprobs") or []), reverse=True)
                      for item in content]
    return reply


def run_level(base: str, prompts: list[dict], concurrency: int, args: argparse.Namespace) -> tuple[dict, list[Reply]]:
    """All prompts at `concurrency` requests in flight: the level's throughput, TTFT and accept
    length, and its non-streamed replies (wall time and meta_info each)."""

    def one(i: int) -> tuple[int, Reply]:
        body = chat_body(prompts[i], args)
        if i % 2 == 0:
            return i, send_streamed(base, body, args.request_timeout)
        return i, send_with_meta(base, body, args.request_timeout)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        replies = [r for _, r in sorted(pool.map(one, range(len(prompts))))]
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in replies)
    ttfts = [r.ttft_s * 1e3 for r in replies if r.ttft_s is not None]
    with_meta = [r for r in replies if r.ttft_s is None]
    return {
        "concurrency": concurrency,
        "prompts": len(prompts),
        "completion_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "ttft_ms": statistics.fmean(ttfts),
        "ttft_p50_ms": statistics.median(ttfts),
        "accept_len": accept_length(with_meta),
    }, with_meta


def accept_length(replies: list[Reply]) -> float:
    """Sum completion tokens / sum spec_verify_ct over the replies that carry spec_verify_ct; 1.0
    when none does (a server without speculative decoding reports no spec fields)."""
    spec = [r for r in replies if r.meta_info.get("spec_verify_ct")]
    if not spec:
        return 1.0
    return sum(r.completion_tokens for r in spec) / sum(r.meta_info["spec_verify_ct"] for r in spec)


def parity_pass(base: str, prompts: list[dict], args: argparse.Namespace, logprobs: bool,
                concurrency: int = 1) -> list[Reply]:
    """Every prompt once with token ids and meta_info, `concurrency` in flight (1: one at a time);
    top-2 logprobs on the AR server only, the reference whose gap classifies a divergence (a spec
    server is not asked for them). The AR control (`--ar-control C`) is the AR server's pass again at
    C in flight: plain decoding against itself at another batch size, the server's own bf16 band."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: send_with_meta(base, chat_body(p, args), args.request_timeout, parity=True,
                                                      logprobs=logprobs), prompts))


# ---------------------------------------------------------------------------------------------
# Parity and ceiling arithmetic
# ---------------------------------------------------------------------------------------------

def classify(ar: Reply, spec: Reply, near_tie_nats: float) -> dict:
    """`{"kind": "identical"|"near_tie"|"other", "position", "gap"}` for one prompt: the first
    position where the token ids differ and the AR server's top-2 logprob gap there."""
    a, b = ar.token_ids or [], spec.token_ids or []
    if a == b:
        return {"kind": "identical", "position": None, "gap": None}
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    top = ar.top2[k] if ar.top2 and k < len(ar.top2) else []
    gap = top[0] - top[1] if len(top) >= 2 else None
    return {"kind": verdict(gap, near_tie_nats), "position": k, "gap": gap}


# The server returns fp32 logprobs, so a gap of exactly two bf16 steps can arrive as 0.25000006.
LOGPROB_GAP_TOLERANCE = 1e-5


def verdict(gap: float | None, near_tie_nats: float) -> str:
    """"near_tie" when the AR server's top-2 gap at the divergence is at most `near_tie_nats`
    (up to fp32 rounding of the logprobs, `LOGPROB_GAP_TOLERANCE`)."""
    return "near_tie" if gap is not None and gap <= near_tie_nats + LOGPROB_GAP_TOLERANCE else "other"


def gap_histogram(divergences: list[dict]) -> dict[str, int]:
    """Divergences per AR top-2 gap (nats, 3 decimals; "none" where the AR server had no logprobs)."""
    counts: dict[str, int] = {}
    for d in divergences:
        key = "none" if d["gap"] is None else f"{d['gap']:.3f}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def parity_summary(ar: list[Reply], spec: list[Reply], prompts: list[dict], near_tie_nats: float) -> dict:
    """The schema's parity counts, plus each divergence (prompt id, position, gap)."""
    verdicts = [classify(a, s, near_tie_nats) for a, s in zip(ar, spec)]
    divergences = [{"id": p["id"], **v} for p, v in zip(prompts, verdicts) if v["kind"] != "identical"]
    return summarize_parity(len(verdicts), divergences, near_tie_nats)


def summarize_parity(prompts: int, divergences: list[dict], near_tie_nats: float) -> dict:
    """The schema's counts for `divergences` (each with its "gap") judged at `near_tie_nats`."""
    divergences = [{**d, "kind": verdict(d["gap"], near_tie_nats)} for d in divergences]
    kinds = [d["kind"] for d in divergences]
    return {
        "prompts": prompts,
        "identical": prompts - len(divergences),
        "near_tie_divergences": kinds.count("near_tie"),
        "other_divergences": kinds.count("other"),
        "near_tie_nats": near_tie_nats,
        "gap_histogram": gap_histogram(divergences),
        "divergences": divergences,
    }


PARITY_KEYS = ("parity", "parity_ablation", "parity_ar_control")


def prefill_next_token(base: str, input_ids: list[int], timeout: float) -> dict:
    """The server's greedy next token after `input_ids`, computed by one prefill: the radix cache
    is flushed first (nothing of the prefix comes from decode-time KV), then native `/generate`
    with one new token and its top-2 logprobs. `{"token": id, "top2": [[logprob, id], ...]}`."""
    with _post(f"{base}/flush_cache", {}, timeout) as r:
        r.read()
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            "return_logprob": True, "top_logprobs_num": 2}
    with _post(f"{base}/generate", body, timeout) as r:
        payload = json.loads(r.read())
    try:
        top = (payload["meta_info"]["output_top_logprobs"] or [])[0]
        top2 = sorted(([float(e[0]), int(e[1])] for e in top), reverse=True)
        token = int((payload.get("output_ids") or [top2[0][1]])[0])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise BenchError(f"{base}/generate: no output token with top logprobs in {str(payload)[:300]} ({e})") from None
    return {"token": token, "top2": top2}


def prefill_check(base: str, ar: list[Reply], other: list[Reply], block: dict, prompts: list[dict],
                  timeout: float) -> dict:
    """Add `prefill` to every divergence of `block` (a parity summary of `ar` against `other`,
    prompt order) and `prefill_picks` to the block: which side the AR server's one-pass prefill of
    prompt + common prefix takes at the divergence ("spec" = `other`'s token, "ar", "neither")."""
    index = {p["id"]: i for i, p in enumerate(prompts)}
    picks = {"spec": 0, "ar": 0, "neither": 0}
    for d in block["divergences"]:
        a, b = ar[index[d["id"]]], other[index[d["id"]]]
        if a.prompt_token_ids is None:
            raise BenchError("the AR server returned no choices[0].prompt_token_ids with return_token_ids "
                             "(SGLang >= 0.5.17 does): --prefill-check needs them")
        k = d["position"]
        got = prefill_next_token(base, a.prompt_token_ids + a.token_ids[:k], timeout)
        ar_token = a.token_ids[k] if k < len(a.token_ids) else None
        spec_token = b.token_ids[k] if k < len(b.token_ids) else None
        side = "spec" if got["token"] == spec_token else "ar" if got["token"] == ar_token else "neither"
        picks[side] += 1
        d["prefill"] = {**got, "ar_token": ar_token, "spec_token": spec_token, "picks": side}
    block["prefill_picks"] = picks
    return block


def reclassify(results: dict, near_tie_nats: float) -> dict:
    """`results` with every parity block re-judged at `near_tie_nats` from its stored gaps (the
    measurement is unchanged; the threshold used before is kept as `measured_near_tie_nats`)."""
    for key in PARITY_KEYS:
        block = results.get(key)
        if not block or "divergences" not in block:
            continue
        first = block.get("measured_near_tie_nats", block.get("near_tie_nats"))
        results[key] = {**block, **summarize_parity(block["prompts"], block["divergences"], near_tie_nats),
                        "measured_near_tie_nats": first}
    results.setdefault("settings", {})["near_tie_nats"] = near_tie_nats
    return results


def ceiling(ar: list[Reply], spec: list[Reply]) -> dict:
    """T_step from the AR server's, T_round and tau from the DSPINE server's non-streamed requests
    of the concurrency-1 level (one request at a time, same request shape on both)."""
    verify = sum(r.meta_info.get("spec_verify_ct") or 0 for r in spec)
    if not verify:
        raise BenchError("the DSPINE server returned no meta_info.spec_verify_ct: cannot measure T_round or tau")
    tokens = sum(r.completion_tokens for r in spec)
    t_step = sum(r.wall_s for r in ar) / sum(r.completion_tokens for r in ar)
    t_round = sum(r.wall_s for r in spec) / verify
    tau = tokens / verify
    return {"t_step_ms": t_step * 1e3, "t_round_ms": t_round * 1e3, "accept_len": tau,
            "speedup": tau * t_step / t_round}


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

class UrlLauncher:
    """Servers already running: `urls` maps a config name to its base URL (key "*" = any)."""

    def __init__(self, urls: dict[str, str]):
        self.urls = urls

    def start(self, name: str, flags: list[str]) -> str:
        url = self.urls.get(name) or self.urls.get("*")
        if not url:
            raise BenchError(f"no --url for config {name}")
        return url.rstrip("/")

    def stop(self, name: str) -> None:
        """Nothing to stop: the server belongs to whoever started it."""


class ServeShLauncher:
    """`bash SCRIPT start FLAGS...` / `bash SCRIPT stop` with `SGL_PORT` (the GPU host's serve.sh,
    which adds its base flags and waits for /health); the log goes to `log_dir/sglang-NAME.log`."""

    def __init__(self, script: Path, port: int, log_dir: Path):
        self.script, self.port, self.log_dir = script, port, log_dir

    def _env(self, name: str) -> dict:
        return {**os.environ, "SGL_PORT": str(self.port), "SGL_LOG": str(self.log_dir / f"sglang-{name}.log")}

    def start(self, name: str, flags: list[str]) -> str:
        print(f"[{name}] starting: bash {self.script} start {shlex.join(flags)}", flush=True)
        done = subprocess.run(["bash", str(self.script), "start", *flags], env=self._env(name))
        if done.returncode:
            raise BenchError(f"{self.script} start failed for {name} (exit {done.returncode}); see the log above")
        return f"http://127.0.0.1:{self.port}"

    def stop(self, name: str) -> None:
        subprocess.run(["bash", str(self.script), "stop"], env=self._env(name))


def server_configs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Extra sglang flags per algorithm; the ablation needs `--ablation-draft`; `--spec-flags` go to
    the speculative configs only."""
    common = ["--model-path", args.model_path, *shlex.split(args.extra_flags)]
    spec = ["--speculative-algorithm", "DSPINE", "--speculative-num-draft-tokens", str(args.num_draft_tokens),
            "--speculative-draft-attention-backend", "triton", "--max-running-requests", "48"]
    spec_only = shlex.split(args.spec_flags)
    configs = {"AR": common,
               "DSPINE": [*common, *spec, "--speculative-draft-model-path", args.draft, *spec_only]}
    if args.ablation_draft:
        configs["DSPINE-ablation"] = [*common, *spec, "--speculative-draft-model-path", args.ablation_draft,
                                      *spec_only]
    return {name: flags for name, flags in configs.items() if name in args.configs}


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------

def new_results(args: argparse.Namespace) -> dict:
    return {
        "device": args.device, "date": datetime.date.today().isoformat(), "sglang": "unknown",
        "target": args.model_path, "drafter": args.draft, "command": shlex.join([sys.argv[0], *sys.argv[1:]]),
        "runs": [], "ceiling": None, "parity": None,
        "settings": {"prompts": args.prompts, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                     "near_tie_nats": args.near_tie_nats, "configs": args.configs,
                     "extra_flags": args.extra_flags, "spec_flags": args.spec_flags},
        "levels": [], "configs": {}, "errors": [],
    }


def write_results(results: dict, out_dir: Path, stem: str = RESULTS_NAME) -> Path:
    """Rewrite `stem`.json (atomically) after every measurement."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)
    return path


def check_schema(value, schema, where: str = "results") -> None:
    """Raise BenchError where `value` does not follow `schema` (a RESULTS_SCHEMA-style template;
    extra keys are allowed, ints pass for floats)."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise BenchError(f"{where}: expected an object")
        for key, sub in schema.items():
            if key not in value:
                raise BenchError(f"{where}: missing key {key!r}")
            check_schema(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        if not isinstance(value, list):
            raise BenchError(f"{where}: expected a list")
        for i, item in enumerate(value):
            check_schema(item, schema[0], f"{where}[{i}]")
    elif not (isinstance(value, schema) or (schema is float and isinstance(value, int))) or isinstance(value, bool):
        raise BenchError(f"{where}: expected {schema.__name__}, got {value!r}")


def speedups(results: dict) -> dict[str, dict[int, float]]:
    """Throughput over AR's at the same concurrency, per speculative algorithm."""
    ar = {r["concurrency"]: r["output_tok_per_s"] for r in results["runs"] if r["algorithm"] == "AR"}
    out: dict[str, dict[int, float]] = {}
    for r in results["runs"]:
        if r["algorithm"] != "AR" and r["concurrency"] in ar:
            out.setdefault(r["algorithm"], {})[r["concurrency"]] = r["output_tok_per_s"] / ar[r["concurrency"]]
    return out


def plot(results: dict, out_dir: Path, stem: str = RESULTS_NAME) -> Path | None:
    """`stem`.png: speedup over AR vs concurrency; None (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot; run `--plot-only` where it is installed", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in speedups(results).items():
        xs = sorted(curve)
        ax.plot(xs, [curve[x] for x in xs], marker="o", label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="AR")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s over AR")
    ax.set_title(f"{Path(results['target']).name} on {results['device']} (SGLang {results['sglang']})")
    ax.legend()
    fig.tight_layout()
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def level_prompts(args: argparse.Namespace, concurrency: int) -> int:
    """Prompts sent at one concurrency level: at least --prompts, and --waves full waves."""
    return max(args.prompts, args.waves * concurrency)


def estimate_s(args: argparse.Namespace, n_configs: int, managed: bool) -> float:
    """Rough wall time: server starts/stops plus decode at an assumed `--assume-tok-per-s` per
    stream, concurrency c running c streams at once (an optimistic lower bound at high c)."""
    levels = sum(level_prompts(args, c) * args.max_tokens / (args.assume_tok_per_s * c) for c in args.concurrency)
    per_config = levels + args.prompts * args.max_tokens / args.assume_tok_per_s  # + the concurrency-1 parity pass
    return n_configs * (per_config + (SERVER_START_S + SERVER_STOP_S if managed else 0.0))


def measure_config(name: str, base: str, prompts: list[dict], args: argparse.Namespace, results: dict,
                   out_dir: Path) -> tuple[list[Reply], list[Reply]]:
    """Levels, then the parity pass, for one running server; results written after each level.
    Returns the parity replies and the concurrency-1 level's non-streamed replies."""
    info = _get_json(f"{base}/server_info") or {}
    results["configs"].setdefault(name, {}).update(url=base, server_version=info.get("version"))
    if info.get("version"):
        results["sglang"] = info["version"]
    send_with_meta(base, chat_body(prompts[0], args), args.request_timeout)  # warm-up: first-request costs
    c1: list[Reply] = []
    for c in args.concurrency:
        level, with_meta = run_level(base, prompts[:level_prompts(args, c)], c, args)
        c1 = with_meta if c == 1 else c1
        results["levels"].append({"algorithm": name, **level})
        results["runs"].append({"algorithm": name, "concurrency": c, "output_tok_per_s": level["output_tok_per_s"],
                                "accept_len": level["accept_len"], "ttft_ms": level["ttft_ms"]})
        write_results(results, out_dir, args.results_name)
        print(f"[{name}] c={c}: {level['output_tok_per_s']:.0f} tok/s, TTFT {level['ttft_ms']:.0f} ms "
              f"(p50 {level['ttft_p50_ms']:.0f}), accept {level['accept_len']:.2f}, {level['wall_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    replies = parity_pass(base, prompts[:args.prompts], args, logprobs=name == "AR")
    print(f"[{name}] parity pass: {len(replies)} prompts in {time.perf_counter() - t0:.1f} s", flush=True)
    if name == "AR" and args.ar_control > 1:
        control = parity_pass(base, prompts[:args.prompts], args, logprobs=False, concurrency=args.ar_control)
        results["parity_ar_control"] = {**parity_summary(replies, control, prompts[:args.prompts], args.near_tie_nats),
                                        "concurrency": args.ar_control}
        summary = results["parity_ar_control"]
        print(f"[AR] control at concurrency {args.ar_control}: {summary['identical']} of {summary['prompts']} "
              f"identical to the serial pass, gaps {summary['gap_histogram']}", flush=True)
        if args.prefill_check:
            prefill_check(base, replies, control, summary, prompts[:args.prompts], args.request_timeout)
    return replies, c1


def run_prefill_checks(base: str, results: dict, passes: dict[str, list[Reply]], prompts: list[dict],
                       args: argparse.Namespace) -> None:
    """--prefill-check on the running AR server, for the DSPINE and DSPINE-ablation parity blocks."""
    for key, name in (("parity", "DSPINE"), ("parity_ablation", "DSPINE-ablation")):
        if results.get(key) and name in passes:
            block = prefill_check(base, passes["AR"], passes[name], results[key], prompts[:args.prompts],
                                  args.request_timeout)
            print(f"[AR] prefill check of {name}'s divergences: {block['prefill_picks']}", flush=True)


def finish_comparison(results: dict, passes: dict[str, list[Reply]], c1: dict[str, list[Reply]],
                      prompts: list[dict], args) -> None:
    """Parity and ceiling once the AR and DSPINE measurements are both in."""
    if "AR" not in passes or "DSPINE" not in passes:
        return
    parity_prompts = prompts[:args.prompts]
    results["parity"] = parity_summary(passes["AR"], passes["DSPINE"], parity_prompts, args.near_tie_nats)
    if "DSPINE-ablation" in passes:
        results["parity_ablation"] = parity_summary(passes["AR"], passes["DSPINE-ablation"], parity_prompts,
                                                    args.near_tie_nats)
    try:
        if not c1["AR"] or not c1["DSPINE"]:
            raise BenchError("the ceiling needs concurrency 1 among --concurrency")
        results["ceiling"] = ceiling(c1["AR"], c1["DSPINE"])
    except BenchError as e:
        if f"ceiling: {e}" not in results["errors"]:  # called again after the ablation
            results["errors"].append(f"ceiling: {e}")
        return
    c1 = speedups(results).get("DSPINE", {}).get(1)
    if c1 is not None:
        results["ceiling"]["achieved_speedup"] = c1
        results["ceiling"]["achieved_fraction"] = c1 / results["ceiling"]["speedup"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--url", action="append", default=[],
                   help="running server(s): URL for every config, or NAME=URL (repeatable); no server is started")
    p.add_argument("--serve-script", type=Path, default=Path(".gpu/host/serve.sh"))
    p.add_argument("--port", type=int, default=30000, help="SGL_PORT for --serve-script")
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(ALGORITHMS),
                   help="comma-separated subset of " + ",".join(ALGORITHMS))
    p.add_argument("--model-path", default=os.environ.get("SMOLLM2", "HuggingFaceTB/SmolLM2-135M-Instruct"))
    p.add_argument("--draft", default="dspine/checkpoints/dspine-smollm2-135m-instruct")
    p.add_argument("--ablation-draft", default=None, help="drafter for DSPINE-ablation (skipped without it)")
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--extra-flags", default="--cuda-graph-max-bs-decode 64",
                   help="sglang flags added to every config (serve.sh adds its base flags itself)")
    p.add_argument("--spec-flags", default="",
                   help="sglang flags added to the speculative configs only (DSPINE, DSPINE-ablation), e.g. "
                        "\"--enable-linear-replayssm-spec --linear-replayssm-cache-len 32\" on a hybrid GDN target")
    p.add_argument("--served-model", default="default", help="the `model` field of requests")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--waves", type=int, default=4,
                   help="each level sends at least waves x concurrency prompts (and at least --prompts)")
    p.add_argument("--ar-control", type=int, default=0, metavar="C",
                   help="after its parity pass, the AR server answers the parity prompts again with C in flight; "
                        "`parity_ar_control` compares the two AR passes like a DSPINE one (plain decoding against "
                        "itself at another batch size: the divergences and gaps bf16 alone produces on this server)")
    p.add_argument("--prefill-check", action="store_true",
                   help="measure the AR server last and, at every divergence, ask it for its greedy next token "
                        "after a one-pass prefill of prompt + common prefix (radix cache flushed): does the "
                        "target's own multi-token forward take the speculative server's token?")
    p.add_argument("--near-tie-nats", type=float, default=0.25,
                   help="largest AR top-2 logprob gap (nats) at which a divergence counts as a bf16 near-tie")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--device", default="NVIDIA H200")
    p.add_argument("--assume-tok-per-s", type=float, default=500.0, help="per-stream decode rate for the estimate")
    p.add_argument("--results-name", default=RESULTS_NAME,
                   help="stem of the results files in --out-dir (NAME.json, NAME.png), e.g. serving_hybrid_h200")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON in --out-dir")
    p.add_argument("--reclassify", action="store_true",
                   help="re-judge the parity of the JSON in --out-dir at --near-tie-nats (stored gaps; no server)")
    args = p.parse_args(argv)
    unknown = set(args.configs) - set(ALGORITHMS)
    if unknown:
        p.error(f"unknown config(s) {sorted(unknown)}; choose from {ALGORITHMS}")
    return args


def _launcher(args: argparse.Namespace):
    if args.url:
        urls = dict(u.split("=", 1) if "=" in u.split("://")[0] else ("*", u) for u in args.url)
        return UrlLauncher(urls)
    return ServeShLauncher(args.serve_script, args.port, args.out_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        print(plot(json.loads((args.out_dir / f"{args.results_name}.json").read_text()), args.out_dir,
                   args.results_name))
        return 0
    if args.reclassify:
        results = reclassify(json.loads((args.out_dir / f"{args.results_name}.json").read_text()),
                             args.near_tie_nats)
        path = write_results(results, args.out_dir, args.results_name)
        print(json.dumps({k: {n: v for n, v in results[k].items() if n != "divergences"}
                          for k in PARITY_KEYS if k in results}, indent=2))
        print(f"wrote {path}")
        return 0
    configs = server_configs(args)
    if args.prefill_check and "AR" in configs:  # AR last: it answers for the divergences of the others
        configs = {**{n: f for n, f in configs.items() if n != "AR"}, "AR": configs["AR"]}
    if "DSPINE-ablation" in args.configs and "DSPINE-ablation" not in configs:
        print("DSPINE-ablation skipped: no --ablation-draft given", flush=True)
    prompts = load_prompt_mix(max(level_prompts(args, c) for c in [*args.concurrency, 1]))
    launcher = _launcher(args)
    est = estimate_s(args, len(configs), isinstance(launcher, ServeShLauncher))
    print(f"{len(configs)} config(s) x {args.prompts} prompts x {args.max_tokens} tokens at concurrency "
          f"{args.concurrency}: ~{est:.0f} s estimated (at {args.assume_tok_per_s:.0f} tok/s per stream)", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)  # the managed servers' logs go there from the start
    results = new_results(args)
    passes: dict[str, list[Reply]] = {}
    c1: dict[str, list[Reply]] = {}
    for name, flags in configs.items():
        results["configs"][name] = {"flags": flags}
        try:
            t0 = time.perf_counter()
            base = launcher.start(name, flags)
            results["configs"][name]["start_s"] = time.perf_counter() - t0
            passes[name], c1[name] = measure_config(name, base, prompts, args, results, args.out_dir)
            if name == "AR" and args.prefill_check:  # the AR server is measured last: both passes are in
                finish_comparison(results, passes, c1, prompts, args)
                run_prefill_checks(base, results, passes, prompts, args)
        except (BenchError, OSError) as e:
            results["errors"].append(f"{name}: {e}")
            print(f"[{name}] FAILED: {e}", flush=True)
        finally:
            launcher.stop(name)
        if not (name == "AR" and args.prefill_check):  # done above, before the prefill check annotated it
            finish_comparison(results, passes, c1, prompts, args)
        write_results(results, args.out_dir, args.results_name)
    path = write_results(results, args.out_dir, args.results_name)
    plot(results, args.out_dir, args.results_name)
    print(json.dumps({k: results[k] for k in ("ceiling", "parity")}, indent=2, default=str))
    print(f"wrote {path}", flush=True)
    if results["errors"]:
        print("errors:\n  " + "\n  ".join(results["errors"]), file=sys.stderr)
        return 1
    if {"AR", "DSPINE"} <= set(configs):  # ceiling and parity need both
        check_schema(results, RESULTS_SCHEMA)
    else:
        print("no AR + DSPINE pair in this run: ceiling and parity stay null", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
