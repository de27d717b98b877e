"""User traces for replay: load, validate, split, and convert dev traces to one request format.

Accepted input (the format is chosen per record, so files may mix them):

* **OpenAI chat-completions requests**, one JSON object per line (`.jsonl`)::

      {"messages": [{"role": "user", "content": "Hi"}], "tools": [...], "max_tokens": 256,
       "temperature": 0.7, "top_p": 0.95}

  `messages` is required; roles are system, developer, user, assistant, tool. An assistant
  message may carry `tool_calls` instead of `content`. `tools` are OpenAI function tools
  (`{"type": "function", "function": {"name": ..., "parameters": {...}}}`). `model` and `stream`
  are accepted and ignored (replay sets both); `stop`, `seed`, `tool_choice` pass through.
* **ShareGPT conversations**, as a JSON list or as JSONL: `{"conversations": [{"from": "human",
  "value": "..."}, {"from": "gpt", "value": "..."}, ...]}`. The request is the conversation up to
  its last human turn (the model answers that turn).

Every problem is reported with its file and line and what to fix; all of them are collected
before `load_traces` raises `TraceError`.

Split: a request is held out iff sha256 of its canonical JSON (messages + tools) falls in the
lowest `HELDOUT_PERCENT` of 100 buckets, so the split depends on the content only (not on file
order or on the other requests) and tuning never sees a held-out request.

Dev-trace converters (`tooltalk_requests`, `bfcl_multiturn_requests`, `sharegpt_requests`) read
the PyPI packages' data files by location (`importlib.util.find_spec`) without importing them.
`python -m dspine.data.traces validate FILE...` checks files; `python -m dspine.data.traces dev DIR` writes
the dev traces of `benchmarks/traces/`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

HELDOUT_PERCENT = 25
ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
_PASSTHROUGH = ("stop", "seed", "tool_choice")
_IGNORED = ("model", "stream")
_DEV_PACKAGES = {"tooltalk": "nvidia-tooltalk==26.3", "bfcl_eval": "bfcl-eval==2026.3.23"}
_REQUEST_KEYS = ("messages", "tools", "max_tokens", "temperature", "top_p") + _PASSTHROUGH + _IGNORED


class TraceError(ValueError):
    """One or more invalid records; `problems` holds every "file:line: what, fix" message."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:50]) + (f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else "")
        super().__init__(f"{len(problems)} problem(s) in the traces:\n  {shown}")


@dataclass(frozen=True)
class TraceRequest:
    """One chat-completions request to replay. `source` is "file:line" (or a dataset id)."""

    messages: tuple
    tools: tuple = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    extra: dict = field(default_factory=dict)   # the pass-through keys (stop, seed, tool_choice)
    source: str = ""

    @property
    def key(self) -> str:
        """sha256 hex of the canonical JSON of messages + tools: the request's identity."""
        canonical = json.dumps({"messages": list(self.messages), "tools": list(self.tools)},
                               sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @property
    def split(self) -> str:
        """"heldout" for the lowest HELDOUT_PERCENT hash buckets, else "tune"."""
        return "heldout" if int(self.key[:16], 16) % 100 < HELDOUT_PERCENT else "tune"

    def to_openai(self, model: str | None = None, max_tokens_cap: int | None = None) -> dict:
        """The request body for /v1/chat/completions (non-streaming); max_tokens capped."""
        body: dict = {"messages": list(self.messages), **self.extra}
        if model:
            body["model"] = model
        if self.tools:
            body["tools"] = list(self.tools)
        max_tokens = self.max_tokens
        if max_tokens_cap is not None:
            max_tokens = max_tokens_cap if max_tokens is None else min(max_tokens, max_tokens_cap)
        for name, value in (("max_tokens", max_tokens), ("temperature", self.temperature), ("top_p", self.top_p)):
            if value is not None:
                body[name] = value
        return body

    def to_record(self) -> dict:
        """The JSONL record this request is written as (an OpenAI request, no `source`)."""
        return self.to_openai()


# ------------------------------------------------------------------------------------ validation
def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_content(content, where: str, problems: list[str]) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        return
    problems.append(f"{where}: `content` must be a string or a list of content parts "
                    f"({{\"type\": \"text\", \"text\": ...}}), got {type(content).__name__}")


def _check_message(msg, where: str, problems: list[str]) -> None:
    if not isinstance(msg, dict):
        problems.append(f"{where}: a message must be an object {{\"role\": ..., \"content\": ...}}, "
                        f"got {type(msg).__name__}")
        return
    role = msg.get("role")
    if role not in ROLES:
        problems.append(f"{where}: bad role {role!r}; use one of {', '.join(ROLES)}")
        return
    if role == "assistant" and msg.get("tool_calls"):
        calls = msg["tool_calls"]
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            problems.append(f"{where}: `tool_calls` must be a list of {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": ..., \"arguments\": \"<JSON string>\"}}}}")
        if msg.get("content") is not None:
            _check_content(msg["content"], where, problems)
        return
    if "content" not in msg or msg["content"] is None:
        problems.append(f"{where}: {role} message has no `content`; add the text (a string)")
        return
    _check_content(msg["content"], where, problems)
    if role == "tool" and not isinstance(msg.get("tool_call_id", ""), str):
        problems.append(f"{where}: `tool_call_id` must be a string (the id of the assistant's tool call)")


def _check_tools(tools, where: str, problems: list[str]) -> None:
    if not isinstance(tools, list):
        problems.append(f"{where}: `tools` must be a list of function tools, got {type(tools).__name__}")
        return
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            problems.append(f"{where}: tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": {{...}}}}}}")
        elif "parameters" in fn and not isinstance(fn["parameters"], dict):
            problems.append(f"{where}: tools[{i}].function.parameters must be a JSON-schema object")


