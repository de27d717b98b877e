"""`dspine gen-data`: the target regenerates the answers of training conversations.

DSpine drafters learn to predict the *target's* continuations, so the training answers are the
target's own (greedy by default). Conversations: the built-in mix (ShareGPT first turns plus
synthetic code/math prompts, and the data packages' prompts chosen with `--prompt-sources`:
`dspine.data.prompt_sources.training_prompts`) or `--prompts FILE`
(OpenAI chat or ShareGPT JSONL, `dspine.data.conversations`), decontaminated against the
evaluation sets and the held-out agentic traces (`gen_data_decontam`, on by default).

Output: JSONL, one record per conversation, `{"id", "source", "ids", "answer_start", "target":
{"name", "fingerprint"}}` (`target_identity`: `dspine train` refuses data of another target); a
conversation of several assistant turns has every one regenerated in order, each conditioned on the
real user/tool/system turns and the target's own earlier answers, and its record adds
`"answer_spans": [[start, end), ...]` (`gen_data_turns` states the invariants; `--max-len` drops
whole turns). Records go to `<out>.partial` as they finish and `<out>` is written atomically at
the end; `--resume` skips every id already in either (`gen_data_store`).

Two generators give the same records: the target in transformers (`generate`, batched rounds,
default) or running SGLang servers of the same target (`--server URL`, repeatable: native
`/generate` on the chat template's token ids, one request per turn, `--concurrency` in flight over
the least-loaded servers, retried with backoff, dead servers dropped: `gen_data_server`). Sampled
answers (`--temperature > 0`, optionally `--top-p`/`--top-k`) get ids `<id>#<k>`, so greedy and
sampled files concatenate without clashing ids; `--samples-per-prompt K` gives each conversation K.
A server request's sampling seed depends on (seed, id, turn) only: a resumed run asks the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from dspine.data.conversations import Conversation, ConversationError, read_conversations
from dspine.data.prompt_sources import DEFAULT_SOURCES, check_sources, training_prompts
from dspine.engine.targets import (
    DEFAULT_TARGET,
    load_target,
    load_target_config,
    load_tokenizer,
    stop_token_ids,
    target_identity,
)
from dspine.train.gen_data_decontam import build_index, decontaminate
from dspine.train.gen_data_errors import GenDataError
from dspine.train.gen_data_server import (  # noqa: F401  (server_answers: part of this module's API)
    RequestFailed,
    ServerPool,
    sampling_params,
    server_answers,
)
from dspine.train.gen_data_store import RecordStore, partial_path
from dspine.train.gen_data_turns import ChatRenderer, TemplateRefused, TurnRun

BUILTIN_MAX_PROMPT_TOKENS = 384
DEFAULTS = dict(prompts=None, server=None, concurrency=64, retries=5, retry_backoff=1.0, request_timeout=600.0,
                drop_server_after=60.0, resume=False, chat_template_kwargs=None, max_len=None, max_prompt_tokens=None,
                decontaminate=True, heldout_traces=None, data_dir=None, prompts_dir=None, num_prompts=None,
                prompt_sources=DEFAULT_SOURCES,
                samples_per_prompt=1, temperature=0.0, top_p=1.0, top_k=0, seed=0, batch_size=256,
                max_new_tokens=384, target=None, device=None, dtype="bfloat16", quiet=False)


@dataclass
class Outcome:
    """A conversation's end: `run` None when it never started (the template refused it); `error`
    None, TemplateRefused (skipped), RequestFailed (failed) or, with `fatal`, what stops the run."""

    conversation: Conversation
    run: TurnRun | None
    error: BaseException | None = None
    fatal: bool = False


def request_seed(seed: int, conversation_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{conversation_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def server_urls(values) -> list[str]:
    """`--server` values (repeatable, each maybe a comma list) -> URLs, in order, without repeats."""
    values = [values] if isinstance(values, str) else list(values or [])
    return list(dict.fromkeys(u.strip().rstrip("/") for v in values for u in v.split(",") if u.strip()))


def local_generator(target, tokenizer, stops: list[int], *, temperature: float, top_p: float = 1.0, top_k: int = 0):
    """`generate(prompts, budgets) -> answers` with transformers: one left-padded `generate` call,
    each answer cut after its first stop token and to its own budget."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]

    @torch.no_grad()
    def generate(prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        width = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for b, ids in enumerate(prompts):
            input_ids[b, width - len(ids):] = torch.tensor(ids)
            attention[b, width - len(ids):] = 1
        out = target.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                              max_new_tokens=max(budgets), do_sample=temperature > 0,
                              # explicit top_p/top_k: None would fall back to the generation config's (top-k 50)
                              temperature=temperature if temperature > 0 else None,
                              top_p=top_p if temperature > 0 else None, top_k=top_k if temperature > 0 else None,
                              eos_token_id=stops, pad_token_id=pad)
        answers = []
        for b, budget in enumerate(budgets):
            answer = out[b, width:].tolist()
            cut = next((i + 1 for i, t in enumerate(answer) if t in stops), len(answer))
            answers.append(answer[:min(cut, budget)])
        return answers

    return generate


