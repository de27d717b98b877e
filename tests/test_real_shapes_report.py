"""`dspine.bench.real_shapes_report`: rounds, soaks and start-up logs joined into real_shapes_h200.json."""

import json

import pytest

from dspine.bench import real_shapes_report as rep
from dspine.bench.dynamic import level_stats, parity_c1
from dspine.bench.results import BenchError

# SGLang 0.5.17's start-up lines (shortened) and the DSPINE worker's
LOG_27B = """\
[2026-12-04 10:00:01] DSPINE serve flag --speculative-algorithm DSPINE: speculative_algorithm = 'DSPINE'
[2026-12-04 10:00:01] DSPINE serve flag --enable-linear-replayssm-spec: enable_linear_replayssm_spec = True
[2026-12-04 10:00:02] Load weight end. elapsed=0.15 s, type=Qwen3_5ForCausalLM, avail mem=80.1 GB, mem usage=53.80 GB.
[2026-12-04 10:00:03] Load weight end. elapsed=0.01 s, type=DSpineDraftModel, avail mem=76.2 GB, mem usage=3.90 GB.
[2026-12-04 10:00:04] Mamba Cache is allocated. max_mamba_cache_size: 66, conv_state size: 0.12GB, ssm_state size: 9.98GB intermediate_ssm_state_cache size: 0.00GB intermediate_conv_window_cache size: 0.31GB
[2026-12-04 10:00:04] GDN ReplaySSM ring buffers allocated (record_len=16, fold=True): d=0.000GB, k=0.000GB, g=0.001GB rawv=0.124GB, rawk=0.041GB, beta=0.001GB
[2026-12-04 10:00:05] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 100000, K size: 3.05 GB, V size: 3.05 GB
[2026-12-04 10:00:05] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 100000, K size: 1.00 GB, V size: 1.00 GB
[2026-12-04 10:00:06] DSPINE ReplaySSM verify scratch per request: 7000000 bytes (ring 2500000 + conv windows 4500000, as allocated) against 158000000 bytes of per-token snapshots (SSM states 153500000 + conv windows 4500000): 22.6x smaller.
"""
LOG_8B = """\
[2026-12-04 10:10:01] DSPINE serve flag --speculative-algorithm DSPINE: speculative_algorithm = 'DSPINE'
[2026-12-04 10:10:02] Load weight end. elapsed=0.15 s, type=Qwen3ForCausalLM, avail mem=123.85 GB, mem usage=15.28 GB.
[2026-12-04 10:10:05] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 331446, K size: 22.76 GB, V size: 22.76 GB
"""


def soak(minutes=10.02, requests=9000, errors=0):
    return {"config": "P", "minutes": minutes, "requests": requests, "errors": errors, "max_latency_over_p99": 1.4,
            "health_non_200": 0, "passed": errors == 0}


def run(config, shape, c, t, ms):
    return {"config": config, "shape": shape, "workload": "mix", "concurrency": c, "temperature": t,
            "prompt_tokens": 120, "ms_per_step": ms, "host_ms_per_step": 1.0, "output_tok_per_s": 100.0,
            "accept_len": 1.02 if config == "DSPINE" else 1.0}


def rounds(drop_ar=None):
    runs = []
    for shape, step in (("qwen3.8-27b", 14.0), ("qwen3-8b", 6.0)):
        for t in (0.0, 1.0):
            for c in (1, 8, 32):
                runs.append(run("DSPINE", shape, c, t, step * (1.2 + c / 32)))
                if (shape, c, t) != drop_ar:
                    runs.append(run("AR", shape, c, t, step * (1 + c / 64) * (1 + t / 10)))
    return {"device": "NVIDIA H200", "date": "2026-12-04", "command": "bench_round_cost.py ...", "sglang": "0.5.17",
            "runs": runs}