def parse_openai_request(obj, where: str, problems: list[str]) -> TraceRequest | None:
    """Validate one OpenAI chat-completions request; problems are appended, None if any."""
    start = len(problems)
    unknown = sorted(set(obj) - set(_REQUEST_KEYS))
    if unknown:
        problems.append(f"{where}: unknown key(s) {unknown}; a request may have {', '.join(_REQUEST_KEYS)}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        problems.append(f"{where}: missing `messages`: give a non-empty list of {{\"role\", \"content\"}} objects")
    else:
        for i, msg in enumerate(messages):
            _check_message(msg, f"{where}: messages[{i}]", problems)
    if "tools" in obj:
        _check_tools(obj["tools"], where, problems)
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        problems.append(f"{where}: `max_tokens` = {max_tokens!r} must be a positive integer (e.g. 256)")
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = obj.get(name)
        if value is not None and (not _is_number(value) or not low <= value <= high):
            problems.append(f"{where}: `{name}` = {value!r} must be a number in [{low}, {high}]")
    if len(problems) > start:
        return None
    return TraceRequest(messages=tuple(messages), tools=tuple(obj.get("tools") or ()), max_tokens=max_tokens,
                        temperature=obj.get("temperature"), top_p=obj.get("top_p"),
                        extra={k: obj[k] for k in _PASSTHROUGH if k in obj}, source=where)


def parse_sharegpt(obj, where: str, problems: list[str]) -> TraceRequest | None:
    """A ShareGPT conversation -> the request answering its last human turn (None on problems)."""
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        problems.append(f"{where}: `conversations` must be a non-empty list of {{\"from\", \"value\"}} objects")
        return None
    messages, start = [], len(problems)
    for i, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in SHAREGPT_ROLES:
            problems.append(f"{where}: conversations[{i}]: bad `from` {speaker!r}; use one of "
                            f"{', '.join(SHAREGPT_ROLES)}")
        elif not isinstance(turn.get("value"), str):
            problems.append(f"{where}: conversations[{i}]: `value` must be the turn's text (a string)")
        else:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
    if len(problems) > start:
        return None
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        problems.append(f"{where}: the conversation has no human turn to answer; add one "
                        f"({{\"from\": \"human\", \"value\": ...}})")
        return None
    return TraceRequest(messages=tuple(messages[: last_user + 1]), source=where)


def parse_record(obj, where: str, problems: list[str]) -> TraceRequest | None:
    if not isinstance(obj, dict):
        problems.append(f"{where}: expected a JSON object (an OpenAI request or a ShareGPT conversation), "
                        f"got {type(obj).__name__}")
        return None
    if "conversations" in obj and "messages" not in obj:
        return parse_sharegpt(obj, where, problems)
    return parse_openai_request(obj, where, problems)


def _records(path: Path, problems: list[str]) -> Iterator[tuple[object, str]]:
    """(decoded record, "file:line") for a JSONL file or a JSON list; decode errors -> problems."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        problems.append(f"{path}: cannot read: {err}")
        return
    stripped = text.lstrip()
    if stripped.startswith("["):
        decoder = json.JSONDecoder()
        pos = len(text) - len(stripped) + 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            line = text.count("\n", 0, pos) + 1
            if pos >= len(text):
                problems.append(f"{path}:{line}: the JSON list is not closed; add the final `]`")
                return
            if text[pos] == "]":
                return
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as err:
                problems.append(f"{path}:{err.lineno}: malformed JSON ({err.msg}, column {err.colno}); fix that "
                                "element of the list")
                return
            yield obj, f"{path}:{line}"
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line), f"{path}:{lineno}"
        except json.JSONDecodeError as err:
            problems.append(f"{path}:{lineno}: malformed JSON ({err.msg}, column {err.colno}); each line must be "
                            "one complete JSON object")


def load_traces(paths: Iterable[str | Path], split: str = "all") -> list[TraceRequest]:
    """Every request of `paths` (in file order), keeping `split` in {"tune", "heldout", "all"}.
    Raises TraceError listing every problem (file:line) if any record is invalid or none remain."""
    if split not in ("tune", "heldout", "all"):
        raise ValueError(f"split={split!r}: use tune, heldout or all")
    problems: list[str] = []
    requests: list[TraceRequest] = []
    paths = [Path(p) for p in paths]
    for path in paths:
        if not path.is_file():
            problems.append(f"{path}: no such file; pass JSONL of OpenAI requests or ShareGPT JSON/JSONL")
            continue
        for obj, where in _records(path, problems):
            request = parse_record(obj, where, problems)
            if request is not None:
                requests.append(request)
    if problems:
        raise TraceError(problems)
    kept = [r for r in requests if split == "all" or r.split == split]
    if not kept:
        raise TraceError([f"{', '.join(map(str, paths))}: no {split} requests "
                          f"({len(requests)} in all); add traces or use --split all"])
    return kept


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> None:
    """Write one JSON object per line to a temporary file beside `path`, then rename it over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ converters
def package_data_dir(module: str, *parts: str) -> Path:
    """A data folder inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        dist = _DEV_PACKAGES.get(module, module)
        raise FileNotFoundError(f"package `{module}` is not installed: pip install --no-deps {dist}")
    return Path(list(spec.submodule_search_locations)[0], *parts)


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
    """ShareGPT conversations (e.g. `dspine.data.datasets.iter_sharegpt()`) -> requests; invalid ones skipped."""
    out = []
    for conv in conversations:
        request = parse_sharegpt(conv, f"sharegpt:{conv.get('id', '?')}", [])
        if request is not None:
            out.append(TraceRequest(messages=request.messages, max_tokens=max_tokens, source=request.source))
    return out


# ------------------------------------------------------------------------------------ CLI
def _small(requests: list[TraceRequest], count: int, max_bytes: int) -> list[TraceRequest]:
    """The first `count` requests whose record is under max_bytes, taken evenly across the list."""
    fitting = [r for r in requests if len(json.dumps(r.to_record(), ensure_ascii=False)) <= max_bytes]
    step = max(1, len(fitting) // count)
    return fitting[::step][:count]


def write_dev_traces(out_dir: str | Path) -> dict[str, dict[str, int]]:
    """Write the small dev traces (tooltalk_dev, bfcl_multiturn_dev, sharegpt_dev .jsonl) and
    return {file: {"tune": n, "heldout": n}}."""
    from dspine.data.datasets import iter_sharegpt

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


def heldout_workload(paths: Iterable[str | Path], count: int) -> list[TraceRequest]:
    """A held-out replay workload of `count` requests: the traces' held-out split, then opening turns
    of ShareGPT's held-out evaluation set (`dspine.data.datasets`), neither ever used for tuning."""
    from dspine.data.datasets import load_eval_set

    held = load_traces(paths, "heldout")
    extra = [TraceRequest(messages=tuple(p.messages), source=p.id)
             for p in load_eval_set("sharegpt-heldout", max(0, count - len(held)))]
    return (held + extra)[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspine.data.traces", description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args(argv)
    if args.cmd == "heldout":
        requests = heldout_workload(args.files, args.count)
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


if __name__ == "__main__":
    sys.exit(main())
