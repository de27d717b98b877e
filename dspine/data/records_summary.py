"""What gen-data record files hold: records, answer turns, tokens, answer tokens, length percentiles
and long records, per file. The figures of a campaign range's `data` entry in
`benchmarks/results/campaign_smollm2.json` (`scripts/gpu_campaign_data.sh` writes them beside the
records as `summary.json`).

    python -m dspine.data.records_summary records/greedy.jsonl records/sampled.jsonl [--out summary.json]

A record's answer is its `answer_spans` (multi-turn) or runs from `answer_start` to its end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LONG_RECORD = 2048   # tokens: a record at least this long is counted in `records_at_least_2048_tokens`


def answer_spans(record: dict) -> list[tuple[int, int]]:
    """[start, end) spans of the target's answers in `record["ids"]`."""
    spans = record.get("answer_spans") or [[record["answer_start"], len(record["ids"])]]
    return [(int(a), int(b)) for a, b in spans]


def summarize(path: Path) -> dict:
    """One file's figures (module docstring); a line that is not a record stops with its number."""
    lengths, turns, answers = [], 0, 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                spans = answer_spans(record)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a gen-data record ({exc})") from exc
            lengths.append(len(record["ids"]))
            turns += len(spans)
            answers += sum(b - a for a, b in spans)
    lengths.sort()
    n = len(lengths)
    return {"records": n, "answer_turns": turns, "tokens": sum(lengths), "answer_tokens": answers,
            "median_tokens": lengths[n // 2] if n else 0, "p90_tokens": lengths[int(0.9 * n)] if n else 0,
            f"records_at_least_{LONG_RECORD}_tokens": sum(length >= LONG_RECORD for length in lengths)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspine.data.records_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="gen-data JSONL files (e.g. records/greedy.jsonl)")
    p.add_argument("--out", type=Path, help="also write the summary here (JSON)")
    args = p.parse_args(argv)
    try:
        summary = {path.stem: summarize(path) for path in args.files}
    except (OSError, ValueError) as exc:
        print(f"records_summary: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
