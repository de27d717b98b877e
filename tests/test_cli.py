"""The `dspine` command: `--help` lists every subcommand without importing torch or transformers,
and each subcommand's parser builds."""

from __future__ import annotations

import json
import subprocess
import sys

SUBCOMMANDS = ("generate", "info", "serve", "tune-sps", "train", "gen-data", "bench-accept")

_HELP_PROBE = """
import contextlib, io, json, sys
from dspine.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
heavy = sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules)
print(json.dumps({"help": out.getvalue(), "code": code, "heavy": heavy}))
"""


def _help(*argv: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _HELP_PROBE, *argv], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_help_lists_every_subcommand_without_heavy_imports():
    report = _help("--help")
    assert report["code"] == 0
    listed = {line.split()[0] for line in report["help"].splitlines() if line.startswith("    ") and line.split()}
    assert set(SUBCOMMANDS) <= listed, report["help"]
    assert report["heavy"] == []


def test_train_help_stays_light_and_names_the_packaged_configs():
    report = _help("train", "--help")
    assert report["code"] == 0 and report["heavy"] == []
    assert "smollm2-dspine" in report["help"] and "--target" in report["help"] and "--set" in report["help"]
    for command in ("gen-data", "bench-accept"):
        sub = _help(command, "--help")
        assert sub["code"] == 0 and "--data-dir" in sub["help"] and "--prompts-dir" in sub["help"]


def test_a_subcommand_module_that_fails_to_import_is_an_error(monkeypatch):
    import pytest

    from dspine import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "dspine.no_such_module"))
    with pytest.raises(ModuleNotFoundError, match="dspine.no_such_module"):
        cli.build_parser()


def test_generate_names_its_drafter_on_stderr(capsys):
    from dspine.cli import main

    assert main(["generate", "--drafter", "none", "--max-new-tokens", "2", "-p", "Hi", "--json", "-q"]) == 0
    captured = capsys.readouterr()
    assert "dspine generate: drafter none\n" in captured.err
    assert json.loads(captured.out)["drafter"] == "none"
