"""dspine/bench/copy_candidates.py end to end against stub servers that a fake launcher starts (one
per start, like serve.sh): the exact results schema, the DSPINE-copy variant checkpoint, that no
NGRAM server sees a prompt twice (restarted when a pool runs out), the must-reach table, a config
failing midway and the time budget keeping what was measured.

Each stub answers `max_tokens` tokens with `spec_verify_ct` from its config: AR none (accept 1),
NGRAM 3, DSPINE 2, DSPINE-ablation 1.5; DSPINE-copy 2 on the evaluation sets (1.5 on mbpp: a planted loss) and 6 on the
agentic prompts, but only when its drafter folder's config.json turns copy candidates on."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import JsonHandler, start_server

from dspine.bench import copy_candidates as bench
from dspine.bench import launchers
from dspine.bench.results import BenchError
from dspine.data.eval_sets import EVAL_SETS
from dspine.data.traces import load_traces

MAX_TOKENS = 12
RUN_KEYS = {"config", "workload", "agentic", "concurrency", "accept_len", "output_tok_per_s"}
STEP_KEYS = {"steps", "wall_s", "ms_per_step"}  # the client-side step period, beside the schema's keys


class StubHandler(JsonHandler):
    def do_GET(self):
        if self.path == "/server_info":
            return self.send_json({"version": "0.5.17-stub", "gpu_name": "Stub GPU"})
        self.send_json({"error": "not found"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        assert body["temperature"] == 0 and body["return_meta_info"] is True and not body.get("stream")
        key = bench.prompt_key(body)
        with server.lock:
            server.seen[key] += 1
            server.requests += 1
            failing = server.fail_after is not None and server.requests > server.fail_after
        if failing:
            return self.send_json({"error": "stub failure"}, 500)
        time.sleep(server.delay_s)
        n = body["max_tokens"]
        content = body["messages"][0]["content"]
        verify = {"AR": None, "NGRAM": n // 3, "DSPINE": n // 2, "DSPINE-ablation": n * 2 // 3}.get(server.name)
        if server.name == "DSPINE-copy":
            draft = Path(server.flags[server.flags.index("--speculative-draft-model-path") + 1])
            copy = json.loads((draft / "config.json").read_text())["dspine_config"].get("copy_candidates")
            verify = n // 6 if copy and body.get("tools") else n * 2 // 3 if content.startswith("q-mbpp") else n // 2
        choice = {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "t " * n},
                  "meta_info": {"completion_tokens": n, **({"spec_verify_ct": verify} if verify else {})}}
        self.send_json({"choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": n}})


class FakeLauncher:
    """start() serves a fresh stub (what serve.sh would start for those flags); stop() shuts it."""

    def __init__(self, delay_s: float = 0.0, fail: dict[str, int] | None = None):
        self.delay_s, self.fail, self.live, self.servers = delay_s, fail or {}, {}, []

    def start(self, name: str, flags: list[str], env=None) -> str:
        server = start_server(StubHandler)
        server.name, server.flags, server.seen, server.requests = name, flags, Counter(), 0
        server.lock, server.delay_s, server.fail_after = threading.Lock(), self.delay_s, self.fail.get(name)
        self.live[name] = server
        self.servers.append(server)
        return server.url

    def stop(self, name: str) -> None:
        server = self.live.pop(name, None)
        if server is not None:
            server.shutdown()
            server.server_close()

    def starts(self) -> Counter:
        return Counter(s.name for s in self.servers)


@pytest.fixture
def inputs(tmp_path):
    """A prompts export (6 prompts per evaluation set), an agentic trace file and a drafter folder."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for name in EVAL_SETS:
        rows = [{"id": f"{name}/{i}", "source": name, "messages": [{"role": "user", "content": f"q-{name}-{i}"}]}
                for i in range(6)]
        (prompts / f"eval-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    traces = tmp_path / "agentic_demo.jsonl"
    traces.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"ctx {i} " * 50}],
                                          "tools": tools}) + "\n" for i in range(40)))
    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["DSpineDraftModel"],
                                                   "dspine_config": {"block_size": 16}}))
    (draft / "model.safetensors").write_bytes(b"weights")
    (draft / "README.md").write_text("card")
    return {"prompts": prompts, "traces": traces, "draft": draft, "out": tmp_path / "results"}


