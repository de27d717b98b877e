"""The serving benchmark's load: greedy chat completions sent to an SGLang server at a fixed
concurrency, and what each reply reports.

Even-numbered requests of a level are streamed (SSE, `stream_options.include_usage`) and give the
time to the first content chunk; odd-numbered ones are not streamed and carry SGLang's
`return_meta_info`, whose `spec_verify_ct` gives the accept length. SGLang rejects
`return_meta_info` with `stream=true` and puts no speculative fields in streamed chunks, hence the
split; both halves load the server the same way (`run_level(..., streamed=False)`: no streamed half,
every request carries meta_info, when no TTFT is wanted). Requests are never retried: a retry would
hide a failure inside a timed level.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dspine.bench.results import BenchError
from dspine.data.eval_sets import EVAL_SETS, load_eval_set
from dspine.data.prompts import load_prompts
from dspine.utils.http import HttpClient

CHAT = "/v1/chat/completions"


def load_set_prompts(name: str, n: int, prompts_dir: Path | None = None, skip: int = 0) -> list[dict]:
    """Prompts `skip` .. `skip + n - 1` of evaluation set `name` (file order) as dicts `{"id",
    "source", "messages"}`; with `prompts_dir`, read from its export `eval-<name>.jsonl`
    (`dspine.data.prompt_sources.export_prompts`; for machines without the data packages)."""
    if prompts_dir is None:
        prompts = load_eval_set(name, skip + n)
    else:
        path = Path(prompts_dir) / f"eval-{name}.jsonl"
        if not path.is_file():
            raise BenchError(f"--prompts-dir {prompts_dir} has no {path.name}: export the prompts there "
                             "(dspine.data.prompt_sources.export_prompts)")
        prompts = load_prompts(path)[: skip + n]
    return [{"id": p.id, "source": p.source, "messages": p.messages} for p in prompts[skip:]]


def load_prompt_mix(n: int, prompts_dir: Path | None = None, skip: int = 0) -> list[dict]:
    """`n` prompts, round-robin over the five evaluation sets (each set's prompts from index `skip`
    on, file order, `load_set_prompts`): dicts `{"id", "source", "messages"}`."""
    per_set = math.ceil(n / len(EVAL_SETS))
    sets = [load_set_prompts(name, per_set, prompts_dir, skip) for name in EVAL_SETS]
    mixed = [s[i] for i in range(per_set) for s in sets if i < len(s)]
    if len(mixed) < n:
        raise BenchError(f"only {len(mixed)} evaluation prompts available (after skipping {skip} a set), "
                         f"{n} asked for")
    return mixed[:n]


def load_trace_prompts(path: Path, n: int | None = None, skip: int = 0, split: str = "all") -> list[dict]:
    """Requests `skip` .. `skip + n - 1` (n None: to the end) of a trace file's `split` (file order;
    `dspine.data.traces`): dicts `{"id", "source", "messages", "tools"}`, multi-turn and as long as
    the traces' contexts (`python -m dspine.data.agentic` writes coding-agent sessions and long
    threads of 2k-6k tokens). Raises BenchError naming the file when it is missing or invalid."""
    from dspine.data.traces import TraceError, load_traces

    try:
        requests = load_traces([path], split)
    except TraceError as exc:
        raise BenchError(f"trace workload {path}: {exc}") from None
    return [{"id": r.source, "source": Path(path).stem, "messages": list(r.messages), "tools": list(r.tools)}
            for r in requests[skip: None if n is None else skip + n]]


def chat_body(prompt: dict, model: str, max_tokens: int, **extra) -> dict:
    """Greedy chat request for `prompt` (its `messages`, and its `tools` when it has any):
    temperature 0, fixed max_tokens, EOS honoured."""
    tools = {"tools": prompt["tools"]} if prompt.get("tools") else {}
    return {"model": model, "messages": prompt["messages"], **tools, "temperature": 0, "max_tokens": max_tokens,
            **extra}


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


def completion_tokens(usage: dict | None, where: str) -> int:
    """`usage.completion_tokens` of a reply; BenchError naming `where` when it is missing."""
    if not usage or not isinstance(usage.get("completion_tokens"), int):
        raise BenchError(f"{where}: response has no usage.completion_tokens")
    return usage["completion_tokens"]


def send_streamed(base: str, body: dict, timeout: float) -> Reply:
    """Stream a chat completion (SSE); TTFT = time to the first chunk with content (text,
    reasoning or a tool call), completion tokens from the final usage chunk."""
    client = HttpClient(base, timeout, retries=0)
    t0 = time.perf_counter()
    ttft, usage = None, None
    for raw in client.stream_lines(CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}}):
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise BenchError(f"{base}{CHAT}: error in stream: {chunk['error']}")
        usage = chunk.get("usage") or usage
        delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
        if ttft is None and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
            ttft = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return Reply(completion_tokens(usage, f"{base}{CHAT} (stream)"), wall, ttft if ttft is not None else wall)


def send_with_meta(base: str, body: dict, timeout: float, parity: bool = False, logprobs: bool = False) -> Reply:
    """A non-streamed chat completion with SGLang's `return_meta_info`; for parity also the
    generated token ids (`return_token_ids`), and with `logprobs` each position's top-2 logprobs."""
    url = f"{base}{CHAT}"
    extra = {"return_meta_info": True}
    if parity:
        extra["return_token_ids"] = True
    if logprobs:
        extra.update(logprobs=True, top_logprobs=2)
    t0 = time.perf_counter()
    payload = HttpClient(base, timeout, retries=0).post(CHAT, {**body, **extra})
    wall = time.perf_counter() - t0
    choices = payload.get("choices") or []
    if not choices:
        raise BenchError(f"{url}: response has no choices: {str(payload)[:300]}")
    choice = choices[0]
    reply = Reply(completion_tokens(payload.get("usage"), url), wall, meta_info=choice.get("meta_info") or {})
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


