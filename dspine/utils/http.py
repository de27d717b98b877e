"""JSON over HTTP with the standard library, with retries: the one client every DSpine tool uses
to talk to an SGLang server (tuning, benchmarks, data generation, diagnostics).

`HttpClient(url).post("/generate", body)` returns the decoded JSON reply. Connection failures and
the server's transient answers (HTTP 502/503/504, e.g. `/health` while it warms up) are retried
`retries` times with exponential backoff; any other HTTP error raises `HttpError` at once with the
status and the start of the body, because repeating a bad request cannot fix it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

RETRY_STATUS = (502, 503, 504)


class HttpError(RuntimeError):
    """A request failed for good. `status` is the HTTP status, or None when no server answered."""

    def __init__(self, message: str, status: int | None = None, body: bytes = b""):
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class HttpClient:
    """`url` is the server root, e.g. `http://127.0.0.1:30000`; `timeout` is per attempt (s)."""

    url: str
    timeout: float = 600.0
    retries: int = 2
    backoff_s: float = 0.5

    def get(self, path: str) -> dict | list:
        return self.request(path)

    def post(self, path: str, body: dict) -> dict | list:
        return self.request(path, body)

    def request(self, path: str, body: dict | None = None) -> dict | list:
        """GET (`body` None) or POST `body` as JSON to `url + path`; the reply decoded."""
        return json.loads(self.request_raw(path, body))

    def request_raw(self, path: str, body: dict | None = None) -> bytes:
        return self._send(path, body, read=True)

    def stream_lines(self, path: str, body: dict) -> Iterator[bytes]:
        """POST `body` and yield the reply line by line as it arrives (server-sent events). Opening
        the reply is retried as in `request`; a reply already being read is not."""
        with self._send(path, body, read=False) as reply:
            yield from reply

    def _send(self, path: str, body: dict | None, read: bool):
        """The reply's bytes (`read`), else the open reply for the caller to read and close."""
        full = self.url.rstrip("/") + path
        data = None if body is None else json.dumps(body).encode()
        method = "GET" if body is None else "POST"
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(full, data=data, headers={"Content-Type": "application/json"})
            try:
                reply = urllib.request.urlopen(request, timeout=self.timeout)
                if not read:
                    return reply
                with reply:
                    return reply.read()
            except urllib.error.HTTPError as err:
                payload = err.read()
                if err.code not in RETRY_STATUS or attempt == self.retries:
                    raise HttpError(f"{method} {full}: HTTP {err.code}: {payload[:300]!r}", err.code, payload) from None
            except (urllib.error.URLError, OSError) as err:
                if attempt == self.retries:
                    reason = getattr(err, "reason", err)
                    raise HttpError(f"{method} {full}: no answer ({reason}) after {attempt + 1} attempts; "
                                    "is the server running at that address?") from None
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def get_or_none(self, path: str) -> dict | list | None:
        """GET a JSON document; None when the endpoint is missing, not JSON or no server answers."""
        try:
            return self.get(path)
        except (HttpError, ValueError):
            return None
