"""Every committed benchmark result says how it was made: valid JSON with command, device and date,
listed in benchmarks/results/README.md (where how each figure was obtained is written down); the
README and docs/ describe the product and leave run narratives to that file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS = sorted(RESULTS_DIR.glob("*.json"))
PRODUCT_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# "session 8", "this session", "Session 10 (...)": how a figure was obtained belongs beside it.
SESSION_NARRATIVE = re.compile(r"\bsessions? \d+\b|\bthis session\b|\bprevious session\b", re.IGNORECASE)


def test_there_are_results():
    assert RESULTS


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_records_command_device_and_date(path):
    data = json.loads(path.read_text())
    missing = [k for k in ("command", "device", "date") if not data.get(k)]
    assert not missing, f"{path.name} lacks {missing}: write them where the benchmark writes the file"


def listed_in_results_readme(name: str, readme: str) -> bool:
    """`x.json`, or a plot written the README's short way: `x.json` / `.png`."""
    if f"`{name}`" in readme:
        return True
    stem, suffix = name.rsplit(".", 1)
    return suffix == "png" and re.search(rf"`{re.escape(stem)}\.json` / `\.png`", readme) is not None


def test_results_readme_lists_every_result_file():
    readme = (RESULTS_DIR / "README.md").read_text()
    files = [p.name for p in sorted(RESULTS_DIR.iterdir()) if p.suffix in (".json", ".png")]
    unlisted = [name for name in files if not listed_in_results_readme(name, readme)]
    assert not unlisted, f"benchmarks/results/README.md does not say how these were made: {unlisted}"


def test_results_readme_names_only_existing_files():
    readme = (RESULTS_DIR / "README.md").read_text()
    table_rows = [line for line in readme.splitlines() if line.startswith("| `")]
    named = {n for row in table_rows for n in re.findall(r"`([a-z0-9_]+\.(?:json|png))`", row.split("|")[1])}
    assert named, "benchmarks/results/README.md has no table of result files"
    missing = sorted(n for n in named if not (RESULTS_DIR / n).exists())
    assert not missing, f"benchmarks/results/README.md lists files that are not there: {missing}"


@pytest.mark.parametrize("path", PRODUCT_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_do_not_narrate_sessions(path):
    hits = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if SESSION_NARRATIVE.search(line)]
    assert not hits, "how a figure was obtained goes to benchmarks/results/README.md:\n  " + "\n  ".join(hits)
