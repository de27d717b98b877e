"""Regenerating one conversation turn by turn, in token space: prompts, answer spans, `--max-len`.

`TurnRun(conversation, renderer, ...)` is a small state machine: `request()` is the next generation
request `(prompt ids, max new tokens, turn index)` or None once the conversation is done;
`accept(answer ids)` takes the target's answer to it; `record()` is the finished record (None when
no turn fitted). Drivers (one thread per conversation against a server, or batched rounds of
transformers `generate`) only move ids between the two.

The regeneration points are the assistant turns that follow a user turn, plus the end of the
conversation when it ends on a user or tool turn (a single-turn prompt is just that). Assistant turns
before the first user turn are dropped; the real assistant text is never used as conditioning.

Invariants of a record (`ids`, spans [s_k, e_k), k = 1..n):
* ids[s_k:e_k] is exactly the target's answer for turn k (its stop token included when it stopped
  on one); an empty answer has no span;
* ids[:s_k] is exactly the prompt turn k was generated from, so every answer token is the target's
  continuation of the record's own prefix;
* ids[:s_1] is the chat template's rendering of the turns before the first answer, generation prompt
  included; ids[e_k:s_{k+1}] is the template's text after assistant turn k (its end-of-turn marker
  unless the answer already ends with it, the real system/user/tool turns that follow, the next
  generation prompt);
* the record ends at e_n, and len(ids) <= max_len: a turn that would cross it is dropped whole, and
  so is every later one. `answer_start` = s_1; `answer_spans` is written when n > 1 (a one-turn
  record keeps the old format, whose answer runs from `answer_start` to the end).

The text between turns is cut from the template's rendering of the conversation with every
regenerated turn replaced by a unique sentinel, so the template's markers and the real turns are
exactly the template's. A template that rewrites earlier assistant turns (Qwen3 dropping old
reasoning) is not applied to the target's own earlier answers: they stay as generated.
"""

from __future__ import annotations

import threading

from dspine.data.conversations import Conversation
from dspine.train.gen_data_errors import GenDataError

MIN_ANSWER_BUDGET = 2   # a turn whose prompt leaves fewer new tokens under --max-len is not asked


class TemplateRefused(GenDataError):
    """The chat template cannot render one conversation (the run skips it and counts it)."""


def sentinel(turn: int) -> str:
    return f"DSPINE_REGENERATED_TURN_{turn}_SENTINEL"


class ChatRenderer:
    """The target's chat template for gen-data: `apply_chat_template` with the conversation's tools
    and `template_kwargs` (e.g. `{"enable_thinking": false}`), encoded without added special tokens.
    Shared by worker threads: one lock around the tokenizer (a fast tokenizer used from two threads
    at once can fail with "Already borrowed")."""

    def __init__(self, tokenizer, stops: list[int], template_kwargs: dict | None = None):
        self.tokenizer, self.stops = tokenizer, set(stops)
        self.kwargs = dict(template_kwargs or {})
        self._markers = {s: tokenizer.decode([s]) for s in stops}
        self._lock = threading.Lock()

    def text(self, messages: list[dict], tools: tuple, generation: bool) -> str:
        try:
            with self._lock:
                return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, tokenize=False,
                                                          add_generation_prompt=generation, **self.kwargs)
        except Exception as exc:  # jinja's TemplateError ("roles must alternate"), TypeError, ...
            raise TemplateRefused(f"the chat template refused it ({type(exc).__name__}: {exc})") from exc

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict], tools: tuple) -> list[int]:
        """Ids of `messages` rendered with the generation prompt appended."""
        return self.encode(self.text(messages, tools, generation=True))

    def between(self, history: list[dict], tools: tuple, turn: int, answer: list[int]) -> list[int]:
        """Ids the template puts after regenerated turn `turn` (its content in `history` is
        `sentinel(turn)`) up to the next generation prompt; a leading end-of-turn marker is left out
        when `answer` already ends with that stop token."""
        text = self.text(history, tools, generation=True)
        mark = sentinel(turn)
        at = text.find(mark)
        if at < 0 or text.find(mark, at + 1) >= 0:
            raise TemplateRefused("the chat template does not render assistant content verbatim once; "
                                  "gen-data cannot place the regenerated turns")
        tail = text[at + len(mark):]
        marker = self._markers.get(answer[-1]) if answer else None
        if marker and tail.startswith(marker):
            tail = tail[len(marker):]
        return self.encode(tail)


