"""A training campaign's conversations: long, multi-turn, tool and code conversations at scale, the
input of `dspine gen-data --prompts` (every assistant turn blank: the target regenerates each one).

    python -m dspine.data.campaign runs/data/campaign.jsonl --coding-sessions 30000

Sources (ids unique; the file deterministic for a seed on one machine's installs, its conversations in
a seeded random order, so any range of it holds every source in proportion: a campaign regenerates
the file range by range, a range per GPU session):

* `sharegpt`: every ShareGPT V3 train-split thread whole (split parts joined, `agentic.whole_threads`),
  mostly ASCII, every turn; the held-out evaluation split never appears.
* `coding`: coding-agent sessions (`agentic.coding_session`: read_file / edit_file / run_tests turns
  around one function) over `CODE_PACKAGES`, the standard library's packages and dspine's own
  dependencies, never over the agentic dev traces' `agentic.SOURCE_PACKAGES`, and never in the dev
  traces' phrasing of the user turns (`agentic.TASK_PHRASINGS` 1.., not 0); contexts drawn in
  `CODING_LIMITS` tokens (SmolLM2's count), so long contexts that copy from themselves are in the mix.
* `tools`: BFCL multi-turn and ToolTalk requests of the dev traces' tune split only (the held-out
  split, by the same content hash as `agentic_tools.jsonl`, never appears).
* `synthetic`: templated code and math prompts (`prompt_sources.synthetic_prompts`).

Every conversation then passes gen-data's own decontamination (`gen_data_decontam`: the evaluation
sets and the held-out agentic traces), so the file is clean before any GPU time is spent; the
manifest beside it (`<out>.manifest.json`) records the counts per source, what was dropped and why,
the context lengths, the packages' versions and the file's sha256.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import platform
import random
import sys
from pathlib import Path
from typing import Iterable, Iterator

from dspine.data.agentic import (BFCL_CATEGORIES, SOURCE_PACKAGES, TASK_PHRASINGS, TokenCounter, coding_requests,
                                 percentiles, whole_threads)
from dspine.data.conversations import Conversation, parse_conversation
from dspine.data.dev_traces import bfcl_multiturn_requests, tooltalk_requests
from dspine.data.prompt_sources import synthetic_prompts
from dspine.data.sharegpt import MIN_ASCII_RATIO, iter_sharegpt, sharegpt_split
from dspine.data.traces import SHAREGPT_ROLES, TraceRequest, file_sha256
from dspine.utils.atomic import write_json_atomic, write_jsonl_atomic

CODING_LIMITS = (1024, 7168)   # context tokens of a coding session (SmolLM2's count); gen-data --max-len 8192
STDLIB_PACKAGES = ("asyncio", "collections", "concurrent", "ctypes", "email", "encodings", "html", "http",
                   "importlib", "json", "logging", "multiprocessing", "tomllib", "unittest", "urllib", "wsgiref",
                   "xml", "xmlrpc", "zoneinfo")
DEPENDENCY_PACKAGES = ("filelock", "fsspec", "gguf", "huggingface_hub", "jinja2", "networkx", "numpy", "packaging",
                       "requests", "safetensors", "sympy", "tokenizers", "torch", "tqdm", "transformers", "urllib3",
                       "yaml")   # dspine's dependencies and theirs
CODE_PACKAGES = STDLIB_PACKAGES + DEPENDENCY_PACKAGES
SOURCES = ("sharegpt", "coding", "tools", "synthetic")


def _blank_assistants(messages: Iterable[dict]) -> list[dict]:
    """Messages with every assistant turn's text blank (gen-data regenerates it; tool calls kept)."""
    return [{**m, "content": ""} if m["role"] == "assistant" else dict(m) for m in messages]