def run_local(conversations: list[Conversation], make_run, generate, batch_size: int):
    """Outcomes with transformers: conversations sorted by first-prompt length (less padding), in
    batches of `batch_size` whose pending turns are generated together, round after round."""
    runs, out = [], []
    for conv in conversations:
        try:
            runs.append(make_run(conv))
        except TemplateRefused as exc:
            out.append(Outcome(conv, None, exc))
    yield from out
    finished = [r for r in runs if r.request() is None]
    yield from (Outcome(r.conversation, r) for r in finished)
    runs = sorted((r for r in runs if r.request() is not None), key=lambda r: len(r.request()[0]))
    for start in range(0, len(runs), batch_size):
        active = runs[start:start + batch_size]
        while active:
            asked = [r.request() for r in active]
            answers = generate([a[0] for a in asked], [a[1] for a in asked])
            still = []
            for run, answer in zip(active, answers):
                try:
                    run.accept(answer)
                except TemplateRefused as exc:
                    yield Outcome(run.conversation, run, exc)
                    continue
                if run.request() is None:
                    yield Outcome(run.conversation, run)
                else:
                    still.append(run)
            active = still


def run_served(conversations: list[Conversation], make_run, pool: ServerPool, params_for, concurrency: int):
    """Outcomes through `pool`, in the order they finish: `concurrency` daemon worker threads each
    take a conversation and ask its turns one after another. A fatal error stops every worker and
    is raised here; closing the generator early stops them too (their in-flight requests are lost)."""
    tasks: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    stop = threading.Event()
    for conv in conversations:
        tasks.put(conv)

    def work() -> None:
        while not stop.is_set():
            try:
                conv = tasks.get_nowait()
            except queue.Empty:
                return
            run = None
            try:
                run = make_run(conv)
                while (asked := run.request()) is not None:
                    if stop.is_set():
                        return
                    prompt, budget, turn = asked
                    run.accept(pool.generate(prompt, params_for(conv.id, turn, budget)))
                results.put(Outcome(conv, run))
            except (TemplateRefused, RequestFailed) as exc:
                results.put(Outcome(conv, run, exc))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
                stop.set()
                results.put(Outcome(conv, run, exc, fatal=True))
                return

    for _ in range(max(1, min(concurrency, len(conversations)))):
        threading.Thread(target=work, daemon=True, name="gen-data-worker").start()
    try:
        for _ in range(len(conversations)):
            while True:
                try:
                    outcome = results.get(timeout=0.5)
                    break
                except queue.Empty:
                    continue
            if outcome.fatal:
                raise outcome.error
            yield outcome
    finally:
        stop.set()


def _repeat_for_samples(items, k: int, sampled: bool):
    """Each conversation (or Prompt) k times, ids `<id>#<j>`; greedy answers (`sampled` False, k = 1) keep the ids."""
    if not sampled:
        return list(items)
    return [dataclasses.replace(p, id=f"{p.id}#{j}") for p in items for j in range(k)]


def _check_sampling(args) -> None:
    if args.samples_per_prompt < 1:
        raise GenDataError(f"--samples-per-prompt must be >= 1, got {args.samples_per_prompt}")
    if args.samples_per_prompt > 1 and args.temperature <= 0:
        raise GenDataError("--samples-per-prompt > 1 with greedy decoding repeats one answer: "
                           "set --temperature > 0 (e.g. 0.8)")
    if args.temperature <= 0 and (args.top_p != 1.0 or args.top_k != 0):
        raise GenDataError("--top-p/--top-k shape sampled answers and do nothing with greedy decoding: "
                           "set --temperature > 0 (the evaluation's T=1 uses --temperature 1 --top-p 0.95 --top-k 20)")
    if not 0 < args.top_p <= 1 or args.top_k < 0:
        raise GenDataError(f"--top-p must be in (0, 1] and --top-k >= 0 (0 = off), got {args.top_p} and {args.top_k}")


