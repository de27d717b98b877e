"""dspine/bench/round_cost.py against stub servers and pre-written step-profile records: the results
schema, ms per step and host time read from the right phase, accept length from meta_info, the
table's T_round / T_step, runs of other shapes kept on a rerun, a missing phase named, repeats
interleaved across configs, both temperatures in one run, a phase other steps filled refused, and
greedy parity judged on token ids."""

from __future__ import annotations

import json

import pytest
from conftest import JsonHandler, start_server

from dspine.bench import round_cost as bench
from dspine.data.eval_sets import EVAL_SETS

VERIFY = {"AR": None, "DSPINE": 4, "NGRAM": 6}     # verify steps per 12-token answer
DIVERGES_ON: dict[str, str] = {}                   # server name -> prompt text it answers differently


class Stub(JsonHandler):
    def do_GET(self):
        self.send_json({"version": "0.5.17-stub", "gpu_name": "Stub GPU"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/flush_cache":
            return self.send_json({})
        if self.path == "/generate":       # the AR server's one-pass prefill: it picks the diverging token
            self.server.prefills.append(body["input_ids"])
            return self.send_json({"output_ids": [999], "meta_info": {"output_top_logprobs": [
                [[-0.6, 999, None], [-0.725, 5, None]]]}})
        n = body["max_tokens"]
        kind = "throughput" if body.get("return_meta_info") else "profile" if n > 1 else "count"
        self.server.kinds.append(kind)
        self.server.temperatures.add(body["temperature"])
        self.server.sent.setdefault(kind, []).append(body["messages"][0]["content"])
        self.server.tools.append(body.get("tools"))
        verify = VERIFY[self.server.name]
        meta = {"completion_tokens": n, **({"spec_verify_ct": verify} if verify and n > 1 else {})}
        self.server.order.append(self.server.name)
        ids = list(range(n))
        if self.server.name in DIVERGES_ON and DIVERGES_ON[self.server.name] in body["messages"][0]["content"]:
            ids[5] = 999                                      # this server answers one prompt differently
        extra = {"token_ids": ids, "prompt_token_ids": [ord(ch) for ch in body["messages"][0]["content"]]} \
            if body.get("return_token_ids") else {}
        if body.get("logprobs"):           # every position a near-tie: top-2 gap 0.125 nats
            extra["logprobs"] = {"content": [{"token": "t", "logprob": -0.6, "top_logprobs": [
                {"token": "t", "logprob": -0.6}, {"token": "u", "logprob": -0.725}]} for _ in ids]}
        self.send_json({"choices": [{"index": 0, "message": {"role": "assistant", "content": "t " * n},
                                     "meta_info": meta, "finish_reason": "length", **extra}],
                        "usage": {"prompt_tokens": 40, "completion_tokens": n}})


@pytest.fixture
def servers():
    live, order = {}, []
    for name in VERIFY:
        server = start_server(Stub)
        server.name, server.kinds, server.order, server.sent, server.prefills = name, [], order, {}, []
        server.temperatures, server.tools = set(), []
        live[name] = server
    yield live
    for server in live.values():
        server.shutdown()
        server.server_close()


def write_phases(folder, ms, host_parts, wait=0.0, first=1):
    """Step-profile records for phases `first` (c=1) and `first` + 1 (c=16), as the server's profiler
    writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    for phase, scale in ((first, 1.0), (first + 1, 2.0)):
        record = {"mean_batch_size": 1.0 if phase == first else 15.5, "ms_per_step": ms * scale,
                  "ms_per_step_in": {k: v * scale for k, v in host_parts.items()}, "ms_per_step_waiting": wait * scale}
        (folder / f"123-phase{phase}.json").write_text(json.dumps(record))


@pytest.fixture
def prompts_dir(tmp_path):
    folder = tmp_path / "prompts"
    folder.mkdir()
    for name in EVAL_SETS:
        lines = [json.dumps({"id": f"{name}-{i}", "source": name, "messages": [{"role": "user", "content": f"q-{name}-{i}"}]})
                 for i in range(64)]
        (folder / f"eval-{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def run(servers, tmp_path, prompts_dir, *extra):
    argv = ["--shape", "smollm2-135m", "--prompts-dir", str(prompts_dir), "--prompts", "6", "--max-tokens", "12",
            "--concurrency", "1,16", "--out-dir", str(tmp_path / "out")]
    for name, server in servers.items():
        argv += ["--url", f"{name}={server.url}", "--profile-dir", f"{name}={tmp_path / 'prof' / name}"]
    return bench.main(argv + list(extra))


def test_runs_read_each_phase_and_the_table_divides_by_ar(servers, tmp_path, prompts_dir, capsys):
    write_phases(tmp_path / "prof" / "AR", 1.2, {"run_batch": 0.8, "process_batch_result": 0.1})
    write_phases(tmp_path / "prof" / "DSPINE", 1.8, {"run_batch": 1.0, "get_next_batch_to_run": 0.2,
                                                      "process_batch_result": 0.5}, wait=0.5)
    write_phases(tmp_path / "prof" / "NGRAM", 3.0, {"run_batch": 2.5})
    assert run(servers, tmp_path, prompts_dir) == 0
    results = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())
    bench.check_schema(results, bench.RESULTS_SCHEMA)
    assert results["device"] == "Stub GPU" and results["sglang"] == "0.5.17-stub"   # no nvidia-smi here
    rows = {(r["config"], r["concurrency"]): r for r in results["runs"]}
    assert rows[("DSPINE", 1)]["ms_per_step"] == pytest.approx(1.8)
    assert rows[("DSPINE", 16)]["ms_per_step"] == pytest.approx(3.6)             # phase 2 for the second level
    assert rows[("DSPINE", 1)]["host_ms_per_step"] == pytest.approx(1.2)         # the methods, less the wait
    assert rows[("DSPINE", 16)]["wait_ms_per_step"] == pytest.approx(1.0)
    assert rows[("DSPINE", 16)]["ms_per_step_in"] == {"run_batch": 2.0, "get_next_batch_to_run": 0.4,
                                                      "process_batch_result": 1.0}     # where the host time went
    assert rows[("AR", 16)]["host_ms_per_step"] == pytest.approx(1.8)
    assert rows[("DSPINE", 1)]["accept_len"] == pytest.approx(3.0) and rows[("AR", 1)]["accept_len"] == 1.0
    assert rows[("NGRAM", 1)]["accept_len"] == pytest.approx(2.0)
    assert rows[("AR", 1)]["prompt_tokens"] == 40 and rows[("DSPINE", 16)]["mean_batch_size"] == 15.5
    out = capsys.readouterr().out
    assert "1.50x" in out and "2.50x" in out                                    # T_round / T_step at c=1
    for server in servers.values():     # every profile phase before any throughput level (module docstring)
        kinds = [k for k in server.kinds if k != "count"]
        assert "profile" in kinds and kinds.index("throughput") > max(i for i, k in enumerate(kinds) if k == "profile")


def test_a_rerun_keeps_other_shapes_and_sections(servers, tmp_path, prompts_dir):
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    out = tmp_path / "out"
    out.mkdir()
    other = {"config": "AR", "shape": "qwen3-8b", "workload": "mix", "concurrency": 1, "prompt_tokens": 100,
             "ms_per_step": 5.0, "host_ms_per_step": 1.0, "output_tok_per_s": 190.0, "accept_len": 1.0}
    (out / "round_cost_h200.json").write_text(json.dumps({"runs": [other], "soak": {"config": "DSPINE"}}))
    assert run(servers, tmp_path, prompts_dir) == 0
    results = json.loads((out / "round_cost_h200.json").read_text())
    assert other in results["runs"] and results["soak"] == {"config": "DSPINE"}
    assert len(results["runs"]) == 1 + 2 * len(VERIFY)


def test_both_temperatures_in_one_run_read_their_phases_in_turn(servers, tmp_path, prompts_dir):
    for name in VERIFY:                  # phases 1-2: greedy c=1/16; phases 3-4: T=1 c=1/16
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
        write_phases(tmp_path / "prof" / name, 3.0, {"run_batch": 1.0}, first=3)
    assert run(servers, tmp_path, prompts_dir, "--temperature", "0,1") == 0
    assert all(server.temperatures == {0.0, 1.0} for server in servers.values())
    results = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())
    rows = {(r["config"], r["concurrency"], r["temperature"]): r for r in results["runs"]}
    assert len(rows) == len(results["runs"]) == 2 * 2 * len(VERIFY)
    assert rows[("DSPINE", 1, 0.0)]["ms_per_step"] == pytest.approx(2.0)
    assert rows[("DSPINE", 1, 1.0)]["ms_per_step"] == pytest.approx(3.0)
    assert rows[("DSPINE", 16, 1.0)]["ms_per_step"] == pytest.approx(6.0)
    assert all("output_tok_per_s" in r for r in rows.values())
    for server in servers.values():      # every profile request of both temperatures before any throughput
        kinds = [k for k in server.kinds if k != "count"]
        assert kinds.index("throughput") > max(i for i, k in enumerate(kinds) if k == "profile")


def test_a_phase_filled_by_other_steps_is_refused(servers, tmp_path, prompts_dir, capsys):
    """What a second run on an already-measured server reads: its phases hold the first run's
    throughput steps (a c=1 level's batch of one where c=16 was asked)."""
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    (tmp_path / "prof" / "DSPINE" / "123-phase2.json").write_text(json.dumps(
        {"mean_batch_size": 1.0, "ms_per_step": 2.0, "ms_per_step_in": {"run_batch": 1.0}}))
    assert run(servers, tmp_path, prompts_dir) == 0                      # DSPINE is left out, named
    err = capsys.readouterr().err
    assert "DSPINE left out" in err and "phase 2 (c=16) measured a mean batch of 1.0" in err
    assert "--temperature 0,1" in err
    results = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())
    assert {r["config"] for r in results["runs"]} == {"AR", "NGRAM"}


def test_temperatures_are_checked():
    for text in ("-1", "0,0", "x"):
        with pytest.raises(SystemExit):
            bench.main(["--url", "AR=http://127.0.0.1:1", "--shape", "x", "--temperature", text])


def test_a_phase_the_server_never_wrote_is_named(servers, tmp_path, prompts_dir, capsys):
    write_phases(tmp_path / "prof" / "AR", 1.2, {"run_batch": 0.8})
    (tmp_path / "prof" / "DSPINE").mkdir(parents=True)
    write_phases(tmp_path / "prof" / "NGRAM", 3.0, {"run_batch": 2.5})
    assert run(servers, tmp_path, prompts_dir, "--profile-timeout", "1") == 0    # DSPINE is left out
    assert "DSPINE left out" in (err := capsys.readouterr().err) and "phase 1 (c=1) did not finish" in err
    results = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())
    assert {r["config"] for r in results["runs"]} == {"AR", "NGRAM"}


def test_unknown_config_names_are_refused(tmp_path):
    for name in ("EAGLE", "DSPINE-", "dspine"):
        with pytest.raises(SystemExit):
            bench.main(["--url", f"{name}=http://127.0.0.1:1", "--shape", "x"])


def test_dspine_variants_sort_after_the_named_configs():
    names = ["NGRAM", "DSPINE-splitkv", "AR", "DSPINE-eager", "DSPINE", "DSPINE-abc", "DFLASH"]
    assert sorted(names, key=bench.config_order) == ["AR", "DSPINE", "DSPINE-eager", "DSPINE-abc", "DSPINE-splitkv",
                                                     "DFLASH", "NGRAM"]


def test_synthetic_prompts_have_about_the_asked_length_and_differ():
    from dspine.engine.targets import load_tokenizer

    tokenizer, _ = load_tokenizer()
    for tokens in (100, 2000):
        prompts = bench.synthetic_prompts(tokens, 3)
        lengths = [len(tokenizer.encode(p["messages"][0]["content"])) for p in prompts]
        assert all(0.7 * tokens < n < 1.3 * tokens for n in lengths), lengths
        assert len({p["messages"][0]["content"] for p in prompts}) == 3
    with pytest.raises(SystemExit):
        bench.main(["--url", "AR=http://127.0.0.1:1", "--shape", "x", "--workload", "synthetic:lots"])


def test_repeats_interleave_the_configs_and_keep_each_rate(servers, tmp_path, prompts_dir):
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    order = servers["AR"].order
    assert run(servers, tmp_path, prompts_dir, "--repeats", "3") == 0
    results = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())
    for row in results["runs"]:
        rates = row["output_tok_per_s_repeats"]
        assert len(rates) == 3 and row["output_tok_per_s"] == pytest.approx(sum(rates) / 3, rel=1e-3)
    assert {(r["config"], r["accept_len"]) for r in results["runs"]} == {("AR", 1.0), ("DSPINE", 3.0), ("NGRAM", 2.0)}
    # throughput requests (after every profile request): the configs take turns, one block per repeat
    blocks = [order[0]]
    for name in order[order.index("NGRAM") + 1:]:      # skip AR/DSPINE/NGRAM's profile and count requests
        if name != blocks[-1]:
            blocks.append(name)
    assert blocks[-9:] == ["AR", "DSPINE", "NGRAM"] * 3


