"""dspine.data.records_summary: the figures of gen-data records, multi-turn spans and single-turn
answers alike, and a bad line named by file and number."""

import json

from dspine.data import records_summary


def test_summary_counts_answer_spans_and_long_records(tmp_path):
    records = [
        {"id": "a", "ids": list(range(3000)), "answer_start": 10, "answer_spans": [[10, 30], [2900, 3000]]},
        {"id": "b", "ids": list(range(50)), "answer_start": 20},                       # one turn: 20..50
        {"id": "c", "ids": list(range(2048)), "answer_start": 2000},
    ]
    path = tmp_path / "greedy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert records_summary.main([str(path), "--out", str(tmp_path / "s.json")]) == 0
    got = json.loads((tmp_path / "s.json").read_text())["greedy"]
    assert got == {"records": 3, "answer_turns": 4, "tokens": 5098, "answer_tokens": 20 + 100 + 30 + 48,
                   "median_tokens": 2048, "p90_tokens": 3000, "records_at_least_2048_tokens": 2}


def test_a_bad_line_is_named(tmp_path, capsys):
    path = tmp_path / "sampled.jsonl"
    path.write_text(json.dumps({"ids": [1, 2], "answer_start": 1}) + "\n{not json\n")
    assert records_summary.main([str(path)]) == 2
    assert f"{path}:2: not a gen-data record" in capsys.readouterr().err
