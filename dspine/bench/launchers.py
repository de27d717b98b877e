"""Where a benchmark's servers come from: already running (`--url`), or started and stopped one at a
time by a serve script (the GPU host's `.gpu/host/serve.sh`); and the command-line options the
serving benchmarks share (`add_server_arguments`).

Every launcher has `start(name, flags, env) -> base URL` and `stop(name)`. `flags` are the SGLang
flags of config `name`; `env` holds the variables its server needs beyond the benchmark's own
environment (e.g. `DSPINE_DYNAMIC`), given to the serve script's process only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dspine.bench.results import DEFAULT_OUT_DIR, BenchError
from dspine.model.checkpoint import default_drafter_dir

DEFAULT_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


def parse_urls(values: list[str]) -> dict[str, str]:
    """`--url` values -> {config name: URL}; a bare URL (no `NAME=` before its scheme) is key "*"."""
    return dict(v.split("=", 1) if "=" in v.split("://")[0] else ("*", v) for v in values)


class UrlLauncher:
    """Servers already running: `urls` maps a config name to its base URL (key "*" = any)."""

    def __init__(self, urls: dict[str, str]):
        self.urls = urls

    def serves(self, name: str) -> bool:
        return name in self.urls or "*" in self.urls

    def start(self, name: str, flags: list[str], env: dict[str, str] | None = None) -> str:
        url = self.urls.get(name) or self.urls.get("*")
        if not url:
            raise BenchError(f"no --url for config {name}")
        return url.rstrip("/")

    def stop(self, name: str) -> None:
        """Nothing to stop: the server belongs to whoever started it."""


class ServeShLauncher:
    """`bash SCRIPT start FLAGS...` / `bash SCRIPT stop` with `SGL_PORT` (the GPU host's serve.sh adds
    its base flags and waits for /health); the server log goes to `log_dir/sglang-NAME.log`."""

    def __init__(self, script: Path, port: int, log_dir: Path):
        self.script, self.port, self.log_dir = script, port, log_dir

    def _env(self, name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The serve script's environment: this process's, plus `extra`, the port and the log path."""
        return {**os.environ, **(extra or {}), "SGL_PORT": str(self.port),
                "SGL_LOG": str(self.log_dir / f"sglang-{name}.log")}

    def start(self, name: str, flags: list[str], env: dict[str, str] | None = None) -> str:
        shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        print(f"[{name}] starting: {shown + ' ' if shown else ''}bash {self.script} start {shlex.join(flags)}",
              flush=True)
        done = subprocess.run(["bash", str(self.script), "start", *flags], env=self._env(name, env))
        if done.returncode:
            raise BenchError(f"{self.script} start failed for {name} (exit {done.returncode}); see the log above")
        return f"http://127.0.0.1:{self.port}"

    def stop(self, name: str) -> None:
        subprocess.run(["bash", str(self.script), "stop"], env=self._env(name))


class PrestartedServers:
    """serve.sh servers of every config started at once, config i on port `port + i`, before the
    first is measured: one wait for start-up (compilation, CUDA-graph capture) instead of one per
    config. `start(name)` hands back the running server the first time (a later start, e.g. NGRAM's
    restart, starts it again); `stop(name)` stops it. The servers share the GPU but only the measured
    one has requests, so the others sit idle (give each a `--mem-fraction-static` share)."""

    def __init__(self, script: Path, port: int, log_dir: Path, names: list[str]):
        self.servers = {name: ServeShLauncher(script, port + i, log_dir) for i, name in enumerate(names)}
        self.running: set[str] = set()

    def prestart(self, configs: dict[str, list[str]], envs: dict[str, dict[str, str]] | None = None) -> list[str]:
        """Start every config's server concurrently; returns the errors of those that failed to
        start (their names stay not running; `start` tries them again)."""
        def one(name: str) -> str | None:
            try:
                self.servers[name].start(name, configs[name], (envs or {}).get(name))
            except BenchError as e:
                return f"{name}: {e}"
            self.running.add(name)
            return None

        with ThreadPoolExecutor(max_workers=len(configs) or 1) as pool:
            return [e for e in pool.map(one, list(configs)) if e]

    def start(self, name: str, flags: list[str], env: dict[str, str] | None = None) -> str:
        server = self.servers[name]
        if name not in self.running:
            server.start(name, flags, env)
            self.running.add(name)
        return f"http://127.0.0.1:{server.port}"

    def stop(self, name: str) -> None:
        self.servers[name].stop(name)
        self.running.discard(name)


def launcher_for(args: argparse.Namespace) -> UrlLauncher | ServeShLauncher | PrestartedServers:
    """Every config from `--url` when any is given (a config without one fails), else serve.sh: one
    server at a time, or all at once on consecutive ports with `--parallel-start`."""
    if args.url:
        return UrlLauncher(parse_urls(args.url))
    if getattr(args, "parallel_start", False):
        return PrestartedServers(args.serve_script, args.port, args.out_dir, list(args.configs))
    return ServeShLauncher(args.serve_script, args.port, args.out_dir)


class ConfigLaunchers:
    """`--url NAME=URL` servers for the configs it names (a bare `--url URL` serves all), serve.sh
    starts for the others: one run can mix a server prepared beforehand with servers it starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.urls = UrlLauncher(parse_urls(args.url)) if args.url else None
        self.serve = ServeShLauncher(args.serve_script, args.port, args.out_dir)

    def _for(self, name: str) -> UrlLauncher | ServeShLauncher:
        return self.urls if self.urls is not None and self.urls.serves(name) else self.serve

    def start(self, name: str, flags: list[str], env: dict[str, str] | None = None) -> str:
        return self._for(name).start(name, flags, env)

    def stop(self, name: str) -> None:
        self._for(name).stop(name)


def add_server_arguments(p: argparse.ArgumentParser, *, configs: tuple[str, ...], default_configs: tuple[str, ...],
                         extra_flags: str, url_help: str) -> None:
    """Options of every serving benchmark: which server configs, the target and drafter, the SGLang
    flags every server gets, where the servers come from, the request timeout and the results folder."""
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(default_configs),
                   help="comma-separated subset of " + ",".join(configs))
    p.add_argument("--model-path", default=DEFAULT_TARGET, help="the target (default: %(default)s)")
    p.add_argument("--draft", default=None, help="the DSPINE drafter (default: the drafter in the package)")
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--extra-flags", default=extra_flags,
                   help="SGLang flags added to every config (serve.sh adds its base flags itself)")
    p.add_argument("--served-model", default="default", help="the `model` field of requests")
    p.add_argument("--url", action="append", default=[], help=url_help)
    p.add_argument("--serve-script", type=Path, default=Path(".gpu/host/serve.sh"))
    p.add_argument("--port", type=int, default=30000, help="SGL_PORT for --serve-script")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--device", default=None,
                   help="the servers' GPU, for the results (default: detected, `detect_device`)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="results folder (default: %(default)s)")


def check_server_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, configs: tuple[str, ...]) -> None:
    """Refuse unknown configs; resolve the default drafter (the one in the package)."""
    unknown = set(args.configs) - set(configs)
    if unknown:
        p.error(f"unknown config(s) {sorted(unknown)}; choose from {configs}")
    if args.draft is None:
        args.draft = str(default_drafter_dir())


def detect_device(info: dict) -> str:
    """The GPU name(s) from nvidia-smi, else a device field of the server's /server_info, else "unknown"."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
        names = sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})
    except (OSError, subprocess.SubprocessError):
        names = []
    if names:
        return " + ".join(names)
    return next((str(info[k]) for k in ("gpu_name", "device_name", "device") if info.get(k)), "unknown")
