"""`dspine gen-data`: the transformers path and the SGLang-server path give the same records; a run
at scale resumes, retries, spreads over several servers, and regenerates every assistant turn.

The first stub speaks SGLang's native `/generate` (batched `input_ids`, `output_ids`,
`meta_info.finish_reason`) with answers of the real SmolLM2 target, the stop token left out of
`output_ids` as SGLang may do; the records must still equal the transformers path's, stop tokens
included. `FakeSGLang` answers deterministically without a model (tests of the run itself), with
the real SmolLM2 tokenizer and chat template.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch
from conftest import JsonHandler, start_server

from dspine.data.prompts import Prompt, save_prompts
from dspine.engine.targets import load_target, load_tokenizer, stop_token_ids
from dspine.train import gen_data
from dspine.train.cli import cmd_gen_data

PROMPTS = [Prompt("t/0", [{"role": "user", "content": "Say hello."}], "test"),
           Prompt("t/1", [{"role": "user", "content": "What is 2 + 3? Answer with a number only."}], "test"),
           Prompt("t/2", [{"role": "user", "content": "Name a colour."}], "test")]
MAX_NEW = 12


@pytest.fixture(scope="module")
def smollm2():
    target, tokenizer = load_target()
    return target, tokenizer, stop_token_ids(tokenizer, target)


@pytest.fixture
def sglang_stub(smollm2):
    """A stub of SGLang's `/generate`: greedy answers of the real target, stop token stripped."""
    target, _, stops = smollm2
    seen: list[dict] = []

    class Handler(JsonHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            params = body["sampling_params"]
            replies = []
            for ids in body["input_ids"]:
                with torch.no_grad():
                    out = target.generate(input_ids=torch.tensor([ids]), max_new_tokens=params["max_new_tokens"],
                                          do_sample=False, eos_token_id=params["stop_token_ids"],
                                          pad_token_id=stops[0])
                answer = out[0, len(ids):].tolist()
                if answer and answer[-1] in params["stop_token_ids"]:
                    finish = {"type": "stop", "matched": answer.pop()}
                else:
                    finish = {"type": "length", "length": len(answer)}
                replies.append({"text": "", "output_ids": answer, "meta_info": {"finish_reason": finish}})
            self.send_json(replies)

    server = start_server(Handler)
    url = server.url
    yield url, seen
    server.shutdown()


@pytest.mark.slow
def test_server_path_equals_transformers_path(smollm2, sglang_stub, tmp_path):
    from dspine.cli import main

    target, tokenizer, stops = smollm2
    url, seen = sglang_stub
    from dspine.data.conversations import Conversation

    talk = Conversation("t/multi", "test", ({"role": "user", "content": "Name a fruit."},
                                            {"role": "assistant", "content": "(regenerated)"},
                                            {"role": "user", "content": "And a vegetable?"}))
    local = list(gen_data.generate_answers(target, tokenizer, [*PROMPTS, talk], max_prompt_tokens=384,
                                           max_new_tokens=MAX_NEW, batch_size=2, temperature=0.0, seed=0))
    assert len(local) == 4 and len(next(r for r in local if r["id"] == "t/multi")["answer_spans"]) == 2
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "source": p.source, "messages": list(p.messages)}) + "\n"
                               for p in [*PROMPTS, talk]))
    out = tmp_path / "served.jsonl"
    assert main(["gen-data", "--out", str(out), "--prompts", str(prompts), "--server", url, "--concurrency", "2",
                 "--max-new-tokens", str(MAX_NEW), "--no-decontaminate", "-q"]) == 0
    served = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "target"} for r in served] == \
        sorted(local, key=lambda r: [p.id for p in [*PROMPTS, talk]].index(r["id"]))   # the file is in prompt order
    assert [len(b["input_ids"]) for b in seen] == [1] * 5          # one request per conversation turn
    assert any(r["ids"][-1] in stops for r in served), "no answer ended on a stop token: the test lost its point"