def test_the_report_joins_rounds_soaks_memory_and_the_scratch_line():
    out = rep.report(rounds(), {"qwen3.8-27b": (soak(), LOG_27B), "qwen3-8b": (soak(requests=20000), LOG_8B)},
                     True, "report_real_shapes.py ...")
    rep.check_schema(out, rep.RESULTS_SCHEMA)
    big, small = out["presets"]
    assert (big["preset"], big["requests"], small["requests"], big["errors"]) == ("qwen3.8-27b", 9000, 20000, 0)
    assert big["flags_logged_in_effect"] == 2 and small["flags_logged_in_effect"] == 1
    assert big["memory_gb"] == {"weights": {"Qwen3_5ForCausalLM": 53.8, "DSpineDraftModel": 3.9}, "mamba_state": 10.1,
                                "replayssm_ring": 0.167, "kv": 8.1}
    assert small["memory_gb"] == {"weights": {"Qwen3ForCausalLM": 15.28}, "kv": 45.52}
    assert len(big["rounds"]) == 6 and {(r["concurrency"], r["temperature"]) for r in big["rounds"]} == {
        (c, t) for c in (1, 8, 32) for t in (0.0, 1.0)}
    first = big["rounds"][0]
    assert (first["concurrency"], first["temperature"]) == (1, 0.0)
    assert first["ms_per_round"] == pytest.approx(14.0 * (1.2 + 1 / 32))
    assert first["ms_per_step"] == pytest.approx(14.0 * (1 + 1 / 64))          # AR's step of the same target
    sampled = next(r for r in big["rounds"] if (r["concurrency"], r["temperature"]) == (32, 1.0))
    assert sampled["ms_per_step"] == pytest.approx(14.0 * 1.5 * 1.1)            # ... at the same temperature
    assert out["replayssm_scratch"] == {"preset": "qwen3.8-27b", "replayssm_bytes": 7000000,
                                        "snapshot_bytes": 158000000, "ratio": 22.57}
    assert out["dynamic_switch_hybrid"] is True


def test_a_run_whose_phases_held_other_steps_is_left_out_with_its_reason():
    data = rounds()
    for r in data["runs"]:       # the 27B DSPINE T=1 run read phases an earlier run's c=1 throughput filled
        r["mean_batch_size"] = float(r["concurrency"])
        if (r["shape"], r["config"], r["temperature"]) == ("qwen3.8-27b", "DSPINE", 1.0):
            r["mean_batch_size"] = 1.0
    out = rep.report(data, {"qwen3.8-27b": (soak(), LOG_27B), "qwen3-8b": (soak(), LOG_8B)}, True, "r ...")
    big, small = out["presets"]
    assert {(r["concurrency"], r["temperature"]) for r in big["rounds"]} == {(1, 0.0), (8, 0.0), (32, 0.0)}
    assert len(small["rounds"]) == 6                              # the 8B runs are untouched
    assert out["rounds_left_out"] == [{"shape": "qwen3.8-27b", "config": "DSPINE", "temperature": 1.0, "reason":
                                       "c=8 measured a mean batch of 1; c=32 measured a mean batch of 1; "
                                       "the run's step-profile phases held other decode steps"}]


def test_a_later_run_of_the_other_preset_keeps_the_earlier_one(tmp_path):
    """The 27B preset measured on an H200 in one session, the 8B one alone later: one file, both
    presets, each with its own device, and the scratch from the run that served the hybrid."""
    first = rounds()
    first["runs"] = [r for r in first["runs"] if r["shape"] == "qwen3.8-27b"]
    for r in first["runs"]:
        r["mean_batch_size"] = 1.0 if r["temperature"] == 1.0 else float(r["concurrency"])   # T=1 left out
    paths = {}
    for name, body in (("rounds27.json", first), ("soak27.json", soak()), ("soak8.json", soak(requests=20000))):
        paths[name] = tmp_path / name
        paths[name].write_text(json.dumps(body))
    (tmp_path / "P27.log").write_text(LOG_27B)
    (tmp_path / "P8.log").write_text(LOG_8B)
    out = tmp_path / "out"
    common = ["--dynamic-switch-hybrid", "measured elsewhere", "--out-dir", str(out)]
    assert rep.main(["--rounds", str(paths["rounds27.json"]), "--preset",
                     f"qwen3.8-27b={paths['soak27.json']},{tmp_path / 'P27.log'}", *common]) == 0
    second = rounds()
    second["device"] = "NVIDIA H100 80GB HBM3"
    second["runs"] = [r for r in second["runs"] if r["shape"] == "qwen3-8b"]
    paths["rounds8.json"] = tmp_path / "rounds8.json"
    paths["rounds8.json"].write_text(json.dumps(second))
    assert rep.main(["--rounds", str(paths["rounds8.json"]), "--preset",
                     f"qwen3-8b={paths['soak8.json']},{tmp_path / 'P8.log'}",
                     "--no-hybrid-preset", "the 8B preset alone", *common]) == 0
    results = json.loads((out / "real_shapes_h200.json").read_text())
    assert [(p["preset"], p["device"], len(p["rounds"])) for p in results["presets"]] == [
        ("qwen3.8-27b", "NVIDIA H200", 3), ("qwen3-8b", "NVIDIA H100 80GB HBM3", 6)]
    assert results["device"] == "NVIDIA H200 (qwen3.8-27b); NVIDIA H100 80GB HBM3 (qwen3-8b)"
    assert results["replayssm_scratch"]["preset"] == "qwen3.8-27b"          # kept from the first run
    assert [(r["config"], r["temperature"]) for r in results["rounds_left_out"]] == [("AR", 1.0), ("DSPINE", 1.0)]
    rep.check_schema(results, rep.RESULTS_SCHEMA)