def _argv(inputs, *extra: str) -> list[str]:
    return ["--draft", str(inputs["draft"]), "--agentic", str(inputs["traces"]), "--prompts-dir",
            str(inputs["prompts"]), "--max-tokens", str(MAX_TOKENS), "--out-dir", str(inputs["out"]), *extra]


def _results(inputs) -> dict:
    return json.loads((inputs["out"] / f"{bench.RESULTS_NAME}.json").read_text())


def test_end_to_end_schema_variant_and_table(inputs, capsys, monkeypatch):
    monkeypatch.setattr(launchers.subprocess, "run", _no_nvidia_smi)
    launcher = FakeLauncher()
    argv = _argv(inputs, "--concurrency", "1,4", "--prompts-per-workload", "2", "--copy-set", "copy_min_match=3")
    assert bench.main(argv, launcher=launcher) == 0
    results = _results(inputs)
    assert set(results) == {"device", "date", "command", "sglang", "runs"}
    assert all(set(r) == RUN_KEYS | STEP_KEYS for r in results["runs"])
    bench.check_results(results)
    for r in results["runs"]:   # rounds = tokens / accept length; wall x streams in flight / rounds
        prompts = max(2, r["concurrency"])          # --prompts-per-workload 2, at least one wave
        in_flight = min(r["concurrency"], prompts)
        assert r["steps"] == round(prompts * MAX_TOKENS / r["accept_len"])
        assert r["ms_per_step"] == pytest.approx(1e3 * r["wall_s"] * in_flight / r["steps"])
    assert (results["device"], results["sglang"]) == ("Stub GPU", "0.5.17-stub")
    workloads = ["agentic_demo", *EVAL_SETS]
    assert [(r["config"], r["workload"], r["concurrency"]) for r in results["runs"]] \
        == [(name, w, c) for name in bench.DEFAULT_CONFIGS for c in (1, 4) for w in workloads]
    accept = {(r["config"], r["workload"]): r["accept_len"] for r in results["runs"] if r["concurrency"] == 1}
    assert accept[("AR", "gsm8k")] == 1.0 and accept[("NGRAM", "agentic_demo")] == 3.0
    assert accept[("DSPINE-copy", "agentic_demo")] == 6.0 and accept[("DSPINE-copy", "mbpp")] == 1.5
    assert all(r["agentic"] == (r["workload"] == "agentic_demo") for r in results["runs"])
    assert all(r["output_tok_per_s"] > 0 for r in results["runs"])

    variant = inputs["out"] / f"{bench.RESULTS_NAME}_dspine_copy"
    config = json.loads((variant / "config.json").read_text())
    assert config["dspine_config"] == {"block_size": 16, "copy_candidates": True, "copy_min_match": 3}
    assert "copy_candidates" not in json.loads((inputs["draft"] / "config.json").read_text())["dspine_config"]
    for name in ("model.safetensors", "README.md"):
        assert (variant / name).is_symlink() and (variant / name).resolve() == (inputs["draft"] / name).resolve()
    flags = {s.name: s.flags for s in launcher.servers}
    assert flags["DSPINE-copy"][flags["DSPINE-copy"].index("--speculative-draft-model-path") + 1] == str(variant)
    assert flags["DSPINE"][flags["DSPINE"].index("--speculative-draft-model-path") + 1] == str(inputs["draft"])
    assert flags["NGRAM"][-2:] == ["--speculative-algorithm", "NGRAM"] and flags["AR"] == flags["NGRAM"][:-2]
    assert launcher.starts() == Counter(bench.DEFAULT_CONFIGS)      # one server per config, all workloads
    assert all(max(s.seen.values()) == 1 for s in launcher.servers if s.name == "NGRAM")

    checks = {(s["workload"], s["check"].split(" accept")[0]): s for s in bench.summary(results)}
    assert checks[("agentic_demo", "DSPINE-copy / NGRAM")]["ratio"] == pytest.approx(2.0)
    assert checks[("agentic_demo", "DSPINE-copy / DSPINE")]["ratio"] == pytest.approx(3.0)
    assert checks[("mbpp", "DSPINE-copy / DSPINE")]["ratio"] == pytest.approx(0.75)
    assert [s["workload"] for s in bench.summary(results) if not s["ok"] and s["check"].startswith("DSPINE-copy")] \
        == ["mbpp"]
    assert {w: round(s["ratio"], 3) for (w, check), s in checks.items() if check == "DSPINE / NGRAM"} \
        == {"gsm8k": 0.667, "math500": 0.667, "sharegpt-heldout": 0.667}   # chat and math only, at c=1
    out = capsys.readouterr().out
    assert "mbpp: DSPINE-copy / DSPINE accept (mean over c) = 0.750 (goal >= 0.98) FAIL" in out
    assert "agentic_demo: DSPINE-copy / NGRAM accept at c=1 = 2.000 (goal >= 1.20) PASS" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("agentic_demo") and ln.split()[1] == "1")
    assert "6.00 / " in line and "1.00 / 1.00x" in line
    assert (inputs["out"] / f"{bench.RESULTS_NAME}.png").is_file() or not _has_matplotlib()


