"""`dspine gen-data`: the target regenerates answers to training prompts.

DSpine drafters learn to predict the *target's* continuations, so the training answers are the
target's own (greedy by default): ShareGPT first turns plus synthetic code/math prompts, none of
them from an evaluation set (`dspine.data.prompt_sources.training_prompts`). Output: JSONL, one sequence per
line, `{"id", "source", "ids": prompt+answer token ids, "answer_start": index of the first answer
token, "target": {"name", "fingerprint"}}` (`target_identity`: `dspine train` refuses data of another
target); written atomically, so an interrupted run leaves no partial file.

Two generators give the same records: the target in transformers (`generate`, batched, default)
or a running SGLang server of the same target (`--server URL`: native `/generate` on the chat
template's token ids, many requests in flight; much faster for large data sets). Sampled answers
(`--temperature > 0`, optionally `--top-p`/`--top-k` as the evaluation's T=1 uses) get ids
`<prompt id>#<k>`, so a file of greedy answers and one of sampled answers concatenate without
clashing ids; `--samples-per-prompt K` gives every prompt K of them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from dspine.data.prompt_sources import training_prompts
from dspine.engine.targets import (
    DEFAULT_TARGET,
    chat_prompt_ids,
    load_target,
    load_target_config,
    load_tokenizer,
    stop_token_ids,
    target_identity,
)
from dspine.utils.atomic import write_jsonl_atomic
from dspine.utils.http import HttpClient, HttpError


class GenDataError(RuntimeError):
    """A generation run cannot go on; the message names the cause and the fix."""


@torch.no_grad()
def generate_answers(target, tokenizer, prompts, *, max_prompt_tokens: int, max_new_tokens: int, batch_size: int,
                     temperature: float, seed: int, top_p: float = 1.0, top_k: int = 0, progress: bool = True):
    """Yield sequence records for `prompts` (a list of `dspine.data.prompts.Prompt`). Greedy when
    `temperature` is 0, else sampled with top-p (1 = off) and top-k (0 = off)."""
    from tqdm.auto import tqdm

    device = next(target.parameters()).device
    stops = stop_token_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    encoded = [(p, chat_prompt_ids(tokenizer, p.messages)) for p in prompts]
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt_tokens]
    encoded.sort(key=lambda x: len(x[1]))  # similar lengths per batch: less padding
    torch.manual_seed(seed)
    bar = tqdm(total=len(encoded), desc="gen-data", unit="seq", disable=not progress)
    started, produced = time.perf_counter(), 0
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        width = max(len(ids) for _, ids in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for b, (_, ids) in enumerate(chunk):  # left padding
            input_ids[b, width - len(ids):] = torch.tensor(ids)
            attention[b, width - len(ids):] = 1
        out = target.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                              max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                              # explicit top_p/top_k: None would fall back to the generation config's (top-k 50)
                              temperature=temperature if temperature > 0 else None,
                              top_p=top_p if temperature > 0 else None, top_k=top_k if temperature > 0 else None,
                              eos_token_id=stops, pad_token_id=pad)
        for b, (prompt, ids) in enumerate(chunk):
            answer = out[b, width:].tolist()
            cut = next((i + 1 for i, t in enumerate(answer) if t in stops), len(answer))
            answer = answer[:cut]
            produced += len(answer)
            yield {"id": prompt.id, "source": prompt.source, "ids": ids + answer, "answer_start": len(ids)}
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - started):.0f}")
    bar.close()


def _post_generate(url: str, body: dict, timeout: float) -> list[dict]:
    try:
        out = HttpClient(url, timeout, retries=0).post("/generate", body)
    except HttpError as e:
        if e.status is not None:
            raise GenDataError(f"{url}/generate answered HTTP {e.status}: {e.body[:300]!r}") from e
        raise GenDataError(f"no SGLang server answers at {url} ({e}); start one with the same target "
                           f"(`sglang serve --model-path ...`) or drop --server") from e
    return out if isinstance(out, list) else [out]


def server_answers(url: str, prompt_ids: list[list[int]], stops: list[int], *, max_new_tokens: int,
                   temperature: float, seed: int, top_p: float = 1.0, top_k: int = 0,
                   timeout: float = 600.0) -> list[list[int]]:
    """Answers of an SGLang server to `prompt_ids` (one batched native `/generate`), each ending
    with its stop token when generation stopped on one (as transformers' `generate` does).
    top_k 0 (off) is SGLang's -1."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": stops,
              "skip_special_tokens": False}
    if temperature > 0:
        params.update(sampling_seed=seed, top_p=top_p, top_k=top_k if top_k > 0 else -1)
    replies = _post_generate(url, {"input_ids": prompt_ids, "sampling_params": params}, timeout)
    if len(replies) != len(prompt_ids):
        raise GenDataError(f"{url}/generate returned {len(replies)} answers for {len(prompt_ids)} prompts")
    answers = []
    for reply in replies:
        if "output_ids" not in reply:
            raise GenDataError(f"{url}/generate returned no `output_ids` (keys {sorted(reply)}): is this an "
                               f"SGLang server? gen-data --server needs SGLang's native API")
        ids = list(reply["output_ids"])
        finish = (reply.get("meta_info") or {}).get("finish_reason") or {}
        matched = finish.get("matched") if isinstance(finish, dict) else None
        if isinstance(matched, int) and matched in stops and (not ids or ids[-1] != matched):
            ids.append(matched)
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        answers.append(ids[:cut])
    return answers