def test_a_rounds_only_rerun_keeps_the_soak_and_fills_the_left_out_temperature():
    first = rounds()
    first["runs"] = [r for r in first["runs"] if r["shape"] == "qwen3.8-27b"]
    for r in first["runs"]:
        r["mean_batch_size"] = 1.0 if r["temperature"] == 1.0 else float(r["concurrency"])   # T=1 left out
    earlier = rep.report(first, {"qwen3.8-27b": (soak(requests=3089), LOG_27B)}, True, "first")
    assert len(earlier["presets"][0]["rounds"]) == 3 and len(earlier["rounds_left_out"]) == 2
    second = rounds()                                  # both temperatures measured right, on an H200 again
    second["runs"] = [r for r in second["runs"] if r["shape"] == "qwen3.8-27b"
                      and (r["concurrency"], r["temperature"]) != (32, 0.0)]     # that one kept from before
    second["date"] = "2026-12-08"
    for r in second["runs"]:
        r["mean_batch_size"] = float(r["concurrency"])
        r["ms_per_step"] *= 1.01
    out = rep.report(second, {"qwen3.8-27b": (None, LOG_27B)}, True, "second", earlier=earlier)
    rep.check_schema(out, rep.RESULTS_SCHEMA)
    (entry,) = out["presets"]
    assert (entry["requests"], entry["soak_date"], entry["date"]) == (3089, "2026-12-04", "2026-12-08")
    assert {(r["concurrency"], r["temperature"]) for r in entry["rounds"]} == {
        (c, t) for c in (1, 8, 32) for t in (0.0, 1.0)}
    assert entry["rounds"][0]["ms_per_round"] == pytest.approx(14.0 * (1.2 + 1 / 32) * 1.01)   # the new run's
    assert entry["rounds"][2]["ms_per_round"] == pytest.approx(14.0 * (1.2 + 1))               # the earlier one
    assert "rounds_left_out" not in out
    with pytest.raises(BenchError, match="no soak"):
        rep.report(second, {"qwen3.8-27b": (None, LOG_27B)}, True, "second")


def reply(ids, widths):
    """One bench_dynamic reply: token ids and the verify width of each decode step (16 draft, 1 plain)."""
    return {"tokens": len(ids), "verify_ct": len(widths), "verify_tokens": widths, "token_ids": ids}


def switch_run(plain_ids=(1, 2, 3), dynamic_widths=(16, 1, 1), errors=()):
    """A bench_dynamic results file of AR, DSPINE-plain and DSPINE-dynamic servers at concurrency 1,
    made with its own level and parity functions."""
    passes = {"AR": [reply([1, 2, 3], [])], "DSPINE-plain": [reply(list(plain_ids), [1, 1, 1])],
              "DSPINE-dynamic": [reply([1, 2, 3], list(dynamic_widths))]}
    levels = [{"algorithm": name, "concurrency": 1, **level_stats(replies, 1.0, 16)} for name, replies in passes.items()]
    return {"command": "bench_dynamic.py ...", "target": "/tmp/hybrid/target", "switch": {"plain_tokens": 4},
            "levels": levels, "parity_c1": parity_c1(passes), "errors": list(errors)}


