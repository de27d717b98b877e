"""SGLang servers for gen-data: native `/generate` on token ids, several servers, retries, dead servers dropped.

`server_answers(url, prompt_ids, stops, ...)` is one batched request to one server (no retry).
`ServerPool(urls, ...).generate(prompt_ids, params)` is one prompt's answer from whichever server
suits: each attempt goes to the live server with the fewest requests in flight (ties in turn). An
attempt that gets no answer (refused, reset, timed out), HTTP 5xx or 429, or a reply that is not
JSON is retried up to `retries` times after `backoff_s * 2**attempt` seconds (at most
`MAX_BACKOFF_S`, with jitter), each time on the then best server; any other HTTP status fails the
request at once (the same request cannot succeed). A request out of attempts raises
`RequestFailed`. A server that just failed rests (as long as its failure streak's backoff) while
another can take the attempts. A server whose last `dead_after_failures` or more attempts all failed, over at least
`dead_after_s` seconds, is dropped with a warning; the others carry on; `AllServersDown` when none
is left. A reply without `output_ids` is `GenDataError` (not an SGLang server: no retry helps).

Answers are cut after their first stop token, and end with the stop token when generation stopped
on one (SGLang may leave the matched stop token out of `output_ids`), as transformers' `generate`.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass, field

from dspine.train.gen_data_errors import GenDataError
from dspine.utils.http import HttpClient, HttpError

MAX_BACKOFF_S = 30.0


class RequestFailed(Exception):
    """One request failed for good (out of attempts, or refused with a 4xx)."""


class AllServersDown(GenDataError):
    """Every server of the pool was dropped."""


def sampling_params(stops: list[int], *, max_new_tokens: int, temperature: float, seed: int, top_p: float = 1.0,
                    top_k: int = 0) -> dict:
    """SGLang `sampling_params`; greedy when `temperature` is 0 (no sampling keys); top_k 0 (off) is SGLang's -1."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": list(stops),
              "skip_special_tokens": False}
    if temperature > 0:
        params.update(sampling_seed=seed, top_p=top_p, top_k=top_k if top_k > 0 else -1)
    return params


def parse_replies(url: str, replies, n: int, stops: list[int]) -> list[list[int]]:
    """The answers in SGLang's `/generate` reply to `n` prompts (see the module docstring)."""
    replies = replies if isinstance(replies, list) else [replies]
    if len(replies) != n:
        raise GenDataError(f"{url}/generate returned {len(replies)} answers for {n} prompts")
    answers = []
    for reply in replies:
        if not isinstance(reply, dict) or "output_ids" not in reply:
            keys = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise GenDataError(f"{url}/generate returned no `output_ids` (keys {keys}): is this an SGLang server? "
                               "gen-data --server needs SGLang's native API")
        ids = list(reply["output_ids"])
        finish = (reply.get("meta_info") or {}).get("finish_reason") or {}
        matched = finish.get("matched") if isinstance(finish, dict) else None
        if isinstance(matched, int) and matched in stops and (not ids or ids[-1] != matched):
            ids.append(matched)
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        answers.append(ids[:cut])
    return answers


def server_answers(url: str, prompt_ids: list[list[int]], stops: list[int], *, max_new_tokens: int,
                   temperature: float, seed: int, top_p: float = 1.0, top_k: int = 0,
                   timeout: float = 600.0) -> list[list[int]]:
    """Answers of one SGLang server to `prompt_ids` (one batched native `/generate`, one attempt)."""
    params = sampling_params(stops, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                             top_p=top_p, top_k=top_k)
    try:
        replies = HttpClient(url, timeout, retries=0).post("/generate", {"input_ids": prompt_ids,
                                                                         "sampling_params": params})
    except HttpError as e:
        if e.status is not None:
            raise GenDataError(f"{url}/generate answered HTTP {e.status}: {e.body[:300]!r}") from e
        raise GenDataError(f"no SGLang server answers at {url} ({e}); start one with the same target "
                           f"(`sglang serve --model-path ...`) or drop --server") from e
    return parse_replies(url, replies, len(prompt_ids), stops)


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    streak: int = 0                   # attempts failed in a row
    streak_since: float = 0.0         # when the first of them failed
    last_fail: float = 0.0
    dead: bool = False
    served: int = 0
    last_error: str = ""


