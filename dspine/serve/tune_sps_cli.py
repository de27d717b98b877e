"""The `dspine tune-sps` command line: its options and entry points (no torch import, so
`dspine --help` stays fast). The sweep itself is `dspine.serve.tune_sps`."""

from __future__ import annotations

import argparse
import sys

DEFAULT_CONCURRENCIES = (1, 4, 16, 64)
DESCRIPTION = "`dspine tune-sps`: measure a deployment's SPS table (and STS calibration) on the user's traces."


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 1,4,16,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 1,4,16,64")
    return sorted(set(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--url", help="a running OpenAI-compatible DSPINE server, e.g. http://127.0.0.1:30000")
    server.add_argument("--preset", help="start one with `dspine serve --preset NAME` (other flags after the "
                                         "options go to sglang) and stop it afterwards")
    parser.add_argument("--traces", nargs="+", required=True, help="OpenAI-request JSONL / ShareGPT JSON(L) files")
    parser.add_argument("--out", required=True, help="output directory (resumable)")
    parser.add_argument("--split", default="tune", choices=["tune", "heldout", "all"],
                        help="which hash split of the traces to replay (default: tune)")
    parser.add_argument("--concurrencies", type=_concurrencies, default=list(DEFAULT_CONCURRENCIES),
                        help="comma-separated concurrency levels (default: 1,4,16,64)")
    parser.add_argument("--requests-per-level", type=int, default=0, help="default: max(16, 4 x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on each request's max_tokens")
    parser.add_argument("--verify-tokens", type=int, default=None,
                        help="verify tokens per request per step (default: speculative_num_draft_tokens)")
    parser.add_argument("--model", default=None, help="model name for requests (default: from /server_info)")
    parser.add_argument("--acceptance-requests", type=int, default=32,
                        help="/generate calls for acceptance records (0 = skip calibration)")
    parser.add_argument("--check-calibration", metavar="FILE", default=None,
                        help="check a calibration fitted on another split (e.g. the tune run's sts_affine.json) on "
                             "this run's acceptance records, e.g. with --split heldout: writes calibration_check.json")
    parser.add_argument("--plain-table", metavar="FILE", default=None,
                        help="the sps_table.json of a run (--verify-tokens 1) against this deployment started with "
                             'a forced plain switch file (DSPINE_DYNAMIC=FILE holding {"force": "plain", '
                             '"plain_tokens": K}): also write switch.json for DSPINE_DYNAMIC (the per-step '
                             "draft-or-plain switch)")
    parser.add_argument("--plain-tokens", type=int, default=1, metavar="K",
                        help="target tokens per plain step: the plain_tokens of the forced plain switch file the "
                             "--plain-table server ran with (default 1); written into switch.json")
    parser.add_argument("--gpu", default=None, help="GPU name for the manifest (SGLang's /server_info has none)")
    parser.add_argument("--level-timeout", type=float, default=600.0, help="seconds per level before stopping")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=1200.0, help="--preset: seconds to wait for it")
    parser.add_argument("--restart", action="store_true", help="redo every level (ignore recorded rounds)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _run(args: argparse.Namespace, serve_args: list[str]) -> int:
    from dspine.serve.tune_sps import run

    return run(args, serve_args)


def add_command(subparsers) -> None:
    """`dspine tune-sps` in `dspine.cli` (unknown arguments go to sglang with --preset)."""
    parser = subparsers.add_parser("tune-sps", help="measure an SPS table (and STS calibration) on your traces",
                                   description=DESCRIPTION, allow_abbrev=False)
    add_arguments(parser)
    parser.set_defaults(func=lambda args: _run(args, args.extra), accepts_extra=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tune_sps", description=DESCRIPTION, allow_abbrev=False)
    add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    return _run(args, extra)


if __name__ == "__main__":
    sys.exit(main())