def test_the_switch_verdict_needs_parity_and_both_step_kinds():
    assert rep.switch_verdict(switch_run()) is True
    diverged = rep.switch_verdict(switch_run(plain_ids=(1, 2, 4)))
    assert diverged == "DSPINE-plain: 1 of 1 requests differ from AR's tokens (first differences at [2])"
    assert "DSPINE-dynamic: 0 of 3 tagged decode steps plain (expected both kinds)" in \
        rep.switch_verdict(switch_run(dynamic_widths=(16, 16, 16)))
    failed = rep.switch_verdict(switch_run(errors=["DSPINE-dynamic: the server refused the switch file"]))
    assert failed.startswith("DSPINE-dynamic: the server refused the switch file")


def test_the_switch_verdict_admits_the_rounds_departures_at_ar_near_ties_only():
    """With AR's gaps (--parity-gaps) a departure of the dynamic server at an AR near-tie is what a
    verify forward does on any speculative server; one elsewhere, or any departure of the
    forced-plain server (AR's own decodes), is not."""
    def judged(dynamic_ids, plain_ids=(1, 2, 3), gaps=(2.0, 0.125, 2.0)):
        run = switch_run(plain_ids=plain_ids)
        run["levels"][2] = {**run["levels"][2]}
        passes = {"AR": [reply([1, 2, 3], [])], "DSPINE-plain": [reply(list(plain_ids), [1, 1, 1])],
                  "DSPINE-dynamic": [reply(list(dynamic_ids), [16, 1, 1])]}
        run["parity_c1"] = parity_c1(passes, [[[-0.1, -0.1 - g] for g in gaps]])
        return rep.switch_verdict(run)

    assert judged([1, 7, 8]) is True                                          # at token 1: gap 0.125
    assert judged([7, 8, 9]) == ("DSPINE-dynamic: 1 of 1 requests differ from AR's tokens (0 at AR near-ties "
                                 "(top-2 gap <= 0.25 nats), 1 elsewhere; first differences at [0])")
    assert judged([1, 7, 8], plain_ids=(1, 7, 3)).startswith("DSPINE-plain: 1 of 1 requests differ")


def test_a_departure_the_never_switching_server_makes_too_is_not_the_switchs():
    """DSPINE-static runs the same rounds without ever switching: a dynamic departure it makes at the
    same request and position comes from the verify forward, not the switch; one it does not make,
    or a departure of the forced-plain server, still fails the verdict."""
    gaps = [[[-0.1, -0.1 - g] for g in (2.0, 2.0, 2.0)]]

    def judged(static_ids):
        run = switch_run()
        passes = {"AR": [reply([1, 2, 3], [])], "DSPINE-dynamic": [reply([1, 7, 8], [16, 1, 1])],
                  "DSPINE-static": [reply(list(static_ids), [16, 16, 16])]}
        run["parity_c1"] = {**run["parity_c1"], **parity_c1(passes, gaps)}
        return rep.switch_verdict(run)

    assert judged([1, 9, 9]) is True                                  # static departs at token 1 too
    assert judged([1, 2, 9]).startswith("DSPINE-dynamic: 1 of 1 requests differ")   # static departs later
    assert judged([1, 2, 3]).startswith("DSPINE-dynamic: 1 of 1 requests differ")   # static matches AR


def test_runs_of_one_pair_merge_into_one_verdict():
    """AR + DSPINE-plain on one host, AR + DSPINE-dynamic on another: each config's parity and steps
    come from the run that served it; runs of another pair are refused."""
    both = switch_run()
    plain_run = {**both, "parity_c1": {"DSPINE-plain": both["parity_c1"]["DSPINE-plain"]},
                 "levels": [level for level in both["levels"] if level["algorithm"] != "DSPINE-dynamic"],
                 "device": "NVIDIA H100", "date": "d1"}
    dynamic_run = {**both, "parity_c1": {"DSPINE-dynamic": both["parity_c1"]["DSPINE-dynamic"]},
                   "levels": [level for level in both["levels"] if level["algorithm"] != "DSPINE-plain"],
                   "device": "NVIDIA H200", "date": "d2"}
    assert rep.switch_verdict(plain_run).startswith("DSPINE-dynamic: no parity against AR")
    merged = rep.merge_switch_runs([plain_run, dynamic_run])
    assert rep.switch_verdict(merged) is True
    assert [level["algorithm"] for level in merged["levels"]] == ["AR", "DSPINE-plain", "DSPINE-dynamic"]
    assert [source["device"] for source in rep.switch_run(merged)["sources"]] == ["NVIDIA H100", "NVIDIA H200"]
    with pytest.raises(BenchError, match="different targets"):
        rep.merge_switch_runs([plain_run, {**dynamic_run, "target": "/tmp/other/target"}])