def regeneration_points(messages) -> list[list[dict]]:
    """Per regenerated turn, the real non-assistant messages that precede it since the previous one."""
    points: list[list[dict]] = []
    pending: list[dict] = []
    seen_user = False
    for msg in messages:
        if msg["role"] == "assistant":
            if seen_user:
                points.append(pending)
                pending = []
            continue
        seen_user = seen_user or msg["role"] == "user"
        pending.append({k: v for k, v in msg.items()})
    if seen_user and any(m["role"] in ("user", "tool") for m in pending):
        points.append(pending)
    return points


class TurnRun:
    """One conversation being regenerated (see the module docstring). `status` ends as "complete",
    "truncated" (some turns kept, the rest did not fit `max_len`) or "too_long" (no turn fitted, or
    the first prompt is over `max_prompt_tokens`); `generated` counts the answer tokens received."""

    def __init__(self, conversation: Conversation, renderer: ChatRenderer, *, max_new_tokens: int,
                 max_len: int | None = None, max_prompt_tokens: int | None = None):
        self.conversation, self.renderer = conversation, renderer
        self.max_new_tokens, self.max_len = max_new_tokens, max_len
        self.points = regeneration_points(conversation.messages)
        self.ids: list[int] = []
        self.spans: list[list[int]] = []
        self.status, self.turn, self.generated = "running", 0, 0
        self._prompt: list[int] | None = None
        self._budget = 0
        self._history: list[dict] = []
        if not self.points:
            self.status = "too_long"
            return
        self._history = list(self.points[0])
        first = renderer.prompt_ids(self._history, conversation.tools)
        if max_prompt_tokens is not None and len(first) > max_prompt_tokens:
            self.status = "too_long"
            return
        self._ask(first)

    @property
    def id(self) -> str:
        return self.conversation.id

    def _ask(self, prompt: list[int]) -> None:
        budget = self.max_new_tokens if self.max_len is None else min(self.max_new_tokens, self.max_len - len(prompt))
        if budget < MIN_ANSWER_BUDGET:
            self._finish()
            return
        self._prompt, self._budget = prompt, budget

    def _finish(self) -> None:
        self._prompt = None
        if not self.spans:
            self.status = "too_long"
        else:
            self.status = "complete" if self.turn == len(self.points) else "truncated"

    def request(self) -> tuple[list[int], int, int] | None:
        """`(prompt ids, max new tokens, turn index)` of the pending request, None when done."""
        return None if self._prompt is None else (self._prompt, self._budget, self.turn)

    def accept(self, answer: list[int]) -> None:
        """Take the answer to `request()`; an answer cut by `max_len` (not by `max_new_tokens` and not
        on a stop token) ends the conversation without it."""
        if self._prompt is None:
            raise RuntimeError(f"{self.id}: an answer arrived with no request pending")
        answer = list(answer[:self._budget])
        self.generated += len(answer)
        stopped = bool(answer) and answer[-1] in self.renderer.stops
        if self._budget < self.max_new_tokens and len(answer) >= self._budget and not stopped:
            self._finish()
            return
        start = len(self._prompt)
        self.ids = self._prompt + answer
        if answer:
            self.spans.append([start, len(self.ids)])
        self.turn += 1
        if self.turn == len(self.points):
            self._finish()
            return
        self._history += [{"role": "assistant", "content": sentinel(self.turn - 1)}] + self.points[self.turn]
        self._ask(self.ids + self.renderer.between(self._history, self.conversation.tools, self.turn - 1, answer))

    def record(self) -> dict | None:
        """The finished record, without its `target` stamp; None when no turn was kept."""
        if self._prompt is not None:
            raise RuntimeError(f"{self.id}: record() before the last answer")
        if not self.spans:
            return None
        ids = self.ids[:self.spans[-1][1]]
        rec = {"id": self.id, "source": self.conversation.source, "ids": ids, "answer_start": self.spans[0][0]}
        if len(self.spans) > 1:
            rec["answer_spans"] = [list(s) for s in self.spans]
        return rec
