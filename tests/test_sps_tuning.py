"""`dspine tune-sps` end to end against a stub server on 127.0.0.1 (synthetic step times)."""

from __future__ import annotations

import json
import math
import random
import shlex
import threading
import time
from pathlib import Path

import pytest
from conftest import JsonHandler, start_server

from dspine.cli import main as dspine_main
from dspine.dynamic.calibration import PositionCalibration
from dspine.dynamic.cost_tables import SpsCostTable, load_sps_table
from dspine.serve.sps_fit import fit_additive
from dspine.serve.sps_measure import new_step_times

TRACE = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "sharegpt_dev.jsonl"
VERIFY = 4           # stub's speculative_num_draft_tokens
TOKENS = 6           # completion tokens per stub request
TRUE_TEMPS = [0.5, 1.0, 2.0]


def step_seconds(bs: int) -> float:
    """The stub's step time at batch size bs: the steps/s curve the table must reproduce."""
    return 0.002 + 0.0005 * bs


class Stub:
    """/v1/chat/completions sleeps TOKENS steps at the batch size in flight when it arrives and
    records that step time in step_time_dict (when `record`); /generate returns DSPINE meta_info."""

    def __init__(self, record: bool, clock_kind: str | None = None):
        self.record, self.lock, self.inflight = record, threading.Lock(), 0
        self.step_times: dict[str, list[float]] = {}
        self.clock_kind, self.clock = clock_kind, {}       # a DSPINE worker's step clock: {bs: [steps, seconds]}
        self.chat_calls = self.generate_calls = 0
        stub = self

        class Handler(JsonHandler):
            def do_GET(self):
                if self.path != "/server_info":
                    self.send_error(404)
                    return
                with stub.lock:
                    state = {"step_time_dict": {k: list(v) for k, v in stub.step_times.items()}} if stub.record else {}
                    if stub.clock_kind:
                        state["dspine_step_time_dict"] = {"draft": {}, "plain": {},
                                                          stub.clock_kind: {k: list(v) for k, v in stub.clock.items()}}
                self.send_json({"version": "0.5.22-stub", "model_path": "stub/target", "speculative_algorithm": "DSPINE",
                            "speculative_draft_model_path": "stub/drafter", "speculative_num_draft_tokens": VERIFY,
                            "dp_size": 1, "tp_size": 1, "cuda_graph_max_bs": 8, "gpu_name": "Stub GPU",
                            "internal_states": [state]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/chat/completions":
                    with stub.lock:
                        stub.chat_calls += 1
                        stub.inflight += 1
                        bs = stub.inflight
                        if stub.record:    # with a clock, SGLang's interval also holds prefills: 3x here
                            inflation = 3 if stub.clock_kind else 1
                            stub.step_times.setdefault(str(bs), []).append(step_seconds(bs) * inflation)
                        if stub.clock_kind:
                            total = stub.clock.setdefault(str(bs), [0, 0.0])
                            total[0] += TOKENS
                            total[1] += TOKENS * step_seconds(bs)
                    tokens = min(body.get("max_tokens", TOKENS), TOKENS)
                    time.sleep(tokens * step_seconds(bs))
                    with stub.lock:
                        stub.inflight -= 1
                    self.send_json({"choices": [{"message": {"role": "assistant", "content": "x"}}],
                                "usage": {"completion_tokens": tokens}})
                elif self.path == "/generate":
                    with stub.lock:
                        stub.generate_calls += 1
                    rng = random.Random(stub.generate_calls)
                    logits = [[rng.gauss(0, 2) for _ in TRUE_TEMPS] for _ in range(20)]
                    accept = []
                    for row in logits:
                        n = 0
                        while n < len(row) and rng.random() < 1 / (1 + math.exp(-row[n] / TRUE_TEMPS[n])):
                            n += 1
                        accept.append(n)
                    self.send_json({"text": "x", "meta_info": {"completion_tokens": 20 + sum(accept), "spec_verify_ct": 20,
                                                           "dspine_confidence_logits": logits,
                                                           "dspine_accept_lens": accept}})
                else:
                    self.send_error(404)

        self.server = start_server(Handler)
        self.url = self.server.url

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub(request):
    server = Stub(record=request.param)
    yield server
    server.close()


# The flags and variables through which a DSPINE server takes the tuned files and the deployment
# (read by the plugin and the worker); SGLang's `--speculative-dspark-*` flags are not among them.
DSPINE_READS_FLAGS = {"--preset", "--model-path", "--speculative-algorithm", "--speculative-draft-model-path",
                      "--speculative-num-draft-tokens"}


def assert_dspine_honours(command: str, switch: Path | None = None, serve_args: tuple[str, ...] = ()) -> None:
    """`command` (`[DSPINE_DYNAMIC=FILE] sglang serve ...` or `... dspine serve --preset ...`) holds only
    flags a DSPINE server reads (plus `serve_args`), sets DSPINE_DYNAMIC to `switch` (a dynamic switch
    file) iff one is given, and passes `dspine serve`'s checks in that environment."""
    from dspine.dynamic.switch import SwitchConfig
    from dspine.serve import launch, presets

    tokens = shlex.split(command)
    assignments = [t for t in tokens[: next(i for i, t in enumerate(tokens) if "=" not in t)]]
    environ = dict(a.split("=", 1) for a in assignments)
    assert environ == ({} if switch is None else {"DSPINE_DYNAMIC": str(switch.resolve())})
    if switch is not None:
        SwitchConfig.load(environ["DSPINE_DYNAMIC"])
    program = tokens[len(assignments):]
    assert program[:2] in (["sglang", "serve"], ["dspine", "serve"])
    flags = launch.parse_sglang_flags(program[2:])
    extra = set(launch.parse_sglang_flags(list(serve_args)))
    assert set(flags) <= DSPINE_READS_FLAGS | extra, set(flags) - DSPINE_READS_FLAGS - extra
    assert not any("dspark" in flag for flag in flags)
    if program[:2] == ["sglang", "serve"]:
        errors, _ = presets.validate_flags(flags, environ)
    else:
        preset = presets.load_preset(flags.pop("--preset")[0])
        user = [t for flag, values in flags.items() for t in (flag, *values)]
        errors = launch.build_serve_command(preset, user, ["sglang", "serve"], environ).errors
    assert errors == []


def test_the_printed_preset_command_keeps_the_sweeps_sglang_flags(tmp_path):
    """With --preset: `dspine serve --preset NAME` plus the sglang flags the sweep's server ran with,
    and DSPINE_DYNAMIC when a switch file was written."""
    from dspine.dynamic.switch import write_switch_file
    from dspine.serve.tune_sps import serve_command

    for name, steps in (("round.json", [16, 64]), ("plain.json", [1, 4])):
        (tmp_path / name).write_text(json.dumps({"sample_batch_tokens": steps, "sample_steps_per_sec": [100.0, 50.0],
                                                 "max_batch_tokens": steps[-1]}))
    switch = tmp_path / "switch.json"
    write_switch_file(switch, round_table="round.json", plain_table="plain.json", calibration=None,
                      prior_survival=[0.5] * 15, plain_tokens=4)
    serve_args = ("--max-running-requests", "8")
    command = serve_command("smollm2-135m", list(serve_args), {}, switch)
    assert command == (f"DSPINE_DYNAMIC={switch.resolve()} dspine serve --preset smollm2-135m "
                       "--max-running-requests 8")
    assert_dspine_honours(command, switch=switch, serve_args=serve_args)
    assert serve_command("smollm2-135m", [], {}, None) == "dspine serve --preset smollm2-135m"


def tune(stub, out, *extra):
    return dspine_main(["tune-sps", "--url", stub.url, "--traces", str(TRACE), "--out", str(out), "--quiet",
                        "--requests-per-level", "8", "--max-tokens", "32", *extra])


@pytest.mark.parametrize("stub", [True], indirect=True)
def test_server_step_times_resume_manifest_and_command(stub, tmp_path, capsys):
    out = tmp_path / "sps"
    assert tune(stub, out, "--concurrencies", "1,2", "--acceptance-requests", "4") == 0
    first = capsys.readouterr().out
    table = load_sps_table(out / "sps_table.json")
    assert isinstance(table, SpsCostTable) and table.sample_batch_tokens[0] == VERIFY
    for tokens, sps in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
        assert sps == pytest.approx(1 / step_seconds(tokens // VERIFY), rel=1e-9)   # the stub's exact curve
    assert table.max_batch_tokens == 8 * VERIFY                                  # cuda_graph_max_bs x verify
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert {r["source"] for r in rows} == {"server_step_time"}
    assert set(rows[0]) >= {"batch_size_per_rank", "batch_tokens", "steps_per_sec", "frac"}
    command = first.strip().splitlines()[-1]
    assert command == ("sglang serve --model-path stub/target --speculative-algorithm DSPINE "
                       "--speculative-draft-model-path stub/drafter --speculative-num-draft-tokens 4")
    assert_dspine_honours(command)                       # no switch file yet: static, and a note says why

    cal = PositionCalibration.load(out / "sts.json")
    assert len(cal.temperatures) == len(TRUE_TEMPS) and cal.temperatures[0] < cal.temperatures[-1]
    assert "biases" not in json.loads((out / "sts.json").read_text())           # SGLang's file
    affine = PositionCalibration.load(out / "sts_affine.json")
    assert len(affine.biases) == len(TRUE_TEMPS) and affine.dataset == cal.dataset
    manifest = json.loads((out / "manifest.json").read_text())
    assert any("no switch.json (pass --plain-table)" in n for n in manifest["notes"])
    for key in ("created", "gpu", "sglang_version", "target", "drafter", "flags", "cuda_graph_sizes", "traces",
                "concurrencies", "timing", "serve_command"):
        assert manifest[key] not in (None, "", [], {}), key
    assert manifest["gpu"] == "Stub GPU" and manifest["traces"][0]["sha256"]
    assert (out / "sps.png").stat().st_size > 0 and (out / "calibration.png").is_file()

    calls = stub.chat_calls, stub.generate_calls
    assert tune(stub, out, "--concurrencies", "1,2,4") == 0                     # resume: only level 4 runs
    assert stub.chat_calls - calls[0] == 8 and stub.generate_calls == calls[1]
    assert "already in" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["concurrencies"] == [1, 2, 4]
    assert tune(stub, out, "--concurrencies", "1", "--restart", "--acceptance-requests", "0") == 0
    assert {json.loads(line)["concurrency"] for line in (out / "rounds.jsonl").read_text().splitlines()} == {1}


@pytest.mark.parametrize("stub", [True], indirect=True)
def test_check_calibration_on_another_split(stub, tmp_path, capsys):
    """A calibration fitted on one run checked on a second run's records (the stub draws both from
    the same true temperatures): calibrated survival is within a few points per position and its
    ECE beats the raw head's; a width mismatch or a missing file is refused before any replay."""
    tuned, held = tmp_path / "tune", tmp_path / "heldout"
    assert tune(stub, tuned, "--concurrencies", "1", "--acceptance-requests", "16") == 0
    fitted = tuned / "sts_affine.json"
    assert tune(stub, held, "--concurrencies", "1", "--acceptance-requests", "16", "--check-calibration",
                str(fitted), "--gpu", "Named GPU") == 0
    check = json.loads((held / "calibration_check.json").read_text())
    assert check["rounds"] == 16 * 20 and len(check["positions"]) == len(TRUE_TEMPS)
    assert check["max_abs_gap_points"] < 8.0
    assert check["ece_calibrated"] < check["ece_raw"]
    manifest = json.loads((held / "manifest.json").read_text())
    assert manifest["gpu"] == "Named GPU" and manifest["files"]["calibration_check"] == "calibration_check.json"
    assert manifest["cuda_graph_sizes"] == {"cuda_graph_max_bs": 8}

    wrong = tmp_path / "five.json"
    PositionCalibration.identity(5).save(wrong)
    calls = stub.chat_calls
    assert tune(stub, tmp_path / "w", "--concurrencies", "1", "--acceptance-requests", "2",
                "--check-calibration", str(wrong)) == 2
    assert "5 temperatures" in capsys.readouterr().err
    assert tune(stub, tmp_path / "m", "--concurrencies", "1", "--check-calibration", str(tmp_path / "none.json")) == 2
    assert stub.chat_calls == calls and "--check-calibration" in capsys.readouterr().err


@pytest.mark.parametrize("verify, kind", [("1", "plain"), ("16", "draft")])
def test_the_dspine_step_clock_is_preferred_over_sglangs_log_intervals(tmp_path, verify, kind):
    """A DSPINE server reports its worker's decode-step periods per kind (prefills excluded): the
    table comes from the kind the run measures (plain with --verify-tokens 1), not from SGLang's
    step_time_dict, which here counts three times the step time (the prefills in its intervals)."""
    stub = Stub(record=True, clock_kind=kind)
    try:
        assert tune(stub, tmp_path / "sps", "--concurrencies", "1,4", "--acceptance-requests", "0",
                    "--verify-tokens", verify) == 0
    finally:
        stub.close()
    rounds = [json.loads(line) for line in (tmp_path / "sps" / "rounds.jsonl").read_text().splitlines()]
    assert rounds and all(r["source"] == "dspine_step_clock" and r["steps"] % TOKENS == 0 for r in rounds)
    for r in rounds:
        assert r["steps_per_sec"] == pytest.approx(1 / step_seconds(r["batch_size_per_rank"]))
        assert r["batch_tokens"] == r["batch_size_per_rank"] * int(verify)


def test_clock_totals_and_deltas():
    from dspine.serve.sps_measure import clock_delta, clock_totals

    info = {"internal_states": [{"dspine_step_time_dict": {"plain": {"2": [10, 0.5]}, "draft": {}}},
                                {"dspine_step_time_dict": {"plain": {"2": [10, 0.5], "4": [1, 0.1]}}}]}
    assert clock_totals(info, "plain") == {2: (20, 1.0), 4: (1, 0.1)}
    assert clock_totals(info, "draft") == {}
    assert clock_totals({"internal_states": [{}]}, "plain") is None
    assert clock_delta({2: (20, 1.0), 3: (5, 0.2)}, {2: (26, 1.3), 3: (5, 0.2), 4: (1, 0.1)}) == \
        {2: (6, pytest.approx(0.3)), 4: (1, 0.1)}                     # batch size 3 ran no step in between


@pytest.mark.parametrize("stub", [False], indirect=True)
def test_client_timing_without_step_time_dict(stub, tmp_path, capsys):
    out = tmp_path / "sps"
    assert tune(stub, out, "--concurrencies", "1,4", "--acceptance-requests", "0") == 0
    table = load_sps_table(out / "sps_table.json")
    assert table.sample_batch_tokens == (VERIFY, 4 * VERIFY)
    for tokens, sps in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
        assert sps == pytest.approx(1 / step_seconds(tokens // VERIFY), rel=0.35)   # HTTP overhead, busy CPU
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["timing"] == {"1": "client_timing", "4": "client_timing"}
    assert any("client-side" in n for n in manifest["notes"]) and any("STS calibration skipped" in n
                                                                      for n in manifest["notes"])
    assert "client-side" in capsys.readouterr().err


def test_additive_fit_recovers_known_costs():
    rows = [{"batch_size_per_rank": bs, "batch_tokens": m, "steps_per_sec": 1 / (0.005 + 1e-4 * bs + 2e-5 * m),
             "frac": m / (bs * 16)} for bs in (4, 8, 32) for m in (64, 128, 256, 512) if m <= bs * 16]
    assert fit_additive([dict(r, frac=1.0) for r in rows]) is None                # diagonal-only: no fit
    table = fit_additive(rows)
    assert table.bs_probes == (4, 8, 32) and table.m_probes == (64, 128, 256, 512)
    first = table.bias_seconds + table.alpha_seconds[0] + table.theta_seconds[0]
    assert first == pytest.approx(0.005 + 4e-4 + 2e-5 * 64)
    assert table.theta_seconds[-1] == pytest.approx(2e-5 * (512 - 64))
    assert table.alpha_seconds[-1] == pytest.approx(1e-4 * 28)


def test_new_step_times_diff():
    assert new_step_times({1: [0.1]}, {1: [0.1, 0.2], 2: [0.3]}) == {1: [0.2], 2: [0.3]}
    assert new_step_times({1: [0.1, 0.2]}, {1: [0.4]}) == {1: [0.4]}              # reset: all new


@pytest.mark.parametrize("stub", [True], indirect=True)
def test_plain_table_writes_the_switch_file(stub, tmp_path, capsys):
    """--plain-table: a plain run's table (--verify-tokens 1) and a drafting run give switch.json with
    the drafting table, the plain table and its tokens per step, the affine calibration and the records'
    observed survival (recomputed here from acceptance.jsonl); it loads as a SwitchConfig; the printed
    command sets DSPINE_DYNAMIC. A missing plain table or a bad --plain-tokens is refused before any
    replay."""
    from dspine.dynamic.switch import SwitchConfig

    plain, drafting = tmp_path / "plain", tmp_path / "draft"
    assert tune(stub, plain, "--concurrencies", "1,4", "--acceptance-requests", "0", "--verify-tokens", "1") == 0
    probes = load_sps_table(plain / "sps_table.json").sample_batch_tokens     # batch tokens = batch size
    assert 1 in probes and set(probes) <= {1, 2, 3, 4}
    capsys.readouterr()
    assert tune(stub, drafting, "--concurrencies", "1,4", "--acceptance-requests", "8",
                "--plain-table", str(plain / "sps_table.json"), "--plain-tokens", "8") == 0
    printed = capsys.readouterr().out
    assert f"DSPINE_DYNAMIC={(drafting / 'switch.json').resolve()} sglang serve" in printed
    config = SwitchConfig.load(drafting / "switch.json")
    assert config.round_table == load_sps_table(drafting / "sps_table.json")
    assert config.plain_table == load_sps_table(plain / "sps_table.json")
    assert config.calibration == PositionCalibration.load(drafting / "sts_affine.json")
    assert config.plain_tokens == 8
    accepted = [a for line in (drafting / "acceptance.jsonl").read_text().splitlines()
                for a in json.loads(line)["dspine_accept_lens"]]
    expected = [sum(a > j for a in accepted) / len(accepted) for j in range(len(TRUE_TEMPS))]
    assert config.prior_survival == pytest.approx(expected, abs=1e-6)
    assert json.loads((drafting / "manifest.json").read_text())["files"]["switch"] == "switch.json"

    assert tune(stub, tmp_path / "k2", "--concurrencies", "1", "--acceptance-requests", "4",
                "--plain-table", str(plain / "sps_table.json"), "--plain-tokens", "2") == 0
    assert_dspine_honours(capsys.readouterr().out.strip().splitlines()[-1], switch=tmp_path / "k2" / "switch.json")

    calls = stub.chat_calls
    assert tune(stub, tmp_path / "x", "--concurrencies", "1", "--plain-table", str(tmp_path / "none.json")) == 2
    assert stub.chat_calls == calls and "--plain-table" in capsys.readouterr().err
    assert tune(stub, tmp_path / "y", "--concurrencies", "1", "--plain-table", str(plain / "sps_table.json"),
                "--plain-tokens", "0") == 2
    assert stub.chat_calls == calls and "--plain-tokens 0" in capsys.readouterr().err
