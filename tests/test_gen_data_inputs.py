"""`dspine gen-data`'s inputs: the `--prompts` formats and their errors, `--chat-template-kwargs`,
decontamination against the evaluation sets and held-out agentic traces, and the progress bar.
The server is `FakeSGLang` of test_gen_data (deterministic answers, the real SmolLM2 tokenizer)."""

from __future__ import annotations

import json

import pytest
from test_gen_data import fakes, gen, questions, read, tok, write_jsonl  # noqa: F401  (fixtures)

from dspine.data.conversations import ConversationError, read_conversations
from dspine.train import gen_data


def test_openai_and_sharegpt_lines_parse_into_conversations(tmp_path):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    rows = [
        {"id": "o1", "tools": tools, "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Find "}, {"type": "text", "text": "cats."}]},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "search", "arguments": "{}"}}]},
            {"role": "tool", "content": "3 cats", "tool_call_id": "t1"}]},
        {"system": "You are kind.", "conversations": [
            {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
            {"from": "observation", "value": "ok"}, {"from": "user", "value": "Bye"}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                           {"from": "observation", "value": "ok"}, {"from": "user", "value": "Bye"}],
         "system": "You are kind."},                                  # the same conversation again
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
    convs, duplicates = read_conversations(path)
    assert duplicates == 1 and len(convs) == 2
    openai, sharegpt = convs
    assert openai.id == "o1" and openai.tools == tuple(tools) and openai.source == "mixed"
    assert [m["role"] for m in openai.messages] == ["system", "user", "assistant", "tool"]
    assert openai.messages[1]["content"] == "Find cats." and openai.messages[2]["content"] == ""
    assert openai.messages[3]["tool_call_id"] == "t1"
    assert [(m["role"], m["content"]) for m in sharegpt.messages] == [
        ("system", "You are kind."), ("user", "Hi"), ("assistant", "Hello"), ("tool", "ok"), ("user", "Bye")]
    assert sharegpt.id.startswith("mixed/") and len(sharegpt.id) == len("mixed/") + 12
    assert read_conversations(path)[0][1].id == sharegpt.id                   # content ids are stable
    assert sharegpt.user_texts() == ["Hi", "Bye"]


def test_bad_lines_are_named(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "ok"}]}),
        '{"messages": [{"role": "user", "content": "cut',
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),
        json.dumps({"conversations": [{"from": "gpt", "value": "no question"}]}),
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "again"}]}),
        json.dumps({"prompt": "neither format"}),
        json.dumps({"conversations": [{"from": "human", "value": 3}]}),
    ]) + "\n")
    with pytest.raises(ConversationError) as info:
        read_conversations(path)
    problems = info.value.problems
    assert [p.split(": ")[0] for p in problems] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7)]
    assert "malformed JSON" in problems[0] and "bad role 'robot'" in problems[1]
    assert "no user turn" in problems[2] and "repeats line 1" in problems[3]
    assert "`messages` (OpenAI chat) or `conversations` (ShareGPT)" in problems[4]
    assert "`value` must be the turn's text" in problems[5]
    assert gen(tmp_path, "--prompts", path, "--server", "http://127.0.0.1:9") == 2    # before any server is asked
    err = capsys.readouterr().err
    assert "dspine gen-data: error: 6 bad record(s)" in err and f"{path}:3: messages[0]: bad role 'robot'" in err