@dataclass
class ServerPool:
    """Several SGLang servers of one target, shared by worker threads (see the module docstring)."""

    urls: list[str]
    stops: list[int]
    retries: int = 5
    backoff_s: float = 1.0
    timeout_s: float = 600.0
    dead_after_s: float = 60.0
    dead_after_failures: int = 3
    warn: object = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))
    _servers: list[_Server] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _turn: int = field(init=False, default=0)

    def __post_init__(self):
        if not self.urls:
            raise GenDataError("no --server URL given")
        self._servers = [_Server(url.rstrip("/")) for url in dict.fromkeys(self.urls)]

    @property
    def live(self) -> list[str]:
        return [s.url for s in self._servers if not s.dead]

    def probe(self) -> None:
        """Drop (with a warning) every server that does not answer at all now; any HTTP answer,
        even an error status, counts as alive. GenDataError when none answers."""
        for server in self._servers:
            try:
                HttpClient(server.url, timeout=min(self.timeout_s, 30.0), retries=1,
                           backoff_s=self.backoff_s).get("/get_model_info")
            except HttpError as e:
                if e.status is None:
                    self._drop(server, f"no answer ({e})")
            except ValueError:
                pass                       # an answer that is not JSON: something listens there
        if not self.live:
            raise GenDataError(f"no SGLang server answers at {', '.join(s.url for s in self._servers)}; start one "
                               "with the same target (`sglang serve --model-path ...`) or drop --server")

    def _drop(self, server: _Server, why: str) -> None:
        server.dead = True
        left = len(self.live)
        self.warn(f"dspine gen-data: warning: dropping server {server.url}: {why}; "
                  f"{left} server(s) left" + ("" if left else ", stopping"))

    def _pick(self) -> _Server:
        with self._lock:
            live = [s for s in self._servers if not s.dead]
            if not live:
                raise AllServersDown("every --server was dropped (" + "; ".join(
                    f"{s.url}: {s.last_error}" for s in self._servers) + "); restart them and rerun with --resume")
            now, n = time.monotonic(), len(self._servers)
            # a failing server rests (as long as its streak's backoff) while another can take the attempt
            ready = [s for s in live if not s.streak
                     or now - s.last_fail >= min(MAX_BACKOFF_S, self.backoff_s * 2 ** s.streak)] or live
            self._turn += 1
            best = min(ready, key=lambda s: (s.in_flight, (self._servers.index(s) - self._turn) % n))
            best.in_flight += 1
            return best

    def _done(self, server: _Server, error: str | None) -> None:
        with self._lock:
            server.in_flight -= 1
            if error is None:
                server.streak, server.served = 0, server.served + 1
                return
            now = time.monotonic()
            if server.streak == 0:
                server.streak_since = now
            server.streak += 1
            server.last_fail, server.last_error = now, error
            if (not server.dead and server.streak >= self.dead_after_failures
                    and now - server.streak_since >= self.dead_after_s):
                self._drop(server, f"{server.streak} attempts in a row failed over "
                                   f"{now - server.streak_since:.0f} s, last: {error}")

    def generate(self, prompt_ids: list[int], params: dict) -> list[int]:
        """The answer to one prompt (see the module docstring for retries and errors)."""
        body = {"input_ids": [prompt_ids], "sampling_params": params}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                time.sleep(delay)
            server = self._pick()
            try:
                replies = HttpClient(server.url, self.timeout_s, retries=0).post("/generate", body)
            except HttpError as e:
                if e.status is not None and e.status < 500 and e.status != 429:
                    self._done(server, None)            # it answered: alive, but this request is refused
                    raise RequestFailed(f"{server.url}/generate answered HTTP {e.status}: {e.body[:300]!r}") from None
                last = f"HTTP {e.status}: {e.body[:200]!r}" if e.status is not None else f"no answer: {e}"
                self._done(server, last)
                continue
            except ValueError as e:                     # not JSON: a proxy's error page, a cut reply
                last = f"reply is not JSON ({e})"
                self._done(server, last)
                continue
            self._done(server, None)
            return parse_replies(server.url, replies, 1, self.stops)[0]
        raise RequestFailed(f"{self.retries + 1} attempts failed, last: {last}")
