"""dspine/bench/dynamic.py end to end against three stub servers (AR, DSPINE-static, DSPINE-dynamic)
on 127.0.0.1: the levels, the per-level accept length and verify tokens from meta_info, concurrency-1
parity against AR, repeated levels, the results schema and the refusal of a dynamic run without a
switch file."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import JsonHandler, start_server

from dspine.bench import dynamic as bench
from dspine.bench.results import BenchError, check_schema
from dspine.dynamic.switch import ServingSwitch, SwitchConfig

TOKENS = 6
BLOCK = 16


def stub(kind: str):
    """AR: no speculative fields. static: 3 decode steps per 6 tokens. dynamic: 4 steps, one of them
    plain (verify widths 16, 16, 1, 16). The dynamic server departs from AR at token 2 of every
    request whose first message says "diverge"."""

    class Handler(JsonHandler):
        def do_GET(self):
            self.send_json({"version": "0.5.17-stub"}) if self.path == "/server_info" else self.send_error(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["temperature"] == 0 and body["return_meta_info"] is True
            ids = [5, 6, 7, 8, 9, 10]
            if kind == "dynamic" and "diverge" in body["messages"][0]["content"]:
                ids[2] = 99
            meta = {}
            if kind == "static":
                meta = {"spec_verify_ct": 3}
            elif kind == "dynamic":
                meta = {"spec_verify_ct": 4, "dspine_verify_tokens": [16, 16, 1, 16]}
            choice = {"message": {"role": "assistant", "content": "x"}, "meta_info": meta}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            if body.get("logprobs"):           # AR's top-2 gap is 0.125 nats at token 2, 2.0 elsewhere
                assert kind == "ar" and body["top_logprobs"] == 2 and body["model"]
                choice["logprobs"] = {"content": [{"top_logprobs": [{"logprob": -0.5}, {"logprob": -0.625 if i == 2
                                                                                        else -2.5}]}
                                                  for i in range(len(ids))]}
            self.send_json({"choices": [choice], "usage": {"completion_tokens": TOKENS}})

    return start_server(Handler)


@pytest.fixture
def servers():
    started = {name: stub(kind) for name, kind in (("AR", "ar"), ("DSPINE-static", "static"),
                                                   ("DSPINE-dynamic", "dynamic"))}
    yield started
    for server in started.values():
        server.shutdown()
        server.server_close()


def test_levels_verify_tokens_parity_and_schema(servers, tmp_path, capsys):
    requests = tmp_path / "heldout.jsonl"
    requests.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 999,
                                            "temperature": 0.7}) + "\n" for text in ("hello", "diverge", "more")))
    switch = tmp_path / "switch.json"
    switch.write_text(json.dumps({"round_table": "r.json"}))
    urls = [f"--url={name}={server.url}" for name, server in servers.items()]
    assert bench.main(["--requests", str(requests), "--switch", str(switch), "--concurrency", "1,4",
                       "--min-requests", "6", "--out-dir", str(tmp_path), *urls]) == 0
    results = json.loads((tmp_path / "dynamic_h200.json").read_text())
    runs = {(r["algorithm"], r["concurrency"]): r for r in results["runs"]}
    assert set(runs) == {(a, c) for a in ("AR", "DSPINE-static", "DSPINE-dynamic") for c in (1, 4)}
    assert runs["AR", 1]["accept_len"] == 1.0 and runs["AR", 1]["mean_verify_tokens"] == 1.0
    assert runs["DSPINE-static", 4]["accept_len"] == pytest.approx(2.0)
    assert runs["DSPINE-static", 4]["mean_verify_tokens"] == BLOCK
    assert runs["DSPINE-dynamic", 4]["accept_len"] == pytest.approx(1.5)
    assert runs["DSPINE-dynamic", 4]["mean_verify_tokens"] == pytest.approx((3 * BLOCK + 1) / 4)
    level = next(lv for lv in results["levels"] if lv["algorithm"] == "DSPINE-dynamic" and lv["concurrency"] == 4)
    assert len(level["repeats_tok_per_s"]) == 3 and level["output_tok_per_s"] == sorted(level["repeats_tok_per_s"])[1]
    assert level["requests"] == 8 and level["plain_steps"] == 8 and level["completion_tokens"] == 8 * TOKENS
    # six requests cycle the three trace lines: two of them ("diverge") depart from AR at token 2
    assert results["parity_c1"]["DSPINE-static"] == {"requests": 6, "identical": 6, "first_difference": []}
    assert results["parity_c1"]["DSPINE-dynamic"] == {"requests": 6, "identical": 4, "first_difference": [2, 2]}
    assert set(results["speedup_vs_ar"]) == {"DSPINE-static", "DSPINE-dynamic"}
    assert results["switch"] == {"round_table": "r.json"} and results["sglang"] == "0.5.17-stub"
    check_schema(results, bench.RESULTS_SCHEMA)
    assert (tmp_path / "dynamic_h200.png").exists()
    assert "DSPINE-dynamic" in capsys.readouterr().out


def test_parity_gaps_judge_each_departure_by_ars_top2_gap(servers, tmp_path):
    """--parity-gaps: AR answers the concurrency-1 requests again with logprobs, and each departure
    of the other configs is judged by AR's gap at its position (0.125 nats at token 2: a near-tie
    at 0.25, not at 0.1)."""
    requests = tmp_path / "heldout.jsonl"
    requests.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                                for text in ("hello", "diverge", "more")))
    switch = tmp_path / "switch.json"
    switch.write_text(json.dumps({"round_table": "r.json"}))
    urls = [f"--url={name}={server.url}" for name, server in servers.items()]
    for nats, kind in ((0.25, "near_tie"), (0.1, "other")):
        out = tmp_path / kind
        assert bench.main(["--requests", str(requests), "--switch", str(switch), "--concurrency", "1",
                           "--min-requests", "3", "--repeats", "1", "--parity-gaps", "--near-tie-nats", str(nats),
                           "--out-dir", str(out), *urls]) == 0
        parity = json.loads((out / "dynamic_h200.json").read_text())["parity_c1"]
        assert parity["DSPINE-static"]["identical"] == 3 and parity["DSPINE-static"]["divergences"] == []
        dynamic = parity["DSPINE-dynamic"]
        assert dynamic["divergences"] == [{"request": 1, "position": 2, "gap": pytest.approx(0.125), "kind": kind}]
        assert (dynamic["near_tie"], dynamic["other"]) == ((1, 0) if kind == "near_tie" else (0, 1))


def test_median_repeat_and_mixed_launchers(tmp_path):
    """The median repeat is reported (lower middle for an even count) with every repeat's throughput;
    `--url NAME=URL` serves the configs it names and serve.sh starts the others."""
    levels = [{"output_tok_per_s": x, "wall_s": x} for x in (30.0, 10.0, 20.0, 40.0)]
    assert bench.median_level(levels) == {"output_tok_per_s": 20.0, "wall_s": 20.0,
                                          "repeats_tok_per_s": [30.0, 10.0, 20.0, 40.0]}
    assert bench.median_level(levels[:3])["output_tok_per_s"] == 20.0
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    args = bench.parse_args(["--requests", str(requests), "--url", "DSPINE-plain=http://127.0.0.1:9/",
                             "--out-dir", str(tmp_path)])
    launchers = bench.ConfigLaunchers(args)
    assert launchers.start("DSPINE-plain", []) == "http://127.0.0.1:9"
    assert launchers._for("AR") is launchers.serve and launchers._for("DSPINE-plain") is launchers.urls
    with pytest.raises(SystemExit):
        bench.parse_args(["--requests", str(requests), "--repeats", "0"])


def test_ratios_against_the_mean_of_several_ar_runs(tmp_path):
    """With `ar_runs` the ratios use their mean, not the AR entries of `runs`; the plot draws them."""
    runs = [{"algorithm": "AR", "concurrency": 1, "output_tok_per_s": 100.0},
            {"algorithm": "DSPINE-dynamic", "concurrency": 1, "output_tok_per_s": 120.0}]
    assert bench.speedups(runs) == {"DSPINE-dynamic": [(1, 1.2)]}
    assert bench.speedups(runs, {1: 150.0}) == {"DSPINE-dynamic": [(1, 0.8)]}
    results = {"device": "d", "target": "t", "runs": runs, "label": "now",
               "ar_runs": {"runs": {"a": {"1": 100.0}, "b": {"1": 200.0}}, "mean": {"1": 150.0}},
               "previous_runs": [{"label": "host 1, old", "runs": runs}]}
    assert bench.plot(results, tmp_path) == tmp_path / "dynamic_h200.png"


def test_dynamic_needs_a_switch_file_and_requests_need_messages(tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(BenchError, match="--switch"):
        bench.main(["--requests", str(requests), "--url", "AR=http://127.0.0.1:9", "--out-dir", str(tmp_path)])
    requests.write_text('{"prompt": "x"}\n')
    with pytest.raises(BenchError, match=r"r.jsonl:1: .*messages"):
        bench.load_requests(requests, 16)


def test_the_plain_config_runs_a_server_under_a_forced_plain_switch_file(tmp_path):
    """DSPINE-plain: the server gets `DSPINE_DYNAMIC=<a forced switch file>` in its environment (and
    nothing else of the switch's), the file forces plain steps of --plain-tokens tokens; a stand-in
    serve script records the environment it was started with, then fails to start."""
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    serve = tmp_path / "serve.sh"
    serve.write_text('[ "$1" = start ] || exit 0\necho "DSPINE_DYNAMIC=$DSPINE_DYNAMIC" > "$SGL_LOG"\nexit 1\n')
    out = tmp_path / "out"
    rc = bench.main(["--requests", str(requests), "--configs", "DSPINE-plain", "--plain-tokens", "8",
                     "--serve-script", str(serve), "--concurrency", "1", "--out-dir", str(out)])
    assert rc == 1
    forced = out.resolve() / bench.FORCED_PLAIN_FILE
    assert json.loads(forced.read_text()) == {"force": "plain", "plain_tokens": 8}
    assert (out / "sglang-DSPINE-plain.log").read_text().strip() == f"DSPINE_DYNAMIC={forced}"
    results = json.loads((out / "dynamic_h200.json").read_text())
    assert results["configs"]["DSPINE-plain"]["env"] == {"DSPINE_DYNAMIC": str(forced)}
    assert "--speculative-algorithm" in results["configs"]["DSPINE-plain"]["flags"]
    assert "exit 1" in results["errors"][0]


def test_the_alternating_switch_drafts_new_requests_then_alternates_once_drafts_fail(tmp_path):
    """The untuned file of --alternating-switch is a valid switch file; under it a new request drafts,
    and once its drafts carry no confidence (a random drafter) the decisions mix both kinds."""
    path = bench.write_alternating_switch(tmp_path, 16, plain_tokens=4)
    config = SwitchConfig.load(path)
    assert config.plain_tokens == 4 and len(config.prior_survival) == 15
    switch = ServingSwitch(config, 16)
    assert switch.decide(["a"]) is True
    switch.observe(["a"], torch.full((1, 15), -6.0))
    kinds = [switch.decide(["a"]) for _ in range(40)]
    assert 0 < sum(kinds) < 40 and kinds[0] is False


def test_the_dynamic_config_gets_the_alternating_file_and_spec_flags_reach_dspine_only(tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    serve = tmp_path / "serve.sh"
    serve.write_text('[ "$1" = start ] || exit 0\necho "DSPINE_DYNAMIC=$DSPINE_DYNAMIC" > "$SGL_LOG"\nexit 1\n')
    out = tmp_path / "out"
    rc = bench.main(["--requests", str(requests), "--configs", "AR,DSPINE-dynamic", "--alternating-switch",
                     "--plain-tokens", "4", "--spec-flags", "--linear-replayssm-cache-len 32",
                     "--serve-script", str(serve), "--concurrency", "1", "--out-dir", str(out)])
    assert rc == 1
    written = out.resolve() / bench.ALTERNATING_SWITCH_FILE
    assert (out / "sglang-DSPINE-dynamic.log").read_text().strip() == f"DSPINE_DYNAMIC={written}"
    results = json.loads((out / "dynamic_h200.json").read_text())
    assert results["switch"]["plain_tokens"] == 4
    assert "--linear-replayssm-cache-len" in results["configs"]["DSPINE-dynamic"]["flags"]
    assert "--linear-replayssm-cache-len" not in results["configs"]["AR"]["flags"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--requests", str(requests), "--switch", str(written), "--alternating-switch"])