def test_chat_template_kwargs_reach_the_template(tmp_path, fakes, monkeypatch, capsys):  # noqa: F811
    from dspine.cli import main
    from dspine.engine.targets import load_tokenizer

    tokenizer, stops = load_tokenizer()
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}THINKING-OFF {% endif %}"
                               + tokenizer.chat_template)
    monkeypatch.setattr(gen_data, "load_tokenizer", lambda target=None: (tokenizer, stops))
    fake = fakes()
    prompts = questions(tmp_path, 3)
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url,
               "--chat-template-kwargs", '{"enable_thinking": false}') == 0
    assert len(fake.requests) == 3 and all(tokenizer.decode(p).startswith("THINKING-OFF ") for p, _ in fake.requests)
    assert all(tokenizer.decode(r["ids"]).startswith("THINKING-OFF ") for r in read(tmp_path / "d.jsonl"))
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, out="plain.jsonl") == 0
    assert not any("THINKING-OFF" in tokenizer.decode(p) for p, _ in fake.requests[3:])
    for bad in ("{enable_thinking: false}", "[1]", '{"tools": []}'):
        with pytest.raises(SystemExit):
            main(["gen-data", "--out", str(tmp_path / "x.jsonl"), "--chat-template-kwargs", bad])
        assert "argument --chat-template-kwargs" in capsys.readouterr().err


def _heldout_trace(tmp_path) -> tuple[str, str]:
    """A trace file whose one request is in the held-out split, and its long user turn."""
    from dspine.data.traces import TraceRequest

    for k in range(200):
        text = (f"Variant {k}: rewrite the retry loop of the download manager so that it waits with exponential "
                f"backoff between attempts and gives up after the configured number of tries")
        messages = ({"role": "user", "content": text}, {"role": "assistant", "content": "Sure."},
                    {"role": "user", "content": "continue"})
        if TraceRequest(messages=messages).split == "heldout":
            return write_jsonl(tmp_path / "traces.jsonl", [{"messages": list(messages)}]), text
    raise AssertionError("no held-out request found")


def test_decontamination_drops_planted_eval_and_heldout_prompts(tmp_path, fakes, capsys):  # noqa: F811
    from dspine.data.eval_sets import eval_items

    gsm8k = [q for _, q, _ in eval_items("gsm8k")]
    plain = next(q for q in gsm8k[1:] if len(q.split()) > 30 and all(w.isalpha() for w in q.split()[:20])).split()
    traces, heldout_text = _heldout_trace(tmp_path)
    rows = [
        {"id": "clean", "messages": [{"role": "user", "content": "Tell me about the history of tea in China."}]},
        {"id": "exact-later-turn", "messages": [
            {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "  " + gsm8k[0].upper().replace(" ", "   ") + " "}]},
        {"id": "13-gram", "messages": [{"role": "user", "content": "Please look at this: "
                                        + " ".join(plain[4:17]) + " and tell me what you think."}]},
        {"id": "12-gram", "messages": [{"role": "user", "content": "Please look at this: "
                                        + " ".join(plain[4:16]) + " and tell me what you think."}]},
        {"id": "trace", "conversations": [{"from": "human", "value": "Could you " + heldout_text.lower()}]},
        {"id": "short-common", "messages": [{"role": "user", "content": "Write a haiku."},
                                            {"role": "assistant", "content": "..."},
                                            {"role": "user", "content": "continue"}]},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    fake = fakes()
    capsys.readouterr()
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, "--decontaminate",
               "--heldout-traces", traces) == 0
    out = capsys.readouterr().out
    assert "decontamination dropped 3 conversation(s) {'13-gram': 2, 'exact': 1}" in out and "traces.jsonl" in out
    assert [r["id"] for r in read(tmp_path / "d.jsonl")] == ["clean", "12-gram", "short-common"]
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, out="all.jsonl") == 0    # --no-decontaminate
    assert len(read(tmp_path / "all.jsonl")) == 6


def test_progress_bar_shows_sequences_and_tokens_per_second(tmp_path, fakes, capsys):  # noqa: F811
    from dspine.cli import main

    fake = fakes()
    assert main(["gen-data", "--out", str(tmp_path / "d.jsonl"), "--prompts", questions(tmp_path, 3),
                 "--server", fake.url, "--no-decontaminate", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "gen-data: 100%" in err and "3/3" in err and "seq/s" in err and "tok_s=" in err