def test_server_answers_cut_and_complete_stop_tokens():
    replies = [{"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}},
               {"output_ids": [5, 2, 7], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}},
               {"output_ids": [8, 9], "meta_info": {"finish_reason": {"type": "length", "length": 2}}},
               {"output_ids": [8], "meta_info": {"finish_reason": {"type": "stop", "matched": "</s>"}}}]

    class Handler(JsonHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_json(replies)

    server = start_server(Handler)
    url = server.url
    try:
        got = gen_data.server_answers(url, [[1]] * 4, [2], max_new_tokens=4, temperature=0.0, seed=0)
    finally:
        server.shutdown()
    assert got == [[5, 6, 2], [5, 2], [8, 9], [8]]


def test_errors_name_the_cause(tmp_path, monkeypatch, capsys):
    with pytest.raises(gen_data.GenDataError, match="no SGLang server answers at .*drop --server"):
        gen_data.server_answers("http://127.0.0.1:9", [[1]], [2], max_new_tokens=1, temperature=0.0, seed=0)

    save_prompts(tmp_path / "train.jsonl", PROMPTS)
    args = type("Args", (), dict(samples_per_prompt=3, temperature=0.0, num_prompts=None, seed=0, server=None,
                                 out=str(tmp_path / "d.jsonl"), prompts_dir=str(tmp_path)))()
    assert cmd_gen_data(args) == 2
    assert "--samples-per-prompt > 1 with greedy decoding" in capsys.readouterr().err
    args.samples_per_prompt, args.top_p, args.top_k = 1, 0.95, 0
    assert cmd_gen_data(args) == 2
    assert "--top-p/--top-k shape sampled answers" in capsys.readouterr().err
    args.temperature, args.top_p = 1.0, 1.5
    assert cmd_gen_data(args) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "d.jsonl").exists()


def test_samples_per_prompt_ids():
    repeated = gen_data._repeat_for_samples(PROMPTS[:2], 3, sampled=True)
    assert [p.id for p in repeated] == ["t/0#0", "t/0#1", "t/0#2", "t/1#0", "t/1#1", "t/1#2"]
    assert repeated[4].messages == PROMPTS[1].messages
    # one sampled answer per prompt still gets '#0': it joins a greedy file without clashing ids
    assert [p.id for p in gen_data._repeat_for_samples(PROMPTS[:2], 1, sampled=True)] == ["t/0#0", "t/1#0"]
    assert [p.id for p in gen_data._repeat_for_samples(PROMPTS[:2], 1, sampled=False)] == ["t/0", "t/1"]


@pytest.mark.slow
def test_top_k_one_sampling_is_greedy(smollm2):
    """T=1 with top-k 1 keeps only the argmax: the sampled answers must equal the greedy ones. Without
    an explicit top_k, transformers would sample from its generation config's top-k 50 instead."""
    target, tokenizer, _ = smollm2
    common = dict(max_prompt_tokens=384, max_new_tokens=MAX_NEW, batch_size=3, seed=0)
    greedy = list(gen_data.generate_answers(target, tokenizer, PROMPTS, temperature=0.0, **common))
    top1 = list(gen_data.generate_answers(target, tokenizer, PROMPTS, temperature=1.0, top_k=1, **common))
    assert top1 == greedy
    wide = list(gen_data.generate_answers(target, tokenizer, PROMPTS, temperature=5.0, **common))
    assert wide != greedy, "T=5 sampling matched greedy on every prompt: the test lost its point"


