"""Conversations to regenerate: the `dspine gen-data --prompts FILE` formats, parsed and checked.

A `Conversation` is `(id, source, messages, tools)`: `messages` in OpenAI chat format, each
`{"role": "system"|"user"|"assistant"|"tool", "content": str}` (assistant messages may also keep
`tool_calls`), `tools` a tuple of OpenAI function tools (often empty). Its assistant turns are the
ones the target regenerates: their text is never used as conditioning (gen-data replaces each by
the target's own answer), so it may be empty.

One JSON object per line (the format is chosen per line, so a file may mix them; `.gz` is read too):

* OpenAI chat: `{"messages": [...], "tools": [...]?, "id": ...?, "source": ...?}`; content may be
  a string or a list of text parts (`{"type": "text", "text": ...}`, joined); `developer` is read
  as `system`;
* ShareGPT: `{"conversations": [{"from": "human"|"gpt"|"system"|"tool"|..., "value": "..."}],
  "system": ...?, "id": ...?}` (`SHAREGPT_FROM` lists the accepted speakers).

Every conversation needs a user turn. Ids: the line's `id` (a string or an integer, unique in the
file), else `<file stem>/<12 hex of sha256 of the canonical messages + tools>`: stable when the file
is re-ordered or extended, which `--resume` relies on; identical conversations without ids collapse
into one. Problems are collected as "file:line: what; fix" and raised together (`ConversationError`).
Pure Python: no torch.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dspine.data.prompts import Prompt
from dspine.data.traces import SHAREGPT_ROLES, sharegpt_messages

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT_FROM = {**SHAREGPT_ROLES, "tool": "tool", "function": "tool", "observation": "tool",
                 "function_call": "assistant"}
MAX_PROBLEMS_SHOWN = 20


class ConversationError(ValueError):
    """Invalid lines of a prompts file; `problems` holds every "file:line: what; fix" message."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:MAX_PROBLEMS_SHOWN])
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
        super().__init__(f"{len(problems)} bad record(s) in the prompts file:\n  {shown}{more}")


@dataclass(frozen=True)
class Conversation:
    """One conversation; `messages` as in the module docstring, at least one user turn."""

    id: str
    source: str
    messages: tuple
    tools: tuple = ()

    @classmethod
    def from_prompt(cls, prompt: Prompt) -> "Conversation":
        return cls(prompt.id, prompt.source, tuple(prompt.messages))

    def user_texts(self) -> list[str]:
        """The text of every user turn, in order (what decontamination checks)."""
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def with_id(self, new_id: str) -> "Conversation":
        return Conversation(new_id, self.source, self.messages, self.tools)


def _text(content, where: str, problems: list[str]) -> str | None:
    """A message's content as one string (text parts joined); None (and a problem) otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    problems.append(f"{where}: `content` must be a string or a list of text parts "
                    f"({{\"type\": \"text\", \"text\": ...}}), got {json.dumps(content)[:80]}")
    return None


def _openai_messages(obj: dict, where: str, problems: list[str]) -> list[dict]:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        problems.append(f"{where}: `messages` must be a non-empty list of {{\"role\", \"content\"}} objects")
        return []
    out = []
    for i, msg in enumerate(messages):
        at = f"{where}: messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            problems.append(f"{at}: bad role {role!r}; use one of {', '.join(ROLES)}")
            continue
        role = ROLES[role]
        if role == "assistant" and msg.get("content") is None:  # a tool call only: regenerated anyway
            calls = {"tool_calls": msg["tool_calls"]} if "tool_calls" in msg else {}
            out.append({"role": role, "content": "", **calls})
            continue
        text = _text(msg.get("content"), at, problems)
        if text is not None:
            kept = {k: msg[k] for k in ("tool_calls", "tool_call_id", "name") if k in msg}
            out.append({"role": role, "content": text, **kept})
    return out


def _sharegpt_messages(obj: dict, where: str, problems: list[str]) -> list[dict]:
    system = [{"role": "system", "content": obj["system"]}] if isinstance(obj.get("system"), str) and obj["system"] else []
    return system + sharegpt_messages(obj, where, problems, SHAREGPT_FROM)


def parse_conversation(obj, where: str, stem: str, problems: list[str]) -> Conversation | None:
    """One decoded line -> a Conversation, or None with the problems appended."""
    if not isinstance(obj, dict) or not ("messages" in obj or "conversations" in obj):
        problems.append(f"{where}: expected an object with `messages` (OpenAI chat) or `conversations` "
                        f"(ShareGPT), got {json.dumps(obj)[:80]}")
        return None
    start = len(problems)
    sharegpt = "conversations" in obj and "messages" not in obj
    messages = _sharegpt_messages(obj, where, problems) if sharegpt else _openai_messages(obj, where, problems)
    tools = obj.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        problems.append(f"{where}: `tools` must be a list of OpenAI function tools")
    if len(problems) == start and not any(m["role"] == "user" for m in messages):
        problems.append(f"{where}: the conversation has no user turn; add one "
                        "({\"role\": \"user\", ...} or {\"from\": \"human\", ...})")
    if "id" in obj and (not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool) or obj["id"] == ""):
        problems.append(f"{where}: `id` must be a non-empty string or an integer, got {obj['id']!r}")
    if len(problems) > start:
        return None
    if "id" in obj:
        conv_id = str(obj["id"])
    else:
        canonical = json.dumps({"messages": messages, "tools": tools}, sort_keys=True, ensure_ascii=False)
        conv_id = f"{stem}/{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"
    source = obj["source"] if isinstance(obj.get("source"), str) else stem
    return Conversation(conv_id, source, tuple(messages), tuple(tools))


def read_conversations(path: str | Path) -> tuple[list[Conversation], int]:
    """`(conversations in file order, duplicates dropped)`: every line of `path` parsed; raises
    ConversationError listing every bad line (or an unreadable file), and naming both lines of a
    repeated explicit id. Blank lines are skipped."""
    path = Path(path).expanduser()
    stem = path.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".json")
    if not path.is_file():
        raise ConversationError([f"{path}: no such file; give a JSONL file of OpenAI chat or ShareGPT records"])
    problems: list[str] = []
    out: list[Conversation] = []
    first_line: dict[str, int] = {}
    explicit: set[str] = set()
    duplicates = 0
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="\n") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    problems.append(f"{where}: malformed JSON ({err.msg}, column {err.colno}); each line must be "
                                    "one complete JSON object")
                    continue
                conv = parse_conversation(obj, where, stem, problems)
                if conv is None:
                    continue
                if conv.id in first_line:
                    if isinstance(obj, dict) and "id" in obj and conv.id in explicit:
                        problems.append(f"{where}: id {conv.id!r} repeats line {first_line[conv.id]}; ids must be "
                                        "unique (or leave `id` out to get content hashes)")
                    duplicates += 1
                    continue
                first_line[conv.id] = lineno
                if isinstance(obj, dict) and "id" in obj:
                    explicit.add(conv.id)
                out.append(conv)
    except (OSError, UnicodeDecodeError, EOFError) as err:
        problems.append(f"{path}: cannot be read as UTF-8 JSONL ({err})")
    if problems:
        raise ConversationError(problems)
    return out, duplicates