def load_conversations(args) -> list[Conversation]:
    """`--prompts FILE` (its first --num-prompts) or the built-in training prompts of `--prompt-sources`."""
    if args.prompts:
        if check_sources(args.prompt_sources) != DEFAULT_SOURCES:
            raise GenDataError("--prompt-sources chooses the built-in prompts and does nothing with --prompts FILE: "
                               "drop one of them")
        try:
            conversations, duplicates = read_conversations(args.prompts)
        except ConversationError as exc:
            raise GenDataError(str(exc)) from None
        if duplicates:
            print(f"dspine gen-data: {duplicates} repeated conversation(s) in {args.prompts} read once")
        return conversations[:args.num_prompts]
    try:
        prompts = training_prompts(args.num_prompts, seed=args.seed, data_dir=args.data_dir,
                                   prompts_dir=args.prompts_dir, sources=args.prompt_sources)
    except (ValueError, FileNotFoundError) as exc:
        raise GenDataError(str(exc)) from None
    return [Conversation.from_prompt(p) for p in prompts]


def _progress_bar(total: int, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="gen-data", unit="seq", disable=quiet, dynamic_ncols=True, smoothing=0.05)


def _stopped(store: RecordStore, bar, why: str) -> None:
    """Close a run that did not finish: the partial file keeps its records (an empty one goes)."""
    store.close()
    bar.close()
    if len(store) == 0:
        store.partial.unlink(missing_ok=True)
        return
    print(f"dspine gen-data: {why}; {len(store)} record(s) kept in {store.partial}: rerun the same command "
          "with --resume to continue", file=sys.stderr)


def _write_outcomes(outcomes, store: RecordStore, stamp: dict, bar, stats: Counter, first: dict) -> None:
    """Append each finished record (stamped with the target) to `store`; count the rest in `stats`
    ("failed", "refused", "too_long"; "written", "truncated", "tokens"), the first of each kind in `first`."""
    started = time.perf_counter()
    for outcome in outcomes:
        run, error = outcome.run, outcome.error
        stats["tokens"] += run.generated if run else 0
        if isinstance(error, RequestFailed):
            stats["failed"] += 1
            if "failed" not in first:
                first["failed"] = f"{outcome.conversation.id}: {error}"
                bar.write(f"dspine gen-data: warning: {first['failed']} (the run goes on)", file=sys.stderr)
        elif error is not None or (record := run.record()) is None:
            kind = "refused" if error is not None else "too_long"
            stats[kind] += 1
            first.setdefault(kind, f"{outcome.conversation.id}: {error}" if error else outcome.conversation.id)
        else:
            store.append({**record, "target": stamp})
            stats["written"] += 1
            stats["truncated"] += run.status == "truncated"
        bar.update(1)
        bar.set_postfix(tok_s=f"{stats['tokens'] / (time.perf_counter() - started):.0f}", failed=stats["failed"],
                        skipped=stats["refused"] + stats["too_long"], refresh=False)