def test_server_gets_the_sampling_settings():
    seen: list[dict] = []

    class Handler(JsonHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_json([{"output_ids": [4], "meta_info": {}}])

    server = start_server(Handler)
    try:
        gen_data.server_answers(server.url, [[1]], [2], max_new_tokens=4, temperature=1.0, seed=7, top_p=0.95,
                                top_k=20)
        gen_data.server_answers(server.url, [[1]], [2], max_new_tokens=4, temperature=0.8, seed=7)
        gen_data.server_answers(server.url, [[1]], [2], max_new_tokens=4, temperature=0.0, seed=7, top_p=0.5)
    finally:
        server.shutdown()
    params = [b["sampling_params"] for b in seen]
    assert (params[0]["temperature"], params[0]["top_p"], params[0]["top_k"], params[0]["sampling_seed"]) == \
        (1.0, 0.95, 20, 7)
    assert (params[1]["top_p"], params[1]["top_k"]) == (1.0, -1)    # off, in SGLang's terms
    assert "top_p" not in params[2] and "sampling_seed" not in params[2]   # greedy: no sampling settings


@pytest.mark.slow
def test_records_carry_their_targets_identity(smollm2, sglang_stub, tmp_path):
    from dspine.engine.targets import target_identity

    target, _, _ = smollm2
    url, _ = sglang_stub
    save_prompts(tmp_path / "train.jsonl", PROMPTS)
    args = type("Args", (), dict(samples_per_prompt=1, temperature=0.0, top_p=1.0, top_k=0, num_prompts=None, seed=0,
                                 server=url, target=None, max_prompt_tokens=384, max_new_tokens=4, batch_size=2,
                                 concurrency=1, quiet=True, device=None, out=str(tmp_path / "d.jsonl"),
                                 prompts_dir=str(tmp_path), data_dir=None))()
    assert cmd_gen_data(args) == 0
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    identity = target_identity(target.config, "smollm2-135m-instruct")
    assert [r["id"] for r in records] == [p.id for p in PROMPTS]
    assert all(r["target"] == {"name": "smollm2-135m-instruct", "fingerprint": identity["fingerprint"]}
               for r in records)


# --------------------------------------------------------------------------- runs at scale (no model)
STOP = 2   # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tok():
    tokenizer, stops = load_tokenizer()
    assert stops[0] == STOP
    return tokenizer


class FakeSGLang:
    """SGLang's native `/generate` without a model, one prompt per request: the answer to a prompt
    is the text "Reply <n> (<h>)." + <|im_end|>, n = the assistant generation prompts in it (the turn),
    h a hash of its ids; cut to `max_new_tokens` (finish "length") like SGLang. `output_ids` leave the
    stop token out (finish_reason.matched names it). `failures`: how the first calls fail, one entry
    per call: "503"/"500"/"400" (that HTTP status), "drop" (connection closed unanswered), "slow"
    (an answer after 1.5 s). `die_after`: HTTP 500 to every call after that many."""

    def __init__(self, tokenizer, failures=(), die_after=None):
        self.tokenizer, self.failures, self.die_after = tokenizer, list(failures), die_after
        self.requests: list[tuple[list[int], list[int]]] = []     # (prompt ids, answer ids with stop)
        self.calls = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                self.send_json({"model_path": "fake"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.calls += 1
                    call = fake.calls
                failure = fake.failures[call - 1] if call <= len(fake.failures) else None
                if fake.die_after is not None and call > fake.die_after:
                    failure = "500"
                if failure == "drop":
                    self.close_connection = True
                    return
                if failure == "slow":
                    time.sleep(1.5)
                elif failure:
                    self.send_json({"error": f"planted {failure}"}, code=int(failure))
                    return
                replies = []
                for prompt in body["input_ids"]:
                    answer = fake.answer(prompt)[:body["sampling_params"]["max_new_tokens"]]
                    with fake.lock:
                        fake.requests.append((prompt, answer))
                    if answer[-1] == STOP:
                        replies.append({"output_ids": answer[:-1],
                                        "meta_info": {"finish_reason": {"type": "stop", "matched": STOP}}})
                    else:
                        replies.append({"output_ids": answer, "meta_info": {"finish_reason": {"type": "length"}}})
                try:
                    self.send_json(replies)
                except OSError:
                    pass        # the client gave up ("slow")

        self.server = start_server(Handler)
        self.url = self.server.url

    def answer(self, prompt: list[int]) -> list[int]:
        with self.lock:         # one tokenizer, several handler threads
            turn = self.tokenizer.decode(prompt).count("<|im_start|>assistant")
            digest = sum((i + 1) * t for i, t in enumerate(prompt)) % 9973
            return self.tokenizer.encode(f"Reply {turn} ({digest}).", add_special_tokens=False) + [STOP]

    def answer_to(self, prompt: list[int]) -> list[int]:
        return next(a for p, a in self.requests if p == prompt)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes(tok):
    made: list[FakeSGLang] = []

    def make(**kw) -> FakeSGLang:
        made.append(FakeSGLang(tok, **kw))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"     # closed again: nothing listens there


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def questions(tmp_path, n: int) -> str:
    return write_jsonl(tmp_path / "q.jsonl", [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}]} for i in range(n)])


