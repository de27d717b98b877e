"""`dspine bench-accept`: `--merge` joins the result files of separate runs; `--selection`,
`--transition-lambda` and `--injection-top-k` override how a loaded drafter drafts and selects."""

from __future__ import annotations

import json

import pytest

from dspine.bench.accept import merge_results


def _result(name: str, taus: dict, identical: int) -> dict:
    runs = [{"method": name, "dataset": ds, "temperature": t, "n_prompts": 4, "tau": tau,
             "per_position_accept": [0.5]} for (ds, t), tau in taus.items()]
    return {"target": "smollm2-135m-instruct", "date": "d", "device": "cpu", "command": f"run {name}",
            "torch": "x", "drafters": {name: f"/ckpt/{name}"}, "max_new_tokens": 16, "dtype": "float32",
            "prompt_sources": {}, "summary": {}, "greedy_parity": {name: {"prompts": 4, "identical": identical}},
            "runs": runs}


def test_merge_unites_runs_and_recomputes_the_ratio(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps(_result("dspine", {("gsm8k", 0.0): 3.0, ("mbpp", 0.0): 2.0,
                                               ("agentic_coding", 0.0): 5.0}, 4)))
    b.write_text(json.dumps(_result("ablation", {("gsm8k", 0.0): 2.0, ("mbpp", 0.0): 2.0,
                                                 ("agentic_coding", 0.0): 1.5}, 3)))
    out = tmp_path / "merged.json"
    assert merge_results([a, b], out) == 0
    merged = json.loads(out.read_text())
    assert merged["drafters"] == {"dspine": "/ckpt/dspine", "ablation": "/ckpt/ablation"}
    assert len(merged["runs"]) == 6
    assert merged["summary"]["T=0"]["ratio_dspine_over_ablation"] == pytest.approx(2.5 / 2.0)   # dev sets only
    assert merged["summary"]["long_context"]["T=0"] == {"dspine": {"agentic_coding": 5.0},
                                                        "ablation": {"agentic_coding": 1.5}}
    assert merged["greedy_parity"] == {"dspine": {"prompts": 4, "identical": 4},
                                       "ablation": {"prompts": 4, "identical": 3}}