@pytest.mark.parametrize("diverging", [False, True])
def test_parity_counts_prompts_whose_token_ids_match(servers, tmp_path, prompts_dir, diverging, monkeypatch):
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    monkeypatch.setitem(DIVERGES_ON, "DSPINE", "q-gsm8k-1") if diverging else None
    assert run(servers, tmp_path, prompts_dir, "--parity", "10") == 0
    section = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())["deterministic_parity"]
    assert section["prompts"] == 10
    assert section["identical"] == (9 if diverging else 10)
    assert "enable_deterministic_inference" in section["note"]
    if diverging:
        (d,) = section["divergences"]
        assert (d["id"], d["position"], d["kind"]) == ("gsm8k-1", 5, "near_tie") and d["gap"] == pytest.approx(0.125)
        assert section["prefill_picks"] == {"spec": 1, "ar": 0, "neither": 0}
        assert "picks DSPINE's token at 1" in section["note"]
        (prefill,) = servers["AR"].prefills               # the AR server, prompt + the common prefix
        assert prefill == [ord(ch) for ch in "q-gsm8k-1"] + [0, 1, 2, 3, 4]
    else:
        assert section["divergences"] == [] and not servers["AR"].prefills


def test_parity_needs_ar_and_dspine():
    with pytest.raises(SystemExit):
        bench.main(["--url", "NGRAM=http://127.0.0.1:1", "--shape", "x", "--parity", "4"])


