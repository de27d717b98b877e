"""User traces for replay: the request format, validation with file:line problems, and the split.

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

Converters of dev data sets into this format and the `python -m dspine.data.traces` tool
(validate, dev, heldout) live in `dspine.data.dev_traces`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

HELDOUT_PERCENT = 25
ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
_PASSTHROUGH = ("stop", "seed", "tool_choice")
_IGNORED = ("model", "stream")
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


def sharegpt_messages(obj: dict, where: str, problems: list[str], roles: dict[str, str] = SHAREGPT_ROLES) -> list[dict]:
    """A ShareGPT object's `conversations` -> OpenAI messages `{"role", "content"}` (speaker names
    mapped by `roles`); every bad turn appends a problem naming it and is left out."""
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        problems.append(f"{where}: `conversations` must be a non-empty list of {{\"from\", \"value\"}} objects")
        return []
    messages = []
    for i, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in roles:
            problems.append(f"{where}: conversations[{i}]: bad `from` {speaker!r}; use one of {', '.join(roles)}")
        elif not isinstance(turn.get("value"), str):
            problems.append(f"{where}: conversations[{i}]: `value` must be the turn's text (a string)")
        else:
            messages.append({"role": roles[speaker], "content": turn["value"]})
    return messages


def parse_sharegpt(obj, where: str, problems: list[str]) -> TraceRequest | None:
    """A ShareGPT conversation -> the request answering its last human turn (None on problems)."""
    start = len(problems)
    messages = sharegpt_messages(obj, where, problems)
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
    for lineno, line in enumerate(text.split("\n"), 1):
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


if __name__ == "__main__":  # `python -m dspine.data.traces validate|dev|heldout ...`
    from dspine.data.dev_traces import main

    sys.exit(main())
