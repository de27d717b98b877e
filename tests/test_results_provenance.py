"""Every committed benchmark result says how it was made: valid JSON with command, device and date."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*.json"))


def test_there_are_results():
    assert RESULTS


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_records_command_device_and_date(path):
    data = json.loads(path.read_text())
    missing = [k for k in ("command", "device", "date") if not data.get(k)]
    assert not missing, f"{path.name} lacks {missing}: write them where the benchmark writes the file"
