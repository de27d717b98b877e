"""Decontamination of gen-data's conversations: no user text may overlap an evaluation prompt.

Held-out texts: the questions of every evaluation set (`dspine.data.eval_sets`: GSM8K, MATH-500,
HumanEval, MBPP, ShareGPT held-out openers; a set exported to `--prompts-dir` is read from there) and the user
turns of the held-out split (`TraceRequest.split`) of the agentic dev traces
(`dspine.data.agentic`, default files `DEFAULT_TRACES`, or `--heldout-traces`).

Text is normalised to its words: lower case, split on whitespace, punctuation stripped from each
word's ends. A conversation is dropped when any of its user turns
* equals a held-out text of at least `EXACT_MIN_WORDS` words (shorter ones, like "continue", are
  too common to mean anything), or
* shares a run of `NGRAM` consecutive words with a held-out text, or
* contains an evaluation question (`EvalIndex.contaminated`, the rule the built-in training
  prompts were already filtered by: questions of >= 8 words as a run of whole words).
Pure Python: no torch.
"""

from __future__ import annotations

import glob
import string
from dataclasses import dataclass, field
from pathlib import Path

from dspine.data.conversations import Conversation
from dspine.data.eval_sets import EVAL_SETS, EvalIndex, eval_items, load_eval_set
from dspine.data.traces import TraceError, load_traces
from dspine.train.gen_data_errors import GenDataError

NGRAM = 13
EXACT_MIN_WORDS = 5
DEFAULT_TRACES = ".gpu-dspine/agentic/agentic_*.jsonl"   # `python -m dspine.data.agentic .gpu-dspine/agentic`
_PUNCTUATION = string.punctuation + "“”‘’"


def words(text: str) -> list[str]:
    """Normalised words of `text` (see the module docstring)."""
    return [w for w in (w.strip(_PUNCTUATION) for w in text.lower().split()) if w]


@dataclass
class OverlapIndex:
    """Exact normalised texts and hashed `n`-grams of the held-out texts; `reason(text)` says why
    a text is contaminated (None when it is not)."""

    n: int = NGRAM
    exact_min_words: int = EXACT_MIN_WORDS
    questions: EvalIndex | None = None
    exact: set = field(default_factory=set)
    grams: set = field(default_factory=set)

    def add(self, text: str) -> None:
        ws = words(text)
        if len(ws) >= self.exact_min_words:
            self.exact.add(" ".join(ws))
        self.grams.update(hash(tuple(ws[i:i + self.n])) for i in range(len(ws) - self.n + 1))

    def reason(self, text: str) -> str | None:
        ws = words(text)
        if " ".join(ws) in self.exact:
            return "exact"
        if any(hash(tuple(ws[i:i + self.n])) in self.grams for i in range(len(ws) - self.n + 1)):
            return f"{self.n}-gram"
        if self.questions is not None and self.questions.contaminated(text):
            return "contains"
        return None


def eval_texts(data_dir: str | Path | None = None, prompts_dir: str | Path | None = None) -> list[str]:
    """Every evaluation question; a set exported to `prompts_dir` (`eval-<set>.jsonl`) is read from
    there (its user messages), the others from the evaluation files."""
    texts: list[str] = []
    try:
        for name in EVAL_SETS:
            if prompts_dir is not None and (Path(prompts_dir).expanduser() / f"eval-{name}.jsonl").is_file():
                texts += [p.text for p in load_eval_set(name, prompts_dir=prompts_dir)]
            else:
                texts += [q for _, q, _ in eval_items(name, data_dir)]
    except FileNotFoundError as exc:
        raise GenDataError(f"decontamination needs the evaluation sets: {exc} (or pass --no-decontaminate)") from exc
    return texts


def heldout_trace_texts(paths: list[str] | None) -> tuple[list[str], list[str]]:
    """`(user texts of the held-out requests, files read)`; `paths` None reads `DEFAULT_TRACES`
    (under the working directory, else under the dspine checkout) when present; no file there is
    not an error (the caller says so)."""
    if paths is None:   # the working directory's, else the checkout's (dspine/..) default files
        checkout = Path(__file__).resolve().parents[2]
        files = sorted(glob.glob(DEFAULT_TRACES)) or sorted(glob.glob(str(checkout / DEFAULT_TRACES)))
    else:
        files = list(paths)
    if not files:
        return [], []
    try:
        requests = load_traces(files, split="all")
    except TraceError as exc:
        raise GenDataError(f"--heldout-traces: {exc}") from exc
    texts = [m["content"] for r in requests if r.split == "heldout" for m in r.messages
             if m.get("role") == "user" and isinstance(m.get("content"), str)]
    return texts, files


def build_index(*, data_dir=None, prompts_dir=None,
                trace_files: list[str] | None = None) -> tuple[OverlapIndex, list[str]]:
    """The index over the evaluation sets and the held-out traces, and the trace files read."""
    questions = eval_texts(data_dir, prompts_dir)
    traces, files = heldout_trace_texts(trace_files)
    index = OverlapIndex(questions=EvalIndex(questions))
    for text in questions + traces:
        index.add(text)
    return index, files


def decontaminate(conversations: list[Conversation], index: OverlapIndex) -> tuple[list[Conversation], dict[str, int]]:
    """`(kept conversations in order, dropped count per reason)`."""
    kept, dropped = [], {}
    for conv in conversations:
        reason = next((r for r in map(index.reason, conv.user_texts()) if r), None)
        if reason is None:
            kept.append(conv)
        else:
            dropped[reason] = dropped.get(reason, 0) + 1
    return kept, dropped
