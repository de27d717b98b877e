"""dspine/sglang/flag_check.py: which resolved server arguments count as a `dspine serve` flag in
effect, and what `dspine serve` hands the worker to check (`DSPINE_SERVE_FLAGS`)."""

from __future__ import annotations

import json
import shlex

import pytest

from dspine import env
from dspine.serve import launch, presets
from dspine.sglang import flag_check


@pytest.mark.parametrize("wanted, actual, ok", [
    ([], True, True), ([], False, False), ([], 1, False),                 # a bare flag wants True, not a truthy int
    (["true"], True, True), (["false"], False, True), (["True"], False, False),
    (["16"], 16, True), (["16"], 15, False), (["0.75"], 0.75, True), (["0.75"], 0.7500000001, True),
    (["0.75"], 0.76, False), (["x"], 3, False),
    (["dspine"], "DSPINE", True), (["fa3"], "triton", False), (["bfloat16"], "bfloat16", True),
    (["none"], None, True), (["48"], None, False),
    (["1", "2"], [1, 2], True), (["1", "2"], [1], False), (["a"], ["a"], True),
])
def test_matches(wanted, actual, ok):
    assert flag_check.matches(wanted, actual) is ok


def test_a_missing_server_argument_never_matches():
    assert flag_check.matches(["1"], flag_check._MISSING) is False
    assert flag_check.matches([], flag_check._MISSING) is False


def test_effects_read_each_flag_under_its_server_argument_name():
    resolved = {"tp_size": 1, "attention_backend": "triton", "cuda_graph_max_bs_decode": 64,
                "enable_linear_replayssm_spec": True}
    effects = flag_check.flag_effects(
        {"--tp-size": ["1"], "--attention-backend": ["fa3"], "--cuda-graph-max-bs": ["64"],     # an alias spelling
         "--enable-linear-replayssm-spec": [], "--no-such-flag": ["1"]},
        lambda field: resolved.get(field, flag_check._MISSING))
    assert [(e.field, e.applied) for e in effects] == [
        ("tp_size", True), ("attention_backend", False), ("cuda_graph_max_bs_decode", True),
        ("enable_linear_replayssm_spec", True), ("no_such_flag", False)]
    assert effects[1].describe() == "--attention-backend fa3: attention_backend = 'triton'"
    assert "has no server argument no_such_flag" in effects[4].describe()


def test_unset_means_nothing_to_check():
    assert flag_check.check_served_flags(object(), environ={}) == []


def test_serve_hands_the_merged_flags_to_the_worker_without_changing_the_printed_command(tmp_path):
    cmd = launch.build_serve_command(presets.load_preset("smollm2-135m"), ["--tp-size", "1", "--port", "30001"],
                                     launcher=["sglang", "serve"], environ={})
    flags = env.DSPINE_SERVE_FLAGS.get(cmd.flags_env)          # what the worker parses
    assert flags == cmd.flags and flags["--port"] == ["30001"] and flags["--speculative-algorithm"] == ["DSPINE"]
    assert env.DSPINE_SERVE_FLAGS.name not in cmd.render()
    assert shlex.split(cmd.render().replace("\\\n", " "))[-len(cmd.argv):] == cmd.argv


def test_a_malformed_flag_map_is_named():
    for raw in ("{", '["--a"]', '{"a": ["1"]}', '{"--a": "1"}', '{"--a": [1]}'):
        with pytest.raises(env.EnvError, match="DSPINE_SERVE_FLAGS"):
            env.DSPINE_SERVE_FLAGS.get({"DSPINE_SERVE_FLAGS": raw})
    assert env.DSPINE_SERVE_FLAGS.get({"DSPINE_SERVE_FLAGS": json.dumps({"--a": []})}) == {"--a": []}


@pytest.mark.parametrize("served, dp, ok", [(32, 1, True), (40, 1, True), (28, 1, False), (16, 2, True), (15, 2, False)])
def test_running_cap_below_the_flag_is_a_failure(monkeypatch, served, dp, ok):
    from dspine.sglang import compat

    monkeypatch.setattr(compat, "dp_attention_enabled", lambda sa: dp > 1)
    monkeypatch.setattr(compat, "server_args_value", lambda sa, name, default=None: dp if name == "dp_size" else default)
    environ = {env.DSPINE_SERVE_FLAGS.name: json.dumps({"--max-running-requests": ["32"]})}
    if ok:
        flag_check.check_running_cap(object(), served, environ)
    else:
        with pytest.raises(flag_check.FlagsNotApplied, match=f"pools for {served} running requests.*--max-mamba-cache-size"):
            flag_check.check_running_cap(object(), served, environ)


def test_running_cap_unchecked_without_the_flag():
    flag_check.check_running_cap(object(), 1, {env.DSPINE_SERVE_FLAGS.name: json.dumps({"--tp-size": ["1"]})})
    flag_check.check_running_cap(object(), 1, {})