def sharegpt_conversations(conversations: Iterable[dict] | None = None,
                           min_ascii: float = MIN_ASCII_RATIO) -> Iterator[dict]:
    """Records of whole ShareGPT train-split threads (default: `whole_threads(iter_sharegpt())`):
    every turn, assistant text blank; threads of another speaker, without a user turn or mostly
    non-ASCII are skipped."""
    for conv in whole_threads(iter_sharegpt()) if conversations is None else conversations:
        turns, conv_id = conv.get("conversations") or [], str(conv.get("id", ""))
        if not turns or sharegpt_split(conv_id) != "train" or not all(
                isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str)
                for t in turns):
            continue
        messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
        text = "".join(m["content"] for m in messages if m["role"] == "user")
        if not text.strip() or sum(c.isascii() for c in text) < min_ascii * len(text):
            continue
        yield {"id": f"sharegpt/{conv_id}", "source": "sharegpt", "messages": _blank_assistants(messages)}


def _request_record(request: TraceRequest, source: str, prefix: str) -> dict:
    record = {"id": f"{prefix}/{request.key[:16]}", "source": source,
              "messages": _blank_assistants(request.messages)}
    if request.tools:
        record["tools"] = list(request.tools)
    return record


def available_packages(packages: Iterable[str]) -> list[str]:
    """The packages (folders) of `packages` installed here, in order."""
    return [p for p in packages if (spec := importlib.util.find_spec(p)) is not None and spec.submodule_search_locations]


def coding_conversations(counter: TokenCounter, n: int, seed: int = 0, packages: Iterable[str] = CODE_PACKAGES,
                         limits: tuple[int, int] = CODING_LIMITS) -> tuple[list[dict], list[int]]:
    """Up to `n` coding-agent session records over `packages` (those installed; never a dev-trace
    source package), and their context lengths."""
    if n <= 0:
        return [], []
    chosen = [p for p in available_packages(packages) if p not in SOURCE_PACKAGES]
    phrasings = tuple(range(1, len(TASK_PHRASINGS["rename"])))      # never the dev traces' phrasing 0
    made = coding_requests(counter, math.ceil(n / 2), seed, packages=chosen, limits=limits, phrasings=phrasings)[:n]
    return [_request_record(r, "coding", "coding") for r, _ in made], [tokens for _, tokens in made]


def tool_conversations() -> list[dict]:
    """BFCL multi-turn (the dev traces' categories) and ToolTalk requests of the tune split."""
    requests = tooltalk_requests() + [r for c in BFCL_CATEGORIES for r in bfcl_multiturn_requests(c)]
    return [_request_record(r, "tools", "tools") for r in requests if r.split == "tune"]


def synthetic_conversations(n: int, seed: int = 0) -> list[dict]:
    return [{"id": p.id, "source": "synthetic", "messages": list(p.messages)} for p in synthetic_prompts(n, seed)]


def parsed(records: Iterable[dict]) -> list[Conversation]:
    """Records checked by gen-data's own parser (a bad one raises: the builder made it wrong)."""
    problems: list[str] = []
    out = [parse_conversation(r, f"record {r.get('id')}", "campaign", problems) for r in records]
    if problems:
        raise ValueError("campaign records gen-data would refuse:\n  " + "\n  ".join(problems[:10]))
    return out