def gen(tmp_path, *argv, out="d.jsonl") -> int:
    from dspine.cli import main

    return main(["gen-data", "--out", str(tmp_path / out), "--no-decontaminate", "-q", "--retry-backoff", "0",
                 "--max-new-tokens", "32", *map(str, argv)])


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_after_a_kill_gives_exactly_the_full_set(tmp_path, fakes, tok, monkeypatch, capsys):
    from dspine.train.gen_data_store import RecordStore

    fake = fakes()
    prompts = questions(tmp_path, 12)
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, out="ref.jsonl") == 0   # uninterrupted
    reference = (tmp_path / "ref.jsonl").read_text()
    assert [r["id"] for r in read(tmp_path / "ref.jsonl")] == [f"c{i}" for i in range(12)]

    real_append, kept = RecordStore.append, []

    def killed_after_5(self, record):
        if len(kept) == 5:
            raise RuntimeError("killed")
        kept.append(record["id"])
        real_append(self, record)

    monkeypatch.setattr(RecordStore, "append", killed_after_5)
    with pytest.raises(RuntimeError, match="killed"):
        gen(tmp_path, "--prompts", prompts, "--server", fake.url, "--concurrency", "3")
    monkeypatch.undo()
    for worker in threading.enumerate():     # the killed run's requests in flight end (a CLI process exits)
        if worker.name == "gen-data-worker":
            worker.join(10)
    out, partial = tmp_path / "d.jsonl", tmp_path / "d.jsonl.partial"
    assert not out.exists() and [r["id"] for r in read(partial)] == kept
    missing = sorted({f"c{i}" for i in range(12)} - set(kept))
    with open(partial, "ab") as f:           # a record cut by a kill mid-write: never read back
        f.write(b'{"id": "' + missing[0].encode() + b'", "ids": [1, 2')
    capsys.readouterr()
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url) == 2       # not without --resume
    assert "--resume" in capsys.readouterr().err

    before = len(fake.requests)
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, "--concurrency", "3", "--resume") == 0
    asked = sorted(f"c{tok.decode(p).split('Question number ')[1].split(':')[0]}" for p, _ in fake.requests[before:])
    assert asked == missing                                      # only the missing ones were asked, once each
    assert out.read_text() == reference and not partial.exists()   # the full set, once each, in prompt order
    before = len(fake.requests)
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, "--resume") == 0
    assert len(fake.requests) == before and out.read_text() == reference


def test_retries_ride_out_failures_and_failed_requests_are_reported(tmp_path, fakes, capsys):
    prompts = questions(tmp_path, 4)
    flaky = fakes(failures=["503", "drop", "slow"])
    assert gen(tmp_path, "--prompts", prompts, "--server", flaky.url, "--concurrency", "1", "--retries", "3",
               "--request-timeout", "0.5") == 0
    assert len(read(tmp_path / "d.jsonl")) == 4 and flaky.calls == 4 + 3

    failing = fakes(failures=["500", "500"])      # the first conversation runs out of its 2 attempts
    capsys.readouterr()
    assert gen(tmp_path, "--prompts", prompts, "--server", failing.url, "--concurrency", "1", "--retries", "1",
               out="e.jsonl") == 1
    err = capsys.readouterr().err
    assert "1 conversation(s) failed after --retries 1" in err and "c0: 2 attempts failed, last: HTTP 500" in err
    assert [r["id"] for r in read(tmp_path / "e.jsonl")] == ["c1", "c2", "c3"]       # the rest is kept
    assert gen(tmp_path, "--prompts", prompts, "--server", failing.url, "--resume", out="e.jsonl") == 0
    assert [r["id"] for r in read(tmp_path / "e.jsonl")] == ["c0", "c1", "c2", "c3"]

    refusing = fakes(failures=["400"])            # a 4xx cannot succeed by repeating: no retry
    assert gen(tmp_path, "--prompts", prompts, "--server", refusing.url, "--concurrency", "1", out="f.jsonl") == 1
    assert refusing.calls == 4 and "HTTP 400" in capsys.readouterr().err