def test_the_ablation_config_serves_its_own_drafter_and_joins_the_acceptance_file(inputs, tmp_path, monkeypatch):
    """--ablation-draft adds DSPINE-ablation (DSPINE's flags, the ablation's folder); bench-accept
    --merge --served keeps the DSPINE, ablation, NGRAM and AR rows as the acceptance file's `served`."""
    monkeypatch.setattr(launchers.subprocess, "run", _no_nvidia_smi)
    ablation = tmp_path / "ablation"
    ablation.mkdir()
    launcher = FakeLauncher()
    argv = _argv(inputs, "--configs", "AR,NGRAM,DSPINE", "--ablation-draft", str(ablation), "--concurrency", "1",
                 "--workloads", "gsm8k,sharegpt-heldout")
    assert bench.main(argv, launcher=launcher) == 0
    flags = {s.name: s.flags for s in launcher.servers}
    at = flags["DSPINE"].index("--speculative-draft-model-path") + 1
    assert flags["DSPINE-ablation"] == [*flags["DSPINE"][:at], str(ablation), *flags["DSPINE"][at + 1:]]
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "AR,DSPINE-ablation"])          # the config needs its drafter

    from dspine.bench.accept import merge_results
    accept = tmp_path / "acc.json"
    accept.write_text(json.dumps({"target": "t", "date": "d", "device": "cpu", "command": "c", "drafters": {},
                                  "max_new_tokens": 16, "dtype": "float32", "greedy_parity": None,
                                  "runs": [{"method": "dspine", "dataset": "gsm8k", "temperature": 0.0, "tau": 2.0,
                                            "per_position_accept": [0.5]}]}))
    out = tmp_path / "acceptance.json"
    assert merge_results([accept], out, inputs["out"] / f"{bench.RESULTS_NAME}.json") == 0
    served = json.loads(out.read_text())["served"]
    assert {(r["method"], r["workload"], r["concurrency"], r["accept_len"]) for r in served} == {
        (m, w, 1, a) for m, a in (("ar", 1.0), ("ngram", 3.0), ("dspine", 2.0), ("ablation", 1.5))
        for w in ("gsm8k", "sharegpt-heldout")}
    assert all(set(r) == {"method", "workload", "concurrency", "accept_len", "output_tok_per_s"} for r in served)
    copy_only = tmp_path / "copy_only.json"
    copy_only.write_text(json.dumps({**_results(inputs), "runs": [{**r, "config": "DSPINE-copy"}
                                                                    for r in _results(inputs)["runs"]]}))
    with pytest.raises(SystemExit, match="no run of"):
        merge_results([accept], tmp_path / "x.json", copy_only)