def test_no_server_sees_a_throughput_prompt_twice(servers, tmp_path, prompts_dir):
    """Each (repeat, level) has its own prompts, apart from the profile pool and from the skipped
    ones; every config gets the same ones (NGRAM remembers earlier outputs: module docstring)."""
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    assert run(servers, tmp_path, prompts_dir, "--repeats", "2", "--skip-prompts", "3") == 0
    sent = {name: server.sent for name, server in servers.items()}
    for name, kinds in sent.items():
        levels = kinds["throughput"]
        assert len(levels) == 2 * 2 * 16 and len(set(levels)) == len(levels)
        assert not set(levels) & set(kinds["profile"])
        assert not any(text.endswith(("-0", "-1", "-2")) for text in levels + kinds["profile"])
        assert sorted(levels) == sorted(sent["AR"]["throughput"])


def test_too_few_prompts_in_one_set_is_named(servers, tmp_path, prompts_dir, capsys):
    assert run(servers, tmp_path, prompts_dir, "--workload", "gsm8k", "--repeats", "3") == 1
    assert "lower --prompts or --repeats" in capsys.readouterr().err


def test_a_trace_workload_sends_its_multi_turn_requests_with_their_tools(servers, tmp_path, prompts_dir, capsys):
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
    trace = tmp_path / "agentic_coding.jsonl"
    trace.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": f"s-{i}"}, {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "reading"}, {"role": "user", "content": f"file {i}"}],
        "tools": [tool]}) + "\n" for i in range(96)))
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    assert run(servers, tmp_path, prompts_dir, "--workload", f"trace:{trace}") == 0
    results = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())
    assert {r["workload"] for r in results["runs"]} == {"agentic_coding"}
    ar = servers["AR"]
    assert all(text.startswith("s-") for text in ar.sent["throughput"] + ar.sent["profile"])   # the traces'
    assert ar.tools and all(t == [tool] for t in ar.tools)
    assert len(set(ar.sent["throughput"])) == len(ar.sent["throughput"]) == 2 * 16
    assert run(servers, tmp_path, prompts_dir, "--workload", f"trace:{trace}", "--repeats", "2") == 1
    assert "agentic_coding has 96 prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--url", "AR=http://127.0.0.1:1", "--shape", "x", "--workload", f"trace:{tmp_path / 'none.jsonl'}"])
    assert "no such trace file" in capsys.readouterr().err


