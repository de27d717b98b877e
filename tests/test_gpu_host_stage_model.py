"""`dspine_stage_model` (scripts/gpu_host_sglang.sh): the bundle's GGUF chunks, a few per call, become
the target's folder once all of them are there and the joined file matches the manifest's sha256."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "scripts" / "gpu_host_sglang.sh"
CONVERTER = 'import pathlib, sys; out = pathlib.Path(sys.argv[2]); out.mkdir(parents=True); ' \
            '(out / "converted_from").write_bytes(pathlib.Path(sys.argv[1]).read_bytes())\n'

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and sha256sum")


def host_checkout(tmp_path: Path, chunks: list[bytes], *, sha_of: bytes | None = None) -> Path:
    """A repo root as a device call sees it: .gpu/host (env.sh, a stub converter, a manifest naming
    the chunks of model.gguf and the sha256 of `sha_of`, by default their concatenation), and one
    folder per chunk (part0, part1, ...)."""
    root = tmp_path / "repo"
    host = root / ".gpu" / "host"
    host.mkdir(parents=True)
    (host / "env.sh").write_text(f'export SMOLLM2="{tmp_path}/model"\n')
    (host / "gguf_to_hf.py").write_text(CONVERTER)
    whole = b"".join(chunks)
    lines = ["bundle abc 2"]
    for i, chunk in enumerate(chunks):
        (root / f"part{i}").mkdir()
        (root / f"part{i}" / f"model.gguf.{i:02d}").write_bytes(chunk)
        lines.append(f"file {i + 1} model.gguf.{i:02d} {len(chunk)} {hashlib.sha256(chunk).hexdigest()}")
    lines.append(f"model smollm2 model.gguf {len(whole)} {hashlib.sha256(sha_of or whole).hexdigest()}")
    (host / "manifest.txt").write_text("\n".join(lines) + "\n")
    return root


def stage(root: Path, tmp_path: Path, folder: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSPINE_SRC": str(tmp_path / "src"), "DSPINE_LOGS": str(tmp_path / "logs"),
           "DSPINE_GGUF_STASH": str(tmp_path / "stash")}
    return subprocess.run(["bash", "-c", f'source "{HELPER}" && dspine_stage_model {folder}'], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_model_is_built_once_every_chunk_is_there(tmp_path):
    chunks = [b"GGUF first half ", b"and the second"]
    root = host_checkout(tmp_path, chunks)

    first = stage(root, tmp_path, "part0")
    assert first.returncode == 0, first.stderr
    assert "chunks still to send: model.gguf.01" in first.stdout
    assert not (tmp_path / "model").exists()

    second = stage(root, tmp_path, "part1")
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "model" / "converted_from").read_bytes() == b"".join(chunks)
    assert not (tmp_path / "stash" / "model.gguf").exists()   # the joined file is not kept


def test_a_joined_file_that_differs_from_the_manifest_builds_nothing(tmp_path):
    root = host_checkout(tmp_path, [b"GGUF first half ", b"and the second"], sha_of=b"another file")
    stage(root, tmp_path, "part0")

    result = stage(root, tmp_path, "part1")
    assert result.returncode == 1
    assert "does not match the manifest's sha256: send every chunk again" in result.stderr
    assert not (tmp_path / "model").exists()
    assert not list((tmp_path / "stash").iterdir())           # the bad chunks are gone too