def package_versions(packages: Iterable[str]) -> dict[str, str]:
    """Version of the distribution each package is imported from ("yaml" -> PyYAML's), the standard
    library's by Python's."""
    dists = importlib.metadata.packages_distributions()
    out = {}
    for p in packages:
        if p in STDLIB_PACKAGES:
            out[p] = f"python {platform.python_version()}"
            continue
        names = dists.get(p) or [p]
        try:
            out[p] = f"{names[0]} {importlib.metadata.version(names[0])}"
        except importlib.metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def build(out: Path, *, coding_sessions: int, synthetic: int, seed: int, trace_files: list[str] | None,
          counter: TokenCounter | None = None, sharegpt: Iterable[dict] | None = None,
          packages: Iterable[str] = CODE_PACKAGES, tools: bool = True, progress=print) -> dict:
    """Write the campaign file `out` (JSONL, atomic) and its manifest; returns the manifest."""
    from dspine.train.gen_data_decontam import build_index, decontaminate

    counter = counter or TokenCounter.load()
    packages = tuple(packages)
    progress("campaign: ShareGPT threads ...")
    by_source = {"sharegpt": list(sharegpt_conversations(sharegpt))}
    progress(f"campaign: {len(by_source['sharegpt']):,} ShareGPT threads; coding sessions ({counter.method}) ...")
    by_source["coding"], coding_tokens = coding_conversations(counter, coding_sessions, seed, packages)
    progress(f"campaign: {len(by_source['coding']):,} coding sessions; tool and synthetic prompts ...")
    by_source["tools"] = tool_conversations() if tools else []
    by_source["synthetic"] = synthetic_conversations(synthetic, seed) if synthetic else []
    conversations = parsed(r for s in SOURCES for r in by_source[s])
    index, files = build_index(trace_files=trace_files)
    kept, dropped = decontaminate(conversations, index)
    kept_ids = {c.id for c in kept}
    seen: set[str] = set()
    records = []
    for s in SOURCES:
        for r in by_source[s]:
            if r["id"] in kept_ids and r["id"] not in seen:
                seen.add(r["id"])
                records.append(r)
    random.Random(seed).shuffle(records)
    write_jsonl_atomic(out, records)
    manifest = {
        "file": out.name, "sha256": file_sha256(out), "conversations": len(records),
        "per_source": {s: sum(r["id"] in kept_ids for r in by_source[s]) for s in SOURCES},
        "dropped_by_decontamination": dropped, "heldout_trace_files": files,
        "coding_context_tokens": percentiles(coding_tokens), "token_count": counter.method,
        "coding_packages": package_versions(p for p in available_packages(packages) if p not in SOURCE_PACKAGES),
        "seed": seed, "python": platform.python_version(),
        "command": "python -m dspine.data.campaign " + " ".join(sys.argv[1:]),
    }
    write_json_atomic(out.with_name(out.name + ".manifest.json"), manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dspine.data.campaign", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example (then gen-data on the GPU host, greedy and sampled):\n"
               "  python -m dspine.data.campaign runs/data/campaign.jsonl --coding-sessions 30000 \\\n"
               "      --heldout-traces .gpu-dspine/agentic/agentic_coding.jsonl "
               ".gpu-dspine/agentic/agentic_sharegpt.jsonl\n"
               "  dspine gen-data --prompts runs/data/campaign.jsonl --out runs/data/greedy.jsonl \\\n"
               "      --server http://127.0.0.1:30000 --concurrency 256 --max-new-tokens 512 --max-len 8192 --resume\n")
    p.add_argument("out", type=Path, help="the campaign file to write (.jsonl; a manifest is written beside it)")
    p.add_argument("--coding-sessions", type=int, default=30000,
                   help="coding-agent sessions over the standard library and dspine's dependencies, at most "
                        "(default 30000; the functions of the packages installed here may run out first; ~16 KB "
                        "each, ~2 KB xz-compressed)")
    p.add_argument("--synthetic", type=int, default=16000, help="templated code/math prompts (default 16000)")
    p.add_argument("--seed", type=int, default=0, help="draws of functions, task kinds and lengths (default 0)")
    p.add_argument("--heldout-traces", nargs="*", default=None, metavar="FILE",
                   help="agentic dev traces whose held-out split is kept out (default: gen-data's, "
                        ".gpu-dspine/agentic/agentic_*.jsonl when present)")
    args = p.parse_args(argv)
    if args.out.suffix != ".jsonl":
        p.error(f"{args.out}: the campaign file is JSONL; name it *.jsonl")
    if args.coding_sessions < 0 or args.synthetic < 0:
        p.error("--coding-sessions and --synthetic must be >= 0")
    manifest = build(args.out, coding_sessions=args.coding_sessions, synthetic=args.synthetic, seed=args.seed,
                     trace_files=args.heldout_traces)
    print(f"{'source':<10} {'conversations':>13}")
    for source, count in manifest["per_source"].items():
        print(f"{source:<10} {count:>13,}")
    print(f"{'total':<10} {manifest['conversations']:>13,}  (dropped by decontamination: "
          f"{sum(manifest['dropped_by_decontamination'].values()):,})")
    print(f"coding contexts: {manifest['coding_context_tokens']}")
    print(f"wrote {args.out} and {args.out.name}.manifest.json (sha256 {manifest['sha256'][:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