def test_requests_spread_over_servers_and_dead_ones_are_dropped(tmp_path, fakes, capsys):
    prompts = questions(tmp_path, 16)
    a, b, down = fakes(), fakes(), dead_url()
    assert gen(tmp_path, "--prompts", prompts, "--server", down, "--server", f"{a.url},{b.url}",
               "--concurrency", "4") == 0
    assert f"dropping server {down}" in capsys.readouterr().err
    assert len(read(tmp_path / "d.jsonl")) == 16 and a.calls + b.calls == 16 and min(a.calls, b.calls) >= 3

    dying, healthy = fakes(die_after=2), fakes()        # one server starts failing mid-run
    assert gen(tmp_path, "--prompts", prompts, "--server", dying.url, "--server", healthy.url, "--concurrency", "2",
               "--drop-server-after", "0", out="e.jsonl") == 0
    assert f"dropping server {dying.url}" in capsys.readouterr().err
    assert [r["id"] for r in read(tmp_path / "e.jsonl")] == [f"c{i}" for i in range(16)]
    assert dying.calls - 2 <= 3 + 2      # dropped after 3 failures in a row (+ attempts already in flight)
    assert gen(tmp_path, "--prompts", prompts, "--server", dead_url(), out="g.jsonl") == 2
    assert "no SGLang server answers at" in capsys.readouterr().err


MULTI_TURN = [
    {"id": "agent", "tools": [{"type": "function", "function": {"name": "read_file", "parameters": {}}}],
     "messages": [{"role": "system", "content": "You are a coding agent."},
                  {"role": "user", "content": "Fix the bug in utils.py."},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
                  {"role": "tool", "content": "def add(a, b):\n    return a - b\n"},
                  {"role": "assistant", "content": "ORIGINAL ASSISTANT TEXT one"},
                  {"role": "user", "content": "Now add a test."},
                  {"role": "assistant", "content": "ORIGINAL ASSISTANT TEXT two"}]},
    {"id": "chat", "conversations": [{"from": "human", "value": "Hi there, who are you?"},
                                     {"from": "gpt", "value": "ORIGINAL ASSISTANT TEXT three"},
                                     {"from": "human", "value": "Tell me a joke."}]},
]


def test_multi_turn_records_regenerate_every_assistant_turn(tmp_path, fakes, tok):
    from dspine.train.trainer import load_records

    fake = fakes()
    prompts = write_jsonl(tmp_path / "multi.jsonl", MULTI_TURN)
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, "--concurrency", "2") == 0
    records = {r["id"]: r for r in read(tmp_path / "d.jsonl")}
    assert [len(records[i]["answer_spans"]) for i in ("agent", "chat")] == [3, 2]
    for rec in records.values():
        ids, spans = rec["ids"], rec["answer_spans"]
        assert rec["answer_start"] == spans[0][0] and spans[-1][1] == len(ids)
        replies = []
        for k, (start, end) in enumerate(spans):
            answer = fake.answer_to(ids[:start])           # the request of turn k was exactly the record's prefix
            assert ids[start:end] == answer and answer[-1] == STOP
            assert tok.decode(ids[start:end]).startswith(f"Reply {k + 1} (")
            prompt_text = tok.decode(ids[:start])
            assert all(r in prompt_text for r in replies)  # conditioned on the target's own earlier answers
            assert "ORIGINAL ASSISTANT TEXT" not in prompt_text
            replies.append(tok.decode(answer[:-1]))
        # `ids` is the whole conversation as the template renders it, with the regenerated answers
        conv = [m for m in (MULTI_TURN[0]["messages"] if rec["id"] == "agent" else
                            [{"role": "user", "content": "Hi there, who are you?"}, {"role": "assistant"},
                             {"role": "user", "content": "Tell me a joke."}, {"role": "assistant"}])]
        filled, answers = [], iter(replies)
        for m in conv:
            filled.append({"role": "assistant", "content": next(answers)} if m["role"] == "assistant"
                          else {"role": m["role"], "content": m["content"]})
        text = tok.apply_chat_template(filled, tokenize=False)
        assert ids == tok.encode(text, add_special_tokens=False)[:len(ids)]
    assert "Fix the bug in utils.py." in tok.decode(records["agent"]["ids"][:records["agent"]["answer_spans"][1][0]])
    assert len(load_records(tmp_path / "d.jsonl")) == 2        # the trainer reads them


