"""`dspine.bench.launchers.PrestartedServers`: every config's server started at once on its own port
through the serve script, handed back by `start` without a second start, started again after `stop`."""

from __future__ import annotations

import argparse
from pathlib import Path

from dspine.bench.launchers import PrestartedServers, ServeShLauncher, UrlLauncher, launcher_for

FAKE_SERVE = """#!/usr/bin/env bash
# start: log "start PORT FLAGS..." (fails for flag --broken); stop: log "stop PORT"
echo "$1 $SGL_PORT ${*:2}" >> "$CALLS"
[[ " $* " == *" --broken "* ]] && exit 3
exit 0
"""


def _servers(tmp_path: Path, monkeypatch, names: list[str]) -> tuple[PrestartedServers, Path]:
    script, calls = tmp_path / "serve.sh", tmp_path / "calls.txt"
    script.write_text(FAKE_SERVE)
    monkeypatch.setenv("CALLS", str(calls))
    return PrestartedServers(script, 31000, tmp_path, names), calls


def _calls(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines()) if path.exists() else []


def test_prestart_starts_each_config_once_on_its_own_port(tmp_path, monkeypatch):
    servers, calls = _servers(tmp_path, monkeypatch, ["AR", "NGRAM", "DSPINE"])
    flags = {"AR": ["--a"], "NGRAM": ["--n"], "DSPINE": ["--d"]}
    assert servers.prestart(flags) == []
    assert _calls(calls) == ["start 31000 --a", "start 31001 --n", "start 31002 --d"]
    assert servers.start("NGRAM", flags["NGRAM"]) == "http://127.0.0.1:31001"
    assert len(_calls(calls)) == 3                       # handed back, not started again
    servers.stop("NGRAM")
    assert servers.start("NGRAM", flags["NGRAM"]) == "http://127.0.0.1:31001"
    assert _calls(calls).count("start 31001 --n") == 2 and _calls(calls).count("stop 31001 ") == 1


def test_a_server_that_fails_to_start_is_reported_and_tried_again(tmp_path, monkeypatch):
    servers, calls = _servers(tmp_path, monkeypatch, ["AR", "DSPINE"])
    errors = servers.prestart({"AR": ["--a"], "DSPINE": ["--broken"]})
    assert len(errors) == 1 and errors[0].startswith("DSPINE:") and "exit 3" in errors[0]
    assert servers.running == {"AR"}
    servers.start("DSPINE", ["--d"])                      # start tries it again, with the flags given now
    assert "start 31001 --d" in _calls(calls) and servers.running == {"AR", "DSPINE"}


def test_launcher_for_picks_prestarted_servers_only_when_asked(tmp_path):
    args = argparse.Namespace(url=[], serve_script=tmp_path / "s.sh", port=30000, out_dir=tmp_path,
                              configs=["AR", "DSPINE"], parallel_start=True)
    assert isinstance(launcher_for(args), PrestartedServers)
    args.parallel_start = False
    assert isinstance(launcher_for(args), ServeShLauncher)
    args.url = ["http://127.0.0.1:1"]
    assert isinstance(launcher_for(args), UrlLauncher)