def generate_answers_server(url: str, tokenizer, stops: list[int], prompts, *, max_prompt_tokens: int,
                            max_new_tokens: int, batch_size: int, concurrency: int, temperature: float,
                            seed: int, top_p: float = 1.0, top_k: int = 0, progress: bool = True):
    """Like `generate_answers`, through an SGLang server: batches of `batch_size` prompts,
    `concurrency` batches in flight. Records come in prompt order."""
    from tqdm.auto import tqdm

    encoded = [(p, chat_prompt_ids(tokenizer, p.messages)) for p in prompts]
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt_tokens]
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]

    def run(index: int) -> list[list[int]]:
        chunk = batches[index]
        return server_answers(url, [ids for _, ids in chunk], stops, max_new_tokens=max_new_tokens,
                              temperature=temperature, seed=seed + index, top_p=top_p, top_k=top_k)

    bar = tqdm(total=len(encoded), desc="gen-data", unit="seq", disable=not progress)
    started, produced = time.perf_counter(), 0
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for chunk, answers in zip(batches, pool.map(run, range(len(batches)))):
            for (prompt, ids), answer in zip(chunk, answers):
                produced += len(answer)
                yield {"id": prompt.id, "source": prompt.source, "ids": ids + answer, "answer_start": len(ids)}
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - started):.0f}")
    bar.close()


def _repeat_for_samples(prompts, k: int, sampled: bool):
    """Each prompt k times, ids `<id>#<j>`; greedy answers (`sampled` False, k = 1) keep the ids."""
    if not sampled:
        return list(prompts)
    return [type(p)(f"{p.id}#{j}", p.messages, p.source) for p in prompts for j in range(k)]


def run_gen_data(args) -> int:
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
    prompts = training_prompts(args.num_prompts, seed=args.seed, data_dir=getattr(args, "data_dir", None),
                               prompts_dir=getattr(args, "prompts_dir", None))
    prompts = _repeat_for_samples(prompts, args.samples_per_prompt, sampled=args.temperature > 0)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.server:
        tokenizer, stops = load_tokenizer(args.target)
        target_config = load_target_config(args.target)
        records = generate_answers_server(args.server, tokenizer, stops, prompts,
                                          max_prompt_tokens=args.max_prompt_tokens,
                                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                          concurrency=args.concurrency, seed=args.seed, progress=not args.quiet,
                                          **sampling)
    else:
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        target, tokenizer = load_target(args.target, dtype=dtype, device=device)
        target_config = target.config
        if device.startswith("cuda"):
            target.generation_config.cache_implementation = None
        records = generate_answers(target, tokenizer, prompts, max_prompt_tokens=args.max_prompt_tokens,
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   seed=args.seed, progress=not args.quiet, **sampling)
    identity = target_identity(target_config, args.target or DEFAULT_TARGET)
    stamp = {"name": identity["name"], "fingerprint": identity["fingerprint"]}
    count = 0

    def stamped():
        nonlocal count
        for rec in records:
            count += 1
            yield {**rec, "target": stamp}

    write_jsonl_atomic(args.out, stamped())
    print(f"dspine gen-data: wrote {count} sequences to {args.out}")
    return 0