def test_long_contexts_survive_and_max_len_cuts_at_a_turn(tmp_path, fakes, capsys):
    fake = fakes()
    listing = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}" for i in range(260))
    conv = {"id": "long", "messages": [{"role": "user", "content": "Review this module:\n" + listing},
                                       {"role": "assistant", "content": "a"},
                                       {"role": "user", "content": "And the tests?"},
                                       {"role": "assistant", "content": "b"},
                                       {"role": "user", "content": "Thanks. Summarise."}]}
    prompts = write_jsonl(tmp_path / "long.jsonl", [conv])
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url) == 0
    full = read(tmp_path / "d.jsonl")[0]
    assert full["answer_spans"][0][0] > 2048 and len(full["answer_spans"]) == 3

    second_end = full["answer_spans"][1][1]
    for max_len in (second_end + 3, full["answer_spans"][2][0] + 4):   # turn 3 not asked; asked but cut
        assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, "--max-len", max_len, out="m.jsonl") == 0
        cut = read(tmp_path / "m.jsonl")[0]
        assert cut["answer_spans"] == full["answer_spans"][:2] and cut["ids"] == full["ids"][:second_end]
    assert "1 conversation(s) cut at a turn by --max-len" in capsys.readouterr().out
    assert gen(tmp_path, "--prompts", prompts, "--server", fake.url, "--max-len", 1000, out="n.jsonl") == 2
    assert "1 conversation(s) too long" in capsys.readouterr().err


def test_the_trainer_reads_labels_only_inside_answer_spans(tmp_path):
    from dspine.train.blocks import make_block_batch
    from dspine.train.config import TrainConfigError
    from dspine.train.trainer import load_records

    ids = list(range(100, 160))
    rec = {"id": "x", "ids": ids, "answer_start": 10, "answer_spans": [[10, 20], [35, 50]]}
    inside = set(range(10, 20)) | set(range(35, 50))
    b = make_block_batch([rec], block_size=4, blocks_per_seq=64, window=8, max_len=64,
                         generator=torch.Generator().manual_seed(0), length_multiple=16)
    anchors = b.anchors[0].tolist()
    assert all(a in inside and a + 1 in inside for a in anchors)
    assert {a < 20 for a in anchors} == {True, False}                      # both spans are drawn from
    assert set(anchors) == {a for a in inside if a + 1 in inside}        # 23 starts < 64 blocks: each one
    masked, labelled = 0, set()
    for k, a in enumerate(anchors):
        want = [ids[a + j] if a + j in inside else -100 for j in range(1, 4)]
        if b.labels[k].tolist() == [-100] * 3 and a in labelled:           # a repeat carries no labels
            continue
        assert b.labels[k].tolist() == want and a not in labelled
        labelled.add(a)
        masked += sum(a + j not in inside and a + j < len(ids) for j in range(1, 4))
    assert labelled == set(anchors)
    assert masked > 0, "no label fell between the spans: the test lost its point"
    plain = make_block_batch([{"ids": ids, "answer_start": 10}], block_size=4, blocks_per_seq=64, window=8,
                             max_len=64, generator=torch.Generator().manual_seed(0), length_multiple=16)
    first = [k for k, a in enumerate(plain.anchors[0].tolist()) if k == 0 or plain.anchors[0][k - 1] != a]
    keep = torch.tensor(first)[plain.anchors[0][first] + 3 < 60]
    assert (plain.labels[keep] != -100).all()                           # no spans: every answer label counts

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ids": ids, "answer_start": 10}) + "\n"
                   + json.dumps({"ids": ids, "answer_start": 10, "answer_spans": [[30, 40], [35, 70]]}) + "\n")
    with pytest.raises(TrainConfigError, match="bad.jsonl:2: not a `dspine gen-data` record"):
        load_records(bad)
