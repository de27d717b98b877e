"""dspine/bench/soak.py (scripts/soak.py) against in-process fake OpenAI-compatible servers.

The fake serves /health, /v1/models, /server_info and /v1/chat/completions (streamed and not, a
few ms per token) on 127.0.0.1 at a free port, and answers the soak's bad requests with 400. Its
variants: it stalls every chat request for a few seconds once, answers bad requests with 500,
accepts them, or answers some /health polls with 503. Each soak is a few seconds long (`--minutes`
as a float, `--warmup-s` and `--stall-min-s` shortened).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import JsonHandler, start_server

from dspine.bench import soak
from dspine.bench.results import check_schema

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"system", "user", "assistant", "tool"}


def fake_server(per_token_s: float = 0.003, bad_status: int = 400, validate: bool = True,
                health_fail: frozenset[int] = frozenset(), stall: tuple[float, float] | None = None):
    """Start a fake. `health_fail`: the (1-based) /health requests answered 503; `stall`: (after,
    for) seconds: from `after` s past the first chat request, every chat request waits until the
    stall has lasted `for` s (once)."""
    lock = threading.Lock()
    state = {"health": 0, "chat": 0, "first": None}

    def invalid(body) -> str | None:
        if not isinstance(body, dict):
            return "body is not an object"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list"
        if any(not isinstance(m, dict) or m.get("role") not in ROLES for m in messages):
            return "unknown role"
        if not isinstance(body.get("max_tokens", 1), int) or body.get("max_tokens", 1) < 0:
            return "max_tokens must be >= 0"
        if body.get("temperature", 0) < 0:
            return "temperature must be >= 0"
        return None

    class Handler(JsonHandler):
        def do_GET(self):
            if self.path == "/health":
                with lock:
                    state["health"] += 1
                    n = state["health"]
                return self.send_json({}, 503 if n in health_fail else 200)
            if self.path == "/v1/models":
                return self.send_json({"data": [{"id": "fake-model"}]})
            if self.path == "/server_info":
                return self.send_json({"version": "0.0-fake"})
            self.send_json({"error": "not found"}, 404)

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/chat/completions":
                return self.send_json({"error": "not found"}, 404)
            with lock:
                state["chat"] += 1
                state["first"] = state["first"] or time.monotonic()
                first = state["first"]
            if stall is not None:
                begin, end = first + stall[0], first + stall[0] + stall[1]
                if begin <= time.monotonic() < end:
                    time.sleep(end - time.monotonic())
            try:
                body = json.loads(raw)
                problem = invalid(body)
            except ValueError:
                problem = "malformed JSON"
            if problem and validate:
                return self.send_json({"error": {"message": problem}}, bad_status)
            n = max(1, min(int(body.get("max_tokens") or 1) if isinstance(body, dict) else 1, 64))
            if not body.get("stream"):
                time.sleep(per_token_s * n)
                return self.send_json({"id": "c", "object": "chat.completion", "model": "fake-model",
                                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "t " * n},
                                                    "finish_reason": "length"}],
                                       "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(n):
                time.sleep(per_token_s)
                chunk = {"id": "c", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": "t "}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    server = start_server(Handler)
    server.state = state
    return server


@pytest.fixture
def fake():
    started = []

    def start(**kwargs):
        server = fake_server(**kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def soak_args(url: str, out: Path, seconds: float, *extra: str) -> list[str]:
    return ["--url", url, "--minutes", f"{seconds / 60:.5f}", "--out", str(out), "--health-interval-s", "0.2",
            "--memory-interval-s", "0.5", "--progress-s", "1", "--request-timeout", "10", *extra]


def read_results(out: Path, config: str) -> dict:
    results = json.loads((out / f"soak_{config}.json").read_text())
    check_schema(results, soak.SOAK_SCHEMA, "soak")
    for key, kind in soak.SOAK_SCHEMA.items():  # the exact types, not only compatible ones
        assert type(results[key]) is kind, (key, results[key])
    return results


# ---------------------------------------------------------------------------------------------
# Whole soaks
# ---------------------------------------------------------------------------------------------

def test_healthy_server_passes(fake, tmp_path, capsys):
    server = fake(per_token_s=0.005)
    rc = soak.main(soak_args(server.url, tmp_path, 3.6, "--clients", "4", "--warmup-s", "0.5", "--max-tokens", "8",
                             "32", "--bad-fraction", "0.1", "--seed", "3", "--config", "fake ok",
                             "--server-pid", str(os.getpid())))
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    r = read_results(tmp_path, "fake_ok")
    assert r["config"] == "fake ok" and r["model"] == "fake-model" and r["versions"]["sglang_server"] == "0.0-fake"
    assert r["passed"] and r["complete"] and not r["interrupted"] and r["failed_checks"] == []
    assert 0.05 <= r["minutes"] <= 0.07 and r["minutes_requested"] == pytest.approx(0.06)
    assert r["errors"] == 0 and r["health_non_200"] == 0 and not r["stalls"]
    assert r["requests"] >= 40
    c = r["counts"]
    assert c["bad"] > 0 and c["bad_answered_4xx"] == c["bad"] and c["good"] + c["bad"] == r["requests"]
    assert 0 < c["streamed"] < c["good"] and c["stream_chunks"] >= 8 * c["streamed"]
    assert 1.0 <= r["max_latency_over_p99"] <= 2.0
    steady = r["latency_ms"]["steady"]
    assert steady["n"] < r["latency_ms"]["all"]["n"] and steady["p50"] <= steady["p99"] <= steady["max"]
    assert steady["p50"] >= 8 * 5  # the fake's time per token, at least 8 tokens
    assert r["health"]["checks"] >= 10
    rss = r["memory"]["rss_mib"]
    assert rss and rss["samples"] >= 5 and rss["max"] >= rss["first"] > 0 and r["memory"]["rss_tree_mib"]
    assert r["device"] and r["command"] and r["date"]
    assert "soak [" in out.out and "soak: PASSED" in out.out and "max_latency_over_p99" in out.out


def test_a_stall_is_detected(fake, tmp_path, capsys):
    server = fake(per_token_s=0.001, stall=(1.5, 2.5))
    rc = soak.main(soak_args(server.url, tmp_path, 5.0, "--clients", "2", "--warmup-s", "0.3", "--max-tokens", "1",
                             "4", "--bad-fraction", "0", "--stall-min-s", "1", "--config", "stall"))
    err = capsys.readouterr().err
    assert rc == 1
    r = read_results(tmp_path, "stall")
    assert r["errors"] == 0 and r["health_non_200"] == 0
    assert r["stalls"] and max(s["gap_s"] for s in r["stalls"]) >= 2.0, r["stalls"]
    assert r["max_latency_over_p99"] > 2.0 and r["latency_ms"]["steady"]["max"] >= 2000
    assert {"stalls", "max_latency_over_p99"} <= set(r["failed_checks"]) and not r["passed"]
    assert "FAILED check stalls" in err and "FAILED check max_latency_over_p99" in err


def test_a_bad_request_answered_500_is_an_error(fake, tmp_path, capsys):
    server = fake(per_token_s=0.002, bad_status=500)
    rc = soak.main(soak_args(server.url, tmp_path, 1.8, "--clients", "2", "--warmup-s", "0.2", "--max-tokens", "4",
                             "8", "--bad-fraction", "0.3", "--config", "bad500"))
    assert rc == 1
    r = read_results(tmp_path, "bad500")
    assert r["counts"]["bad"] > 0 and r["counts"]["bad_answered_4xx"] == 0
    assert r["errors"] == r["counts"]["bad"]
    assert r["errors_by_kind"] == {"bad_request_answered_5xx": r["errors"]}
    assert "errors" in r["failed_checks"] and r["error_samples"][0]["status"] == 500
    assert "FAILED check errors" in capsys.readouterr().err


def test_health_503_is_counted(fake, tmp_path, capsys):
    server = fake(per_token_s=0.002, health_fail=frozenset({2, 3, 4}))  # the 1st is the soak's own pre-check
    rc = soak.main(soak_args(server.url, tmp_path, 2.0, "--clients", "2", "--warmup-s", "0.2", "--max-tokens", "4",
                             "8", "--config", "health"))
    assert rc == 1
    r = read_results(tmp_path, "health")
    assert r["health_non_200"] == 3 and r["health"]["statuses"] == {"503": 3}
    assert r["health"]["checks"] >= 5 and r["errors"] == 0
    assert "health_non_200" in r["failed_checks"]
    assert "FAILED check health_non_200" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://10.1.2.3:30000", "http://example.com:30000", "https://8.8.8.8/v1",
                                 "ftp://127.0.0.1:30000", "127.0.0.1:30000"])
def test_a_non_local_url_is_refused(url, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        soak.main(["--url", url, "--minutes", "0.1", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--url" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_local_urls_are_accepted():
    assert soak.local_base_url("http://127.0.0.1:30000") == "http://127.0.0.1:30000"
    assert soak.local_base_url("http://localhost:30000/v1/") == "http://localhost:30000"
    assert soak.local_base_url("http://[::1]:8080") == "http://[::1]:8080"
    with pytest.raises(soak.SoakError, match="not this machine"):
        soak.local_base_url("http://192.168.0.10:30000")


def test_no_server_fails_before_the_load(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert soak.main(["--url", f"http://127.0.0.1:{port}", "--minutes", "1", "--out", str(tmp_path)]) == 1
    assert "not healthy before the soak" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_ctrl_c_stops_and_still_writes_results(fake, tmp_path):
    server = fake(per_token_s=0.002)
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"),
           *soak_args(server.url, tmp_path, 300, "--clients", "2", "--max-tokens", "2", "4", "--config", "int")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Ctrl-C as a terminal delivers it: a test runner started in the background (`cmd &` in a script)
    # ignores SIGINT and its children inherit that, and a Python started so installs no handler.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while server.state["chat"] < 30 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert server.state["chat"] >= 30, "the soak never loaded the fake"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    assert "interrupted" in out and "FAILED check ran_full_time" in err
    r = read_results(tmp_path, "int")
    assert r["interrupted"] and r["complete"] and r["requests"] >= 30 and r["minutes"] < 0.5
    assert r["errors"] == 0


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------

def test_every_bad_kind_wants_a_4xx(fake):
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 4}
    strict, five, lax = fake(), fake(bad_status=500), fake(validate=False)
    for kind in soak.BAD_KINDS:
        ok = soak.send_bad(strict.url, kind, good, 5.0, time.monotonic())
        assert (ok.status, ok.error) == (400, None), kind
        assert soak.send_bad(five.url, kind, good, 5.0, time.monotonic()).error == "bad_request_answered_5xx", kind
    accepted = soak.send_bad(lax.url, "negative_temperature", good, 5.0, time.monotonic())
    assert accepted.error == "bad_request_accepted_200"
    with pytest.raises(ValueError):
        json.loads(soak.bad_body("malformed_json", good))


def test_good_requests_against_the_fake(fake):
    server = fake(per_token_s=0.001)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "max_tokens": 5}
    streamed = soak.send_good(server.url, body, True, 5.0, time.monotonic())
    assert (streamed.error, streamed.status, streamed.chunks) == (None, 200, 5) and streamed.good_ok
    plain = soak.send_good(server.url, body, False, 5.0, time.monotonic())
    assert plain.good_ok and plain.latency > 0
    refused = soak.send_good(server.url, {**body, "messages": []}, False, 5.0, time.monotonic())
    assert (refused.status, refused.error, refused.good_ok) == (400, None, False)  # reported, not an error


def test_a_request_that_gets_no_answer_times_out():
    listener = socket.socket()  # accepts connections (backlog) but never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        t = time.monotonic()
        for stream in (False, True):
            assert soak.send_good(url, body, stream, 0.3, t).error == "timeout"
        assert soak.send_bad(url, "empty_messages", body, 0.3, t).error == "timeout"
        assert time.monotonic() - t < 5
    finally:
        listener.close()


@pytest.mark.parametrize("lines, want", [
    ([b'data: {"choices": []}', b"", b'data: {"choices": []}', b"data: [DONE]"], (2, None)),
    ([b": keep-alive", b'data: {"choices": []}', b"data: [DONE]", b"trailing"], (1, None)),
    ([b'data: {"choices": []}', b'data: {"choices": []}'], (2, "stream_no_done")),
    ([b'data: {"choices": []}', b'data: {"error": {"message": "boom"}}', b"data: [DONE]"], (1, "stream_error_chunk")),
    ([b"data: {not json", b"data: [DONE]"], (0, "stream_bad_json")),
    ([b"data: [DONE]"], (0, "stream_no_chunks")),
])
def test_read_sse(lines, want):
    chunks, error, _ = soak.read_sse(lines, time.monotonic() + 60)
    assert (chunks, error) == want


def test_read_sse_stops_at_the_deadline():
    def slow():
        while True:
            time.sleep(0.05)
            yield b'data: {"choices": []}'
    chunks, error, _ = soak.read_sse(slow(), time.monotonic() + 0.3)
    assert error == "timeout" and 2 <= chunks <= 8


def test_percentile_and_stalls():
    assert soak.percentile([], 99) is None
    assert soak.percentile([5.0], 99) == 5.0
    assert soak.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert soak.percentile([1.0, 2.0], 50) == pytest.approx(1.5)
    # the start and the end of the load bound the gaps
    assert soak.find_stalls([1.0, 2.0, 9.0], 0.0, 10.0, 5.0) == [{"from_s": 2.0, "to_s": 9.0, "gap_s": 7.0}]
    assert [s["from_s"] for s in soak.find_stalls([6.0], 0.0, 13.0, 5.0)] == [0.0, 6.0]
    assert soak.find_stalls([1.0, 2.0, 3.0], 0.0, 4.0, 5.0) == []
    assert soak.warmup_seconds(600, None) == 60 and soak.warmup_seconds(120, None) == pytest.approx(12)
    assert soak.warmup_seconds(600, 2.5) == 2.5


def test_summarize_counts_and_steady_state():
    O = soak.Outcome
    # 100 ms each; none completes between 10.5 s and 16 s (but the timeout's end)
    ok = [O(0.5 + 0.1 * i + 5.5 * (i >= 100), 0.6 + 0.1 * i + 5.5 * (i >= 100), "good", i % 2 == 0, 200)
          for i in range(200)]
    warm = [O(0.0, 0.45, "good", False, 200)]    # slow, in the warm-up: out of the steady p99, in the max ratio
    slow = [O(10.0, 10.25, "good", False, 200)]               # 250 ms: the steady max
    others = [O(5.0, 5.01, "unknown_role", False, 400),
              O(5.0, 5.01, "empty_messages", False, 500, "bad_request_answered_5xx"),
              O(6.0, 6.02, "good", False, 400),                # a good request refused: not an error
              O(6.0, 16.0, "good", True, None, "timeout"),
              O(7.0, 7.01, "good", False, 503, "http_503")]
    r = soak.summarize(ok + warm + slow + others, 21.6, 0.5, 5.0)
    assert r["requests"] == 207 and r["errors"] == 3
    assert r["errors_by_kind"] == {"bad_request_answered_5xx": 1, "timeout": 1, "http_503": 1}
    c = r["counts"]
    assert (c["good"], c["good_ok"], c["good_rejected_4xx"], c["bad"], c["bad_answered_4xx"], c["timeouts"]) == \
        (205, 202, 1, 2, 1, 1)
    steady = r["latency_ms"]["steady"]
    assert steady["n"] == 201 and steady["max"] == pytest.approx(250) and steady["p99"] == pytest.approx(100)
    assert r["max_latency_over_p99"] == pytest.approx(4.5)   # the warm-up request (450 ms) counts: a start-up stall must show
    assert r["latency_ms"]["all"]["max"] == pytest.approx(450)
    assert r["stall_threshold_s"] == 5.0 and r["stalls"] == [{"from_s": 10.5, "to_s": 16.0, "gap_s": 5.5}]


def test_prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n\n'
                    '[{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]\n'
                    '{"messages": [{"role": "user", "content": "t"}], "tools": [{"type": "function"}]}\n')
    prompts = soak.load_prompt_file(path)
    assert [len(p["messages"]) for p in prompts] == [1, 2, 1] and prompts[2]["tools"]
    path.write_text('{"messages": []}\n')
    with pytest.raises(soak.SoakError, match=":1:"):
        soak.load_prompt_file(path)