def test_a_round_without_its_ar_step_names_the_missing_run():
    with pytest.raises(BenchError, match=r"qwen3-8b: DSPINE at c=8, T=1 has no AR step beside it"):
        rep.report(rounds(drop_ar=("qwen3-8b", 8, 1.0)), {"qwen3-8b": (soak(), LOG_8B), "qwen3.8-27b": (soak(), LOG_27B)},
                   True, "x")


def test_without_the_hybrid_presets_scratch_line_there_is_no_report():
    with pytest.raises(BenchError, match="ReplaySSM scratch line"):
        rep.report(rounds(), {"qwen3-8b": (soak(), LOG_8B)}, True, "x")


def test_a_run_without_the_hybrid_preset_says_why_in_place_of_the_scratch(tmp_path):
    eight_b = {"runs": [r for r in rounds()["runs"] if r["shape"] == "qwen3-8b"]}
    out = rep.report({**rounds(), **eight_b}, {"qwen3-8b": (soak(), LOG_8B)}, True, "x",
                     no_hybrid_preset="the 27B preset needs an H200")
    assert out["replayssm_scratch"] == "not measured: the 27B preset needs an H200"
    assert [p["preset"] for p in out["presets"]] == ["qwen3-8b"] and len(out["presets"][0]["rounds"]) == 6
    (tmp_path / "rounds.json").write_text(json.dumps({**rounds(), **eight_b}))
    (tmp_path / "soak.json").write_text(json.dumps(soak()))
    (tmp_path / "P8.log").write_text(LOG_8B)
    argv = ["--rounds", str(tmp_path / "rounds.json"), "--out-dir", str(tmp_path), "--results-name", "real_shapes_h100",
            "--preset", f"qwen3-8b={tmp_path / 'soak.json'},{tmp_path / 'P8.log'}", "--dynamic-switch-hybrid", "r"]
    assert rep.main(argv) == 1                                       # the reason is not optional
    assert rep.main(argv + ["--no-hybrid-preset", "8B alone"]) == 0
    assert json.loads((tmp_path / "real_shapes_h100.json").read_text())["replayssm_scratch"] == "not measured: 8B alone"


def test_the_command_line_writes_the_file_and_a_plot(tmp_path, capsys):
    (tmp_path / "rounds.json").write_text(json.dumps(rounds()))
    for name, log, data in (("P27", LOG_27B, soak()), ("P8", LOG_8B, soak())):
        (tmp_path / f"soak_{name}.json").write_text(json.dumps(data))
        (tmp_path / f"{name}.log").write_text(log)
    argv = ["--rounds", str(tmp_path / "rounds.json"), "--out-dir", str(tmp_path / "out"),
            "--preset", f"qwen3.8-27b={tmp_path / 'soak_P27.json'},{tmp_path / 'P27.log'}",
            "--preset", f"qwen3-8b={tmp_path / 'soak_P8.json'},{tmp_path / 'P8.log'}",
            "--dynamic-switch-hybrid", "plain steps read a stale state"]
    assert rep.main(argv) == 0
    written = json.loads((tmp_path / "out" / "real_shapes_h200.json").read_text())
    assert written["dynamic_switch_hybrid"] == "plain steps read a stale state"
    assert "22.57x smaller" in capsys.readouterr().out
    if rep.pyplot() is not None:
        assert (tmp_path / "out" / "real_shapes_h200.png").stat().st_size > 10_000
    assert rep.main(argv[:-2] + ["--dynamic-switch-hybrid", "true", "--rounds", str(tmp_path / "none.json")]) == 1
    (tmp_path / "dynamic_h200.json").write_text(json.dumps(switch_run()))
    assert rep.main(argv[:-2] + ["--hybrid-switch", str(tmp_path / "dynamic_h200.json")]) == 0
    written = json.loads((tmp_path / "out" / "real_shapes_h200.json").read_text())
    assert written["dynamic_switch_hybrid"] is True
    assert written["hybrid_switch_run"]["steps"]["DSPINE-dynamic"] == {"tagged_steps": 3, "plain_steps": 2}
    with pytest.raises(SystemExit):          # the verdict comes from one source only
        rep.main(argv + ["--hybrid-switch", str(tmp_path / "dynamic_h200.json")])
