"""`dspine serve` presets: loading, merging (user flags win), validation before launch, the command.

Pure Python: no SGLang needed (the same rules run inside SGLang in tests/sglang/).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from dspine.dynamic.switch import write_forced_switch, write_switch_file
from dspine.serve import launch, presets as sp
from dspine.serve.flags import read_draft_block_size

LAUNCHER = ["sglang", "serve"]


def make_draft(tmp_path: Path, block_size: int | None = 16, where: str = "dspine_config") -> str:
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    config = {"architectures": ["DSpineDraftModel"], "model_type": "qwen3"}
    if block_size is not None:
        if where == "top":
            config["block_size"] = block_size
        else:
            config[where] = {"block_size": block_size}
    (draft / "config.json").write_text(json.dumps(config))
    return str(draft)


def command(preset: str, *user: str, environ: dict | None = None) -> launch.ServeCommand:
    return launch.build_serve_command(sp.load_preset(preset), list(user), launcher=LAUNCHER, environ=environ or {})


def value(cmd: launch.ServeCommand, flag: str) -> str | None:
    args = cmd.args
    return args[args.index(flag) + 1] if flag in args else None


# --- the shipped presets ----------------------------------------------------------------------

def test_shipped_presets_are_listed_and_load():
    assert {"qwen3-8b", "qwen3.8-27b", "smollm2-135m"} <= set(sp.available_presets())
    for name in ("qwen3-8b", "qwen3.8-27b", "smollm2-135m"):
        preset = sp.load_preset(name)
        assert preset.flags["--speculative-algorithm"] == ["DSPINE"]
        assert preset.flags["--speculative-num-draft-tokens"] == ["16"]
        assert preset.model


def test_27b_preset_carries_replayssm_and_static_verify():
    preset = sp.load_preset("qwen3.8-27b")
    assert preset.flags["--enable-linear-replayssm-spec"] == []  # a bare switch
    assert preset.flags["--linear-replayssm-cache-len"] == ["32"]
    assert preset.flags["--mamba-ssm-dtype"] == ["float32"]
    assert preset.flags["--speculative-draft-window-size"] == ["8192"]
    assert preset.env == {"SGLANG_RAGGED_VERIFY_MODE": "static"}


def test_smollm2_draft_resolves_to_the_repo_checkpoint_dir():
    preset = sp.load_preset("smollm2-135m")
    package = Path(sp.__file__).resolve().parents[1]
    assert preset.draft_model == str(package / "checkpoints" / "dspine-smollm2-135m-instruct")
    assert preset.flags["--attention-backend"] == ["triton"]
    assert preset.flags["--sampling-backend"] == ["pytorch"]
    assert preset.flags["--speculative-draft-attention-backend"] == ["triton"]


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3.8-27b", "smollm2-135m"])
def test_every_preset_validates_with_a_real_draft(tmp_path, name):
    cmd = command(name, "--speculative-draft-model-path", make_draft(tmp_path))
    assert cmd.errors == []
    assert cmd.launcher == LAUNCHER


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3.8-27b"])
def test_placeholder_draft_is_refused(name):
    cmd = command(name)
    assert len(cmd.errors) == 1
    assert "--speculative-draft-model-path" in cmd.errors[0] and "placeholder" in cmd.errors[0]


# --- merging ----------------------------------------------------------------------------------

def test_user_flags_win_in_place_and_new_flags_append(tmp_path):
    draft = make_draft(tmp_path)
    cmd = command("qwen3-8b", "--speculative-draft-model-path", draft, "--mem-fraction-static=0.5",
                  "--cuda-graph-bs", "1", "2", "4", "--enable-metrics")
    args = cmd.args
    assert value(cmd, "--mem-fraction-static") == "0.5" and "0.75" not in args  # `--flag=value` works too
    assert args.index("--mem-fraction-static") < args.index("--max-running-requests")  # the preset's slot
    assert args[-5:] == ["--cuda-graph-bs", "1", "2", "4", "--enable-metrics"]
    assert value(cmd, "--speculative-draft-model-path") == draft
    assert args.count("--speculative-draft-model-path") == 1


def test_alias_spellings_replace_the_preset_flag(tmp_path):
    cmd = command("qwen3-8b", "--model", "/models/q8", "--speculative-draft-model-path", make_draft(tmp_path))
    assert "--model-path" not in cmd.args
    assert value(cmd, "--model") == "/models/q8"


def test_parse_sglang_flags():
    assert launch.parse_sglang_flags(["--a", "1", "--b", "--c=x", "--d", "1", "-2", "--", "--a", "3"]) == {
        "--b": [], "--c": ["x"], "--d": ["1", "-2"], "--a": ["3"]}
    with pytest.raises(sp.PresetError, match="unexpected argument 'stray'"):
        launch.parse_sglang_flags(["stray"])


def test_render_is_the_exact_shell_command(tmp_path):
    cmd = command("qwen3.8-27b", "--speculative-draft-model-path", make_draft(tmp_path), "--served-model-name",
                  "my model")
    text = cmd.render()
    assert text.startswith("SGLANG_RAGGED_VERIFY_MODE=static sglang serve \\\n    --model-path Qwen/Qwen3.8-27B")
    assert shlex.split(text.replace("\\\n", " ")) == ["SGLANG_RAGGED_VERIFY_MODE=static"] + cmd.argv


def test_environment_already_set_wins_over_the_preset_env(tmp_path):
    draft = make_draft(tmp_path)
    cmd = command("qwen3.8-27b", "--speculative-draft-model-path", draft,
                  environ={"SGLANG_RAGGED_VERIFY_MODE": "compact"})
    assert cmd.env == {"SGLANG_RAGGED_VERIFY_MODE": "compact"}
    assert any("SGLANG_RAGGED_VERIFY_MODE=compact" in e and "static" in e for e in cmd.errors)


# --- validation before launch ------------------------------------------------------------------

def test_block_size_mismatch_names_flag_and_fix(tmp_path):
    cmd = command("qwen3-8b", "--speculative-draft-model-path", make_draft(tmp_path, block_size=8))
    assert len(cmd.errors) == 1
    assert "--speculative-num-draft-tokens 16 differs from the draft checkpoint's block size 8" in cmd.errors[0]
    assert "set it to 8" in cmd.errors[0]


def test_num_draft_tokens_defaults_to_the_checkpoint(tmp_path):
    preset = sp.load_preset("qwen3-8b")
    del preset.flags["--speculative-num-draft-tokens"]
    cmd = launch.build_serve_command(preset, ["--speculative-draft-model-path", make_draft(tmp_path, block_size=8),
                                          "--speculative-draft-window-size", "4"], LAUNCHER, {})
    assert cmd.errors == ["--speculative-draft-window-size 4 is smaller than the verify block "
                          "(--speculative-num-draft-tokens 8): the draft could not see its own block. "
                          "Fix: set it to >= 8 (the 27B preset uses 8192), or drop it."]


@pytest.mark.parametrize("cache_len, ok", [("16", False), ("24", False), ("48", False), ("32", True), ("64", True)])
def test_replayssm_ring_must_be_a_power_of_two_at_least_twice_the_verify_width(tmp_path, cache_len, ok):
    cmd = command("qwen3.8-27b", "--speculative-draft-model-path", make_draft(tmp_path),
                  "--linear-replayssm-cache-len", cache_len)
    if ok:
        assert cmd.errors == []
    else:
        assert cmd.errors == [f"--linear-replayssm-cache-len {cache_len} with --enable-linear-replayssm-spec: the "
                              "ring must be a power of two >= 2 x the verify width (2 x 16 = 32). "
                              "Fix: --linear-replayssm-cache-len 32."]


def test_replayssm_default_ring_is_too_short_for_16(tmp_path):
    preset = sp.load_preset("qwen3.8-27b")
    del preset.flags["--linear-replayssm-cache-len"]
    cmd = launch.build_serve_command(preset, ["--speculative-draft-model-path", make_draft(tmp_path)], LAUNCHER, {})
    assert len(cmd.errors) == 1 and "--linear-replayssm-cache-len 16 (the default)" in cmd.errors[0]


def test_replayssm_needs_static_verify(tmp_path):
    cmd = command("qwen3-8b", "--speculative-draft-model-path", make_draft(tmp_path),
                  "--enable-linear-replayssm-spec", "--linear-replayssm-cache-len", "32",
                  environ={"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"})
    assert len(cmd.errors) == 1
    assert cmd.errors[0].startswith("SGLANG_RAGGED_VERIFY_MODE=cap-accept with --enable-linear-replayssm-spec")
    assert "Fix: unset SGLANG_RAGGED_VERIFY_MODE or set it to static." in cmd.errors[0]


def test_the_speculation_switch_is_checked_before_launch(tmp_path):
    """The switch file DSPINE_DYNAMIC names: the same rules the worker applies, named before anything
    starts (a missing or malformed file, a hybrid target whose prefix cache snapshots decode states, plain
    steps longer than a block)."""
    draft = make_draft(tmp_path)
    for name, steps in (("round.json", [16, 64]), ("plain.json", [1, 4])):
        (tmp_path / name).write_text(json.dumps({"sample_batch_tokens": steps, "sample_steps_per_sec": [100.0, 50.0],
                                                 "max_batch_tokens": steps[-1]}))
    switch = tmp_path / "switch.json"
    write_switch_file(switch, round_table="round.json", plain_table="plain.json", calibration=None,
                      prior_survival=[0.5] * 15)
    assert command("qwen3-8b", "--speculative-draft-model-path", draft, environ={"DSPINE_DYNAMIC": str(switch)}).errors == []
    missing = command("qwen3-8b", "--speculative-draft-model-path", draft,
                      environ={"DSPINE_DYNAMIC": str(tmp_path / "none.json")})
    assert len(missing.errors) == 1 and "no such file" in missing.errors[0]
    malformed = tmp_path / "malformed.json"
    malformed.write_text(json.dumps({"force": "plain", "round_table": "round.json"}))
    bad = command("qwen3-8b", "--speculative-draft-model-path", draft, environ={"DSPINE_DYNAMIC": str(malformed)})
    assert len(bad.errors) == 1 and "unknown field(s) ['round_table'] in a forced switch file" in bad.errors[0]
    plain1, plain8 = tmp_path / "plain1.json", tmp_path / "plain8.json"
    write_forced_switch(plain1, "plain")
    write_forced_switch(plain8, "plain", plain_tokens=8)
    hybrid = command("qwen3.8-27b", "--speculative-draft-model-path", draft, environ={"DSPINE_DYNAMIC": str(plain1)})
    assert len(hybrid.errors) == 1 and "Fix: add --disable-radix-cache" in hybrid.errors[0]
    for no_snapshots in (["--mamba-radix-cache-strategy", "no_buffer"], ["--disable-radix-cache"]):
        assert command("qwen3.8-27b", "--speculative-draft-model-path", draft, *no_snapshots,
                       environ={"DSPINE_DYNAMIC": str(plain1)}).errors == []
    assert command("qwen3.8-27b", "--speculative-draft-model-path", draft, "--mamba-radix-cache-strategy",
                   "extra_buffer", environ={"DSPINE_DYNAMIC": str(plain1)}).errors == hybrid.errors
    assert command("qwen3-8b", "--speculative-draft-model-path", draft, environ={"DSPINE_DYNAMIC": str(plain8)}).errors == []
    (tmp_path / "b4").mkdir()
    long = command("qwen3-8b", "--speculative-draft-model-path", make_draft(tmp_path / "b4", block_size=4),
                   "--speculative-num-draft-tokens", "4", environ={"DSPINE_DYNAMIC": str(plain8)})
    assert long.errors == ["DSPINE_DYNAMIC: the switch file's plain_tokens=8 exceeds --speculative-num-draft-tokens 4: "
                           "SGLang reserves one block of KV slots per request and step. Fix: a switch file with "
                           "plain_tokens 4 or less"]


@pytest.mark.parametrize("flags, needle", [
    (["--pp-size", "2"], "--pp-size 2"),
    (["--enable-dp-attention"], "--enable-dp-attention"),
    (["--attn-dp-size", "2"], "--enable-dp-attention"),
    (["--speculative-eagle-topk", "4"], "--speculative-eagle-topk 4"),
    (["--speculative-num-steps", "3"], "--speculative-num-steps 3"),
    (["--speculative-dflash-block-size", "8"], "--speculative-dflash-block-size 8"),
    (["--speculative-num-draft-tokens", "many"], "expected an integer"),
])
def test_unsupported_combinations_are_named(tmp_path, flags, needle):
    cmd = command("qwen3-8b", "--speculative-draft-model-path", make_draft(tmp_path), *flags)
    assert cmd.errors and any(needle in e and ("Fix:" in e or "integer" in e) for e in cmd.errors), cmd.errors


def test_every_problem_is_reported_at_once(tmp_path):
    cmd = command("qwen3.8-27b", "--speculative-draft-model-path", make_draft(tmp_path),
                  "--pp-size", "2", "--linear-replayssm-cache-len", "16", "--speculative-draft-window-size", "8")
    assert len(cmd.errors) == 3


def test_missing_local_draft_dir_and_hub_ids(tmp_path):
    cmd = command("qwen3-8b", "--speculative-draft-model-path", str(tmp_path / "nope"))
    assert cmd.errors == [f"--speculative-draft-model-path {tmp_path / 'nope'}: no such directory. Fix: train "
                          "or download the DSpine checkpoint there, or pass --speculative-draft-model-path with "
                          "the right path."]
    hub = command("qwen3-8b", "--speculative-draft-model-path", "some-org/dspine-qwen3-8b")
    assert hub.errors == [] and any("hub id" in n for n in hub.notes)


def test_other_algorithms_skip_dspine_checks():
    cmd = command("qwen3-8b", "--speculative-algorithm", "EAGLE3", "--pp-size", "2")
    assert cmd.errors == [] and "DSPINE checks skipped" in cmd.notes[0]


def test_read_draft_block_size_sources(tmp_path):
    assert read_draft_block_size(make_draft(tmp_path, 12))[0] == 12
    assert read_draft_block_size(make_draft(tmp_path, 10, where="dflash_config"))[0] == 10
    assert read_draft_block_size(make_draft(tmp_path, 9, where="top"))[0] == 9
    assert read_draft_block_size(make_draft(tmp_path, None)) == (None, f"{tmp_path / 'draft' / 'config.json'} "
                                                                       "has no dspine_config.block_size")
    with pytest.raises(ValueError, match="block size must be an integer >= 2"):
        read_draft_block_size(make_draft(tmp_path, 1))


# --- preset files ------------------------------------------------------------------------------

def write(tmp_path: Path, text: str, name: str = "mine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_presets_dir_override(tmp_path, monkeypatch):
    write(tmp_path, "model: m\n", name="tiny.yaml")
    monkeypatch.setenv("DSPINE_PRESETS_DIR", str(tmp_path))
    assert {"tiny", "smollm2-135m"} <= set(sp.available_presets()) and sp.load_preset("tiny").model == "m"


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(sp.PresetError) as e:
        sp.load_preset("qwen9")
    assert "unknown preset 'qwen9'; available: " in str(e.value)
    for name in ("qwen3-8b", "qwen3.8-27b", "smollm2-135m"):
        assert name in str(e.value)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "model: x\nflags:\n  --a: 1\n  --b: [1, 2\n")
    with pytest.raises(sp.PresetError, match=rf"^{path}:5: malformed YAML"):
        sp.load_preset(path)


@pytest.mark.parametrize("text, match", [
    ("model: x\nflag:\n  --a: 1\n", r":2: unknown key 'flag'"),
    ("flags: {}\n", r"`model`"),
    ("model: x\nflags:\n  --a: 1\n  speculative-algorithm: DSPINE\n", r":4: flags key 'speculative-algorithm' must"),
    ("model: x\nflags:\n  --a: 1\n  --a: 2\n", r":4: flags key '--a' appears twice"),
    ("model: x\nflags:\n  --model-path: y\n", r":3: --model-path belongs in the `model:`"),
    ("- a\n- b\n", r"a preset is a mapping"),
])
def test_structural_errors_name_the_line(tmp_path, text, match):
    with pytest.raises(sp.PresetError, match=match):
        sp.load_preset(write(tmp_path, text))


def test_own_preset_file_with_relative_draft_and_flag_values(tmp_path):
    make_draft(tmp_path)
    path = write(tmp_path, "model: m\ndraft_model: draft\nflags:\n  --speculative-algorithm: DSPINE\n"
                           "  --enable-metrics: true\n  --disable-radix-cache: false\n  --cuda-graph-bs: [1, 2]\n"
                           "  --json-model-override-args: {a: 1}\nenv:\n  X: 1\n")
    preset = sp.load_preset(path)
    assert preset.draft_model == str(tmp_path / "draft")
    assert preset.flags == {"--speculative-algorithm": ["DSPINE"], "--enable-metrics": [],
                            "--cuda-graph-bs": ["1", "2"], "--json-model-override-args": ['{"a": 1}']}
    assert preset.env == {"X": "1"}
    assert launch.build_serve_command(preset, [], LAUNCHER, {}).errors == []


# --- the CLI entry points ----------------------------------------------------------------------

def parse(*argv: str):
    parser = argparse.ArgumentParser()
    launch.add_serve_arguments(parser)
    return parser.parse_known_args(list(argv))


def test_dry_run_prints_the_command_and_exits_0(tmp_path, capsys):
    args, extra = parse("--preset", "qwen3-8b", "--dry-run", "--speculative-draft-model-path", make_draft(tmp_path),
                        "--port", "31000")
    assert extra[-2:] == ["--port", "31000"]
    assert launch.run_serve(args, extra) == 0
    out = capsys.readouterr().out
    assert "--speculative-algorithm DSPINE" in out and "--port 31000" in out


def test_invalid_combination_exits_2_without_launching(capsys):
    args, extra = parse("--preset", "qwen3-8b")  # placeholder draft, and no --dry-run: must not exec
    assert launch.run_serve(args, extra) == 2
    assert "nothing launched" in capsys.readouterr().err


def test_unknown_preset_exits_2(capsys):
    args, extra = parse("--preset", "nope", "--dry-run")
    assert launch.run_serve(args, extra) == 2
    assert "available:" in capsys.readouterr().err


def test_list_presets(capsys):
    args, extra = parse("--list-presets")
    assert launch.run_serve(args, extra) == 0
    assert capsys.readouterr().out.split() == sp.available_presets()


def test_launch_refuses_without_sglang(tmp_path, monkeypatch, capsys):
    def version(name):
        raise launch.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(launch.importlib.metadata, "version", version)
    monkeypatch.setattr(launch.os, "execve", lambda *a: pytest.fail("must not exec"))
    args, extra = parse("--preset", "qwen3-8b", "--speculative-draft-model-path", make_draft(tmp_path))
    assert launch.run_serve(args, extra) == 1
    assert "sglang is not installed in this Python" in capsys.readouterr().err


def test_launch_refuses_without_the_plugin_entry_point(monkeypatch):
    monkeypatch.setattr(launch.importlib.metadata, "version", lambda name: "0.5.22")
    monkeypatch.setattr(launch.importlib.metadata, "entry_points", lambda group: [])
    message = launch.check_sglang_installed()
    assert "entry point sglang.srt.plugins: dspine = dspine.sglang.plugin:register is missing" in message
    assert launch.check_sglang_installed(needs_plugin=False) is None


def test_launch_execs_the_printed_command(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "check_sglang_installed", lambda needs_plugin=True: None)
    monkeypatch.setattr(launch, "sglang_launcher", lambda: ["/opt/bin/sglang", "serve"])
    monkeypatch.setattr(launch.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    args, extra = parse("--preset", "qwen3.8-27b", "--speculative-draft-model-path", make_draft(tmp_path))
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    launch.run_serve(args, extra)
    (path, argv, env), = calls
    assert path == "/opt/bin/sglang" and argv[:4] == ["/opt/bin/sglang", "serve", "--model-path", "Qwen/Qwen3.8-27B"]
    assert env["SGLANG_RAGGED_VERIFY_MODE"] == "static"


def test_dspine_cli_serve_subcommand(tmp_path, capsys):
    from dspine import cli

    draft = make_draft(tmp_path)
    assert cli.main(["serve", "--preset", "qwen3-8b", "--dry-run", "--speculative-draft-model-path", draft,
                     "--port", "31000"]) == 0
    out = capsys.readouterr().out
    assert f"--speculative-draft-model-path {draft}" in out and "--port 31000" in out