def decode_steps(replies: list[Reply]) -> int:
    """The decode steps (speculative rounds) behind the replies: sum spec_verify_ct where a reply
    carries it, else one step per completion token (plain decoding)."""
    return sum(int(r.meta_info.get("spec_verify_ct") or 0) or r.completion_tokens for r in replies)


def accept_length(replies: list[Reply]) -> float:
    """Sum completion tokens / sum spec_verify_ct over the replies that carry spec_verify_ct; 1.0
    when none does (a server without speculative decoding reports no spec fields)."""
    spec = [r for r in replies if r.meta_info.get("spec_verify_ct")]
    if not spec:
        return 1.0
    return sum(r.completion_tokens for r in spec) / sum(r.meta_info["spec_verify_ct"] for r in spec)


def run_level(base: str, bodies: list[dict], concurrency: int, timeout: float,
              streamed: bool = True) -> tuple[dict, list[Reply]]:
    """Every request body at `concurrency` in flight: the level's throughput, TTFT and accept
    length, and its non-streamed replies (wall time and meta_info each). `streamed=False`: every
    request is non-streamed with meta_info (the accept length from all of them; TTFT fields None)."""

    def one(i: int) -> tuple[int, Reply]:
        if streamed and i % 2 == 0:
            return i, send_streamed(base, bodies[i], timeout)
        return i, send_with_meta(base, bodies[i], timeout)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        replies = [r for _, r in sorted(pool.map(one, range(len(bodies))))]
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in replies)
    ttfts = [r.ttft_s * 1e3 for r in replies if r.ttft_s is not None]
    with_meta = [r for r in replies if r.ttft_s is None]
    return {
        "concurrency": concurrency,
        "prompts": len(bodies),
        "completion_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "ttft_ms": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
        "accept_len": accept_length(with_meta),
        "steps": decode_steps(with_meta) if len(with_meta) == len(replies) else None,
    }, with_meta


def parity_pass(base: str, bodies: list[dict], timeout: float, logprobs: bool, concurrency: int = 1) -> list[Reply]:
    """Every body once with token ids and meta_info, `concurrency` in flight (1: one at a time);
    top-2 logprobs on the AR server only, the reference whose gap classifies a divergence (a spec
    server is not asked for them). The AR control (`--ar-control C`) is the AR server's pass again at
    C in flight: plain decoding against itself at another batch size, the server's own bf16 band."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda b: send_with_meta(base, b, timeout, parity=True, logprobs=logprobs), bodies))


def prefill_next_token(base: str, input_ids: list[int], timeout: float) -> dict:
    """The server's greedy next token after `input_ids`, computed by one prefill: the radix cache
    is flushed first (nothing of the prefix comes from decode-time KV), then native `/generate`
    with one new token and its top-2 logprobs. `{"token": id, "top2": [[logprob, id], ...]}`."""
    client = HttpClient(base, timeout, retries=0)
    client.request_raw("/flush_cache", {})  # SGLang answers in plain text
    payload = client.post("/generate", {"input_ids": input_ids,
                                        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
                                        "return_logprob": True, "top_logprobs_num": 2})
    try:
        top = (payload["meta_info"]["output_top_logprobs"] or [])[0]
        top2 = sorted(([float(e[0]), int(e[1])] for e in top), reverse=True)
        token = int((payload.get("output_ids") or [top2[0][1]])[0])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise BenchError(f"{base}/generate: no output token with top logprobs in {str(payload)[:300]} ({e})") from None
    return {"token": token, "top2": top2}
