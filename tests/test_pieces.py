"""dspine.utils.pieces: a file split into pieces of at most N MiB joins back byte for byte; a missing
or altered piece is named and nothing is written."""

from __future__ import annotations

import json
import os

import pytest

from dspine.utils import pieces


def test_split_and_join_round_trip_within_the_size(tmp_path):
    original = tmp_path / "state.pt"
    original.write_bytes(os.urandom(2_500_000))
    manifest = pieces.split(original, tmp_path / "out", max_mib=1)
    listing = json.loads(manifest.read_text())
    assert [p["bytes"] for p in listing["pieces"]] == [1 << 20, 1 << 20, 2_500_000 - 2 * (1 << 20)]
    assert all((tmp_path / "out" / p["file"]).stat().st_size <= 1 << 20 for p in listing["pieces"])
    joined = pieces.join(tmp_path / "out", tmp_path / "back.pt")
    assert joined.read_bytes() == original.read_bytes()


def test_a_missing_or_altered_piece_is_named_and_nothing_is_written(tmp_path, capsys):
    original = tmp_path / "data.jsonl"
    original.write_bytes(b"x" * 3000)
    pieces.split(original, tmp_path / "out", max_mib=0.001)               # 1048-byte pieces
    part = tmp_path / "out" / "data.jsonl.part0001"
    part.write_bytes(b"y" + part.read_bytes()[1:])
    with pytest.raises(pieces.PiecesError, match="data.jsonl.part0001 differs"):
        pieces.join(tmp_path / "out", tmp_path / "back")
    part.unlink()
    assert pieces.main(["join", str(tmp_path / "out"), str(tmp_path / "back")]) == 2
    assert "part0001 is missing" in capsys.readouterr().err
    assert not (tmp_path / "back").exists()