def run_gen_data(args) -> int:
    """Exit status 0 (every conversation done or skipped), 1 (some requests failed for good: the
    others are in --out; rerun with --resume to retry them), 130 (interrupted: rerun with --resume)."""
    for key, value in DEFAULTS.items():   # callers may pass a namespace without the newer options
        if not hasattr(args, key):
            setattr(args, key, value)
    _check_sampling(args)
    if partial_path(args.out).exists() and not args.resume:
        raise GenDataError(f"{partial_path(args.out)} holds the records of an interrupted run: pass --resume to "
                           "continue it, or delete it to start over")
    urls = server_urls(args.server)
    conversations = load_conversations(args)
    if args.decontaminate:
        index, trace_files = build_index(data_dir=args.data_dir, prompts_dir=args.prompts_dir,
                                         trace_files=args.heldout_traces)
        conversations, dropped = decontaminate(conversations, index)
        traces = ", ".join(trace_files) if trace_files else "none found (--heldout-traces FILE)"
        print(f"dspine gen-data: decontamination dropped {sum(dropped.values())} conversation(s) "
              f"{dict(sorted(dropped.items()))} (evaluation sets; held-out agentic traces: {traces})")
    if not conversations:
        raise GenDataError("no conversation to generate: the prompts are empty, or decontamination dropped "
                           "them all (see above)")
    conversations = _repeat_for_samples(conversations, args.samples_per_prompt, sampled=args.temperature > 0)
    max_prompt = args.max_prompt_tokens
    if max_prompt is None and not args.prompts:
        max_prompt = BUILTIN_MAX_PROMPT_TOKENS
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if urls:
        tokenizer, stops = load_tokenizer(args.target)
        target_config = load_target_config(args.target)
    else:
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        target, tokenizer = load_target(args.target, dtype=dtype, device=device)
        target_config, stops = target.config, stop_token_ids(tokenizer, target)
        if device.startswith("cuda"):
            target.generation_config.cache_implementation = None
    identity = target_identity(target_config, args.target or DEFAULT_TARGET)
    stamp = {"name": identity["name"], "fingerprint": identity["fingerprint"]}
    renderer = ChatRenderer(tokenizer, stops, args.chat_template_kwargs)

    def make_run(conv: Conversation) -> TurnRun:
        return TurnRun(conv, renderer, max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                       max_prompt_tokens=max_prompt)

    pool = None
    if urls:
        pool = ServerPool(urls, stops, retries=args.retries, backoff_s=args.retry_backoff,
                          timeout_s=args.request_timeout, dead_after_s=args.drop_server_after)
        pool.probe()
    store = RecordStore(args.out, resume=args.resume, stamp=stamp)
    done = store.done
    pending = [c for c in conversations if c.id not in done]
    if args.resume:
        print(f"dspine gen-data: resuming: {store.resumed} record(s) kept, {len(pending)} conversation(s) to go")
    stats: Counter = Counter()
    first: dict[str, str] = {}
    bar = _progress_bar(len(pending), args.quiet)
    started = time.perf_counter()
    outcomes = None
    try:
        if pool is not None:
            pool.warn = lambda msg: bar.write(msg, file=sys.stderr)

            def params_for(conv_id: str, turn: int, budget: int) -> dict:
                return sampling_params(stops, max_new_tokens=budget, temperature=args.temperature,
                                       seed=request_seed(args.seed, conv_id, turn), top_p=args.top_p, top_k=args.top_k)

            outcomes = run_served(pending, make_run, pool, params_for, args.concurrency)
        else:
            torch.manual_seed(args.seed)
            generate = local_generator(target, tokenizer, stops, temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k)
            outcomes = run_local(pending, make_run, generate, args.batch_size)
        _write_outcomes(outcomes, store, stamp, bar, stats, first)
    except BaseException as exc:
        _stopped(store, bar, "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped")
        if isinstance(exc, KeyboardInterrupt):
            return 130
        raise
    finally:
        if outcomes is not None:
            outcomes.close()     # stops the server workers (their in-flight requests are dropped)
    bar.close()
    if len(store) == 0:
        store.close()
        store.partial.unlink(missing_ok=True)
        raise GenDataError(f"no record written: {stats['too_long']} conversation(s) too long for --max-len/"
                           f"--max-prompt-tokens (e.g. {first.get('too_long')}), {stats['refused']} refused by the "
                           f"chat template (e.g. {first.get('refused')}), {stats['failed']} failed "
                           f"(e.g. {first.get('failed')})")
    count = store.finish([c.id for c in conversations])
    print(f"dspine gen-data: wrote {count} sequences to {args.out} ({stats['written']} new, {store.resumed} "
          f"resumed; {stats['tokens']} tokens generated in {time.perf_counter() - started:.0f} s)")
    if stats["truncated"] or stats["too_long"] or stats["refused"]:
        print(f"dspine gen-data: {stats['truncated']} conversation(s) cut at a turn by --max-len; skipped "
              f"{stats['too_long']} too long (e.g. {first.get('too_long')}) and {stats['refused']} refused by the "
              f"chat template (e.g. {first.get('refused')})")
    if stats["failed"]:
        print(f"dspine gen-data: error: {stats['failed']} conversation(s) failed after --retries {args.retries} "
              f"(first: {first['failed']}); the others are in {args.out}: rerun with --resume to retry them",
              file=sys.stderr)
        return 1
    return 0


def generate_answers(target, tokenizer, prompts, *, max_prompt_tokens: int | None, max_new_tokens: int,
                     batch_size: int, temperature: float, seed: int, top_p: float = 1.0, top_k: int = 0,
                     max_len: int | None = None, template_kwargs: dict | None = None):
    """Records (without `target`) of `prompts` (Prompts or Conversations) with transformers, in
    the order they finish; skipped conversations (too long, refused by the template) yield nothing."""
    stops = stop_token_ids(tokenizer, target)
    renderer = ChatRenderer(tokenizer, stops, template_kwargs)
    conversations = [p if isinstance(p, Conversation) else Conversation.from_prompt(p) for p in prompts]
    torch.manual_seed(seed)
    generate = local_generator(target, tokenizer, stops, temperature=temperature, top_p=top_p, top_k=top_k)

    def make_run(conv):
        return TurnRun(conv, renderer, max_new_tokens=max_new_tokens, max_len=max_len,
                       max_prompt_tokens=max_prompt_tokens)

    for outcome in run_local(conversations, make_run, generate, batch_size):
        record = outcome.run.record() if outcome.run is not None and outcome.error is None else None
        if record is not None:
            yield record