def test_ngram_restarts_before_a_level_that_would_repeat_a_prompt(inputs):
    """6 prompts a set: levels of 3 (c=1) then 4 (c=4) wrap around, so NGRAM restarts once, before its
    first concurrency-4 level; the other configs keep their one server."""
    launcher = FakeLauncher()
    assert bench.main(_argv(inputs, "--concurrency", "1,4", "--prompts-per-workload", "3", "--workloads",
                            "gsm8k,humaneval"), launcher=launcher) == 0
    assert launcher.starts() == Counter({"NGRAM": 2, "AR": 1, "DSPINE": 1, "DSPINE-copy": 1})
    ngram = [s for s in launcher.servers if s.name == "NGRAM"]
    assert all(max(s.seen.values()) == 1 for s in ngram)
    assert sum(ngram[0].seen.values()) == 1 + 2 * 3 and sum(ngram[1].seen.values()) == 1 + 2 * 4
    others = [s for s in launcher.servers if s.name == "DSPINE"]
    assert max(others[0].seen.values()) == 2                        # the same prompts, one server


def test_ngram_on_a_url_skips_the_level_that_would_repeat(inputs):
    server = start_server(StubHandler)
    server.name, server.flags, server.seen, server.requests = "NGRAM", [], Counter(), 0
    server.lock, server.delay_s, server.fail_after = threading.Lock(), 0.0, None
    try:
        rc = bench.main(_argv(inputs, "--configs", "NGRAM", "--url", server.url, "--concurrency", "1,4",
                              "--prompts-per-workload", "3", "--workloads", "gsm8k"))
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 1 and max(server.seen.values()) == 1
    assert [r["concurrency"] for r in _results(inputs)["runs"]] == [1]


def test_a_failing_config_keeps_what_was_measured(inputs, capsys):
    launcher = FakeLauncher(fail={"DSPINE": 1 + 2 * 2})             # warm-up + two levels of 2, then errors
    rc = bench.main(_argv(inputs, "--concurrency", "1", "--prompts-per-workload", "2", "--configs", "DSPINE,AR"),
                    launcher=launcher)
    assert rc == 1 and "DSPINE:" in capsys.readouterr().err
    runs = _results(inputs)["runs"]
    assert [r["workload"] for r in runs if r["config"] == "DSPINE"] == ["agentic_demo", "gsm8k"]
    assert len([r for r in runs if r["config"] == "AR"]) == 6 and not launcher.live


def test_time_budget_stops_cleanly(inputs, monkeypatch, capsys):
    monkeypatch.setattr(bench, "SERVER_START_S", 0.0)
    monkeypatch.setattr(bench, "SERVER_STOP_S", 0.0)
    launcher = FakeLauncher(delay_s=0.05)                           # a level of 3 prompts at c=1: >= 0.15 s
    rc = bench.main(_argv(inputs, "--configs", "AR", "--concurrency", "1", "--prompts-per-workload", "3",
                          "--time-budget-s", "0.35"), launcher=launcher)
    assert rc == 1 and "past this config's share of --time-budget-s" in capsys.readouterr().err
    runs = _results(inputs)["runs"]
    assert 1 <= len(runs) < 6 and [r["workload"] for r in runs] == ["agentic_demo", *EVAL_SETS][:len(runs)]