def test_report_only_reprints_and_redraws_from_the_file(servers, tmp_path, prompts_dir, capsys):
    pytest.importorskip("matplotlib")
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    assert run(servers, tmp_path, prompts_dir) == 0
    out = tmp_path / "out"
    results = json.loads((out / "round_cost_h200.json").read_text())
    results["round_stages_device_ms"] = {"DSPINE": {"1": {"g1": 0.1, "draft": 0.5, "g2": 0.02, "verify": 1.5, "g3": 0.1}}}
    (out / "round_cost_h200.json").write_text(json.dumps(results))
    (out / "round_cost_h200.png").unlink()
    capsys.readouterr()
    assert bench.main(["--report-only", "--out-dir", str(out)]) == 0
    assert (out / "round_cost_h200.png").stat().st_size > 10_000
    assert "DSPINE" in capsys.readouterr().out
    assert bench.main(["--report-only", "--out-dir", str(tmp_path / "nowhere")]) == 1


def test_measuring_needs_urls_and_a_shape():
    with pytest.raises(SystemExit):
        bench.main(["--shape", "x"])
    with pytest.raises(SystemExit):
        bench.main(["--url", "AR=http://127.0.0.1:1"])


def test_a_failed_parity_pass_still_writes_the_runs(servers, tmp_path, prompts_dir, capsys):
    for name in VERIFY:
        write_phases(tmp_path / "prof" / name, 2.0, {"run_batch": 1.0})
    assert run(servers, tmp_path, prompts_dir, "--parity", "4", "--parity-url", "DSPINE=http://127.0.0.1:9") == 1
    assert "parity not measured" in capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "round_cost_h200.json").read_text())
    assert len(results["runs"]) == 2 * len(VERIFY) and "deterministic_parity" not in results