def test_merge_refuses_mixed_settings_and_repeated_drafters(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps(_result("dspine", {("gsm8k", 0.0): 3.0}, 4)))
    other = _result("ablation", {("gsm8k", 0.0): 2.0}, 4)
    other["max_new_tokens"] = 32
    b.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="max_new_tokens"):
        merge_results([a, b], tmp_path / "m.json")
    b.write_text(json.dumps(_result("dspine", {("mbpp", 0.0): 2.0}, 4)))
    with pytest.raises(SystemExit, match="appears twice"):
        merge_results([a, b], tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_served_goes_with_merge_only(tmp_path):
    from dspine.bench.accept import run_bench_accept

    args = _parse(["--served", str(tmp_path / "s.json"), "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="--served goes with --merge"):
        run_bench_accept(args)


def _parse(argv: list[str]):
    import argparse

    from dspine.train.cli import add_bench_accept_arguments as add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_selection_overrides_reach_the_drafter_and_refuse_a_drafter_without_a_scorer(tmp_path, monkeypatch):
    """`--selection` / `--transition-lambda` change how the loaded drafter selects (checked where
    generation receives it); `--selection transition` on an argmax-trained drafter is refused."""
    from conftest import drafter_for, tiny_llama

    import dspine.bench.accept as bench_accept
    from dspine.model.checkpoint import save_checkpoint

    target = tiny_llama()
    seen = []

    class Result:
        tokens = [[5]]
        stats = type("Stats", (), {"tau": 1.0, "per_position_accept": [0.0], "tokens_per_s": 1.0, "rounds": 1})()

    def fake_generate(target_, drafter, ids, **kw):
        seen.append(None if drafter is None else (drafter.config.selection, drafter.config.transition_lambda))
        if drafter is not None and drafter.injections is not None:
            top_ks.append({m.top_k for m in drafter.injections})
        return Result()

    top_ks = []

    monkeypatch.setattr(bench_accept, "load_target", lambda *a, **k: (target, None))
    monkeypatch.setattr(bench_accept, "stop_token_ids", lambda *a: [2])
    monkeypatch.setattr(bench_accept, "load_eval_set", lambda name, limit, **folders: [type("P", (), {"messages": []})()])
    monkeypatch.setattr(bench_accept, "chat_prompt_ids", lambda tok, messages: [1, 5, 6])
    monkeypatch.setattr(bench_accept, "generate", fake_generate)
    monkeypatch.setattr(bench_accept, "plot", lambda runs, path: None)
    save_checkpoint(drafter_for(target), tmp_path / "dspine")
    save_checkpoint(drafter_for(target, injection=False, selection="argmax"), tmp_path / "ablation")
    common = ["--datasets", "gsm8k", "--temperatures", "0.0", "--device", "cpu", "--out", str(tmp_path / "r.json")]
    assert bench_accept.run_bench_accept(_parse(["--drafter", f"d={tmp_path / 'dspine'}", "--selection", "argmax",
                                                 *common])) == 0
    assert seen == [("argmax", 1.0)]
    seen.clear()
    assert bench_accept.run_bench_accept(_parse(["--drafter", f"d={tmp_path / 'dspine'}", "--transition-lambda",
                                                 "0.5", *common])) == 0
    assert seen == [("transition", 0.5)]
    with pytest.raises(SystemExit, match="no transition scorer"):
        bench_accept.run_bench_accept(_parse(["--drafter", f"a={tmp_path / 'ablation'}", "--selection",
                                              "transition", *common]))
    # --injection-top-k reaches every injection module (what the drafting forward reads)
    trained_k = drafter_for(target).config.injection_top_k
    top_ks.clear()
    assert bench_accept.run_bench_accept(_parse(["--drafter", f"d={tmp_path / 'dspine'}", *common])) == 0
    assert bench_accept.run_bench_accept(_parse(["--drafter", f"d={tmp_path / 'dspine'}", "--injection-top-k",
                                                 str(trained_k + 3), *common])) == 0
    assert top_ks == [{trained_k}, {trained_k + 3}]
    with pytest.raises(SystemExit, match="has no injection"):
        bench_accept.run_bench_accept(_parse(["--drafter", f"a={tmp_path / 'ablation'}", "--injection-top-k", "4",
                                              *common]))


def test_out_defaults_to_a_new_file_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """Without --out, results go to a new bench_accept_<time>.json in the working directory, never
    to the tracked benchmarks/results/acceptance_smollm2.json."""
    import dspine.bench.accept as bench_accept

    assert _parse([]).out is None
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_result("dspine", {("gsm8k", 0.0): 3.0}, 4)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_accept, "plot", lambda runs, path: None)
    assert bench_accept.run_bench_accept(_parse(["--merge", str(a)])) == 0
    written = sorted(p.name for p in tmp_path.glob("bench_accept_*.json"))
    assert len(written) == 1 and f"bench-accept: wrote {written[0]}" in capsys.readouterr().out
    assert not (tmp_path / "benchmarks").exists()


def test_agentic_trace_files_are_workloads_rendered_with_their_tools(tmp_path):
    """`--agentic FILE`: one workload per file, named by its stem, its split's requests (at most
    --num-prompts) rendered by the chat template with their tools; a bad file is named."""
    from types import SimpleNamespace

    from dspine.bench.accept import workloads
    from dspine.data.traces import load_traces
    from dspine.engine.targets import chat_prompt_ids, load_tokenizer

    tokenizer, _ = load_tokenizer()
    tool = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
    path = tmp_path / "agentic_coding.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"open file {i}"},
                                             {"role": "assistant", "content": f"contents of file {i} " * 20},
                                             {"role": "user", "content": "now edit it"}],
                                "tools": [tool]}) + "\n")
    args = SimpleNamespace(datasets=[], agentic=[str(path)], agentic_split="all", num_prompts=4)
    (name, ids), = list(workloads(args, tokenizer))
    requests = load_traces([path], "all")[:4]
    assert name == "agentic_coding" and len(ids) == 4
    assert ids == [chat_prompt_ids(tokenizer, list(r.messages), list(r.tools)) for r in requests]
    assert "contents of file 0" in tokenizer.decode(ids[0])      # (SmolLM2's template renders no tools)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        list(workloads(SimpleNamespace(datasets=[], agentic=[str(tmp_path / "bad.jsonl")], agentic_split="all",
                                       num_prompts=4), tokenizer))