def test_plan_levels_takes_distinct_slices_and_wraps():
    w = bench.Workload("w", False, [{"id": str(i), "messages": [{"role": "user", "content": str(i)}]}
                                    for i in range(10)])
    small = bench.Workload("s", True, w.prompts[:3])
    levels = bench.plan_levels([w, small], [1, 4, 8], 2)
    ids = {(lv.workload.name, lv.concurrency): [p["id"] for p in lv.prompts] for lv in levels}
    assert [(lv.workload.name, lv.concurrency) for lv in levels] == [("w", 1), ("s", 1), ("w", 4), ("s", 4),
                                                                      ("w", 8), ("s", 8)]
    assert ids[("w", 1)] == ["0", "1"] and ids[("w", 4)] == ["2", "3", "4", "5"]
    assert ids[("w", 8)] == ["6", "7", "8", "9", "0", "1", "2", "3"]  # the pool used up: wraps
    assert ids[("s", 4)] == ["2", "0", "1"]                           # capped at the pool, no repeat inside


def test_overrides_variant_and_schema_refusals(tmp_path):
    assert bench.parse_overrides(["copy_min_match=3", "copy_mode=suffix", "copy_on=true"]) \
        == {"copy_min_match": 3, "copy_mode": "suffix", "copy_on": True}
    with pytest.raises(BenchError, match="copy_<key>"):
        bench.parse_overrides(["selection_top_k=4"])
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(BenchError, match="no dspine_config"):
        bench.make_variant(plain, tmp_path / "v", {})
    good = {"device": "d", "date": "x", "command": "c", "sglang": "s", "runs": [
        {"config": "AR", "workload": "w", "agentic": False, "concurrency": 1, "accept_len": 1.0,
         "output_tok_per_s": 5.0}]}
    bench.check_results(good)
    good["runs"][0]["agentic"] = "no"
    with pytest.raises(BenchError, match=r"runs\[0\].agentic"):
        bench.check_results(good)


def test_summary_uses_c1_for_agentic_and_the_mean_for_the_sets():
    def run(config, workload, c, accept, agentic):
        return {"config": config, "workload": workload, "agentic": agentic, "concurrency": c,
                "accept_len": accept, "output_tok_per_s": 100.0}

    results = {"runs": [run("NGRAM", "a", 1, 2.0, True), run("DSPINE", "a", 1, 1.25, True),
                        run("DSPINE-copy", "a", 1, 2.5, True), run("DSPINE-copy", "a", 16, 9.0, True),
                        run("DSPINE", "a", 16, 1.0, True), run("DSPINE", "g", 1, 2.0, False),
                        run("DSPINE-copy", "g", 1, 2.0, False), run("DSPINE", "g", 16, 2.0, False),
                        run("DSPINE-copy", "g", 16, 1.94, False), run("DSPINE-copy", "h", 1, 2.0, False)]}
    rows = {(s["workload"], s["check"]): (round(s["ratio"], 4), s["ok"]) for s in bench.summary(results)}
    assert rows == {("a", "DSPINE-copy / NGRAM accept at c=1"): (1.25, True),
                    ("a", "DSPINE-copy / DSPINE accept at c=1"): (2.0, True),
                    ("g", "DSPINE-copy / DSPINE accept (mean over c)"): (0.985, True)}  # h lacks DSPINE


def test_device_from_nvidia_smi_else_server_info(monkeypatch):
    monkeypatch.setattr(launchers.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout="NVIDIA H200\nNVIDIA H200\n"))
    assert launchers.detect_device({"gpu_name": "other"}) == "NVIDIA H200"
    monkeypatch.setattr(launchers.subprocess, "run", _no_nvidia_smi)
    assert launchers.detect_device({"device": "cuda"}) == "cuda" and launchers.detect_device({}) == "unknown"


def test_agentic_split_and_unknown_workloads(inputs):
    args = bench.parse_args(_argv(inputs))
    pool = next(w for w in bench.load_workloads(args) if w.agentic).prompts
    held = load_traces([inputs["traces"]], "heldout")
    assert [p["messages"] for p in pool] == [list(r.messages) for r in held] and 0 < len(pool) < 40
    assert bench.main(_argv(inputs, "--workloads", "gsm8k,nope"), launcher=FakeLauncher()) == 2


def _no_nvidia_smi(*args, **kwargs):
    raise FileNotFoundError("nvidia-smi")


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
