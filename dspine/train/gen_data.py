"""`dspine gen-data`: the target regenerates answers to training prompts.

DSpine drafters learn to predict the *target's* continuations, so the training answers are the
target's own (greedy by default): ShareGPT first turns plus synthetic code/math prompts, none of
them from an evaluation set (`dspine.datasets.training_prompts`). Output: JSONL, one sequence per
line, `{"id", "source", "ids": prompt+answer token ids, "answer_start": index of the first answer
token}`; written to a temporary file and renamed, so an interrupted run leaves no partial file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from dspine.datasets import training_prompts
from dspine.targets import chat_prompt_ids, load_target, stop_token_ids


@torch.no_grad()
def generate_answers(target, tokenizer, prompts, *, max_prompt_tokens: int, max_new_tokens: int, batch_size: int,
                     temperature: float, seed: int, progress: bool = True):
    """Yield sequence records for `prompts` (a list of `dspine.datasets.Prompt`)."""
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
                              temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
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


def run_gen_data(args) -> int:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    target, tokenizer = load_target(args.target, dtype=dtype, device=args.device)
    if args.device.startswith("cuda"):
        target.generation_config.cache_implementation = None
    prompts = training_prompts(args.num_prompts, seed=args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    count = 0
    try:
        with open(tmp, "w") as f:
            for rec in generate_answers(target, tokenizer, prompts, max_prompt_tokens=args.max_prompt_tokens,
                                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                        temperature=args.temperature, seed=args.seed, progress=not args.quiet):
                f.write(json.dumps(rec) + "\n")
                count += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"dspine gen-data: wrote {count} sequences to {out}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--target", default=None, help="target (default: smollm2-135m-instruct)")
    p.add_argument("--out", required=True, help="output JSONL path")
    p.add_argument("--num-prompts", type=int, default=None, help="how many training prompts (default: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy answers (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("-q", "--quiet", action="store_true")
