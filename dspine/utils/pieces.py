"""Files split into pieces of at most N MiB and joined back, checked: how a training run's state and
data travel to a host that takes at most 16 MiB per file.

    python -m dspine.utils.pieces split runs/qwen3-8b-dspine/state.pt .gpu-state/ [--max-mib 16]
    python -m dspine.utils.pieces join .gpu-state/ runs/qwen3-8b-dspine/state.pt

`split` writes `<name>.part0000`, `<name>.part0001`, ... and `<name>.pieces.json` (`{"name", "bytes",
"sha256", "pieces": [{"file", "bytes", "sha256"}]}`) into the folder; `join` checks every piece and
the whole against the manifest before the output appears (written atomically), and names the first
piece that is missing or differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from dspine.utils.atomic import write_atomic, write_json_atomic

MANIFEST_SUFFIX = ".pieces.json"


class PiecesError(ValueError):
    """A piece or a manifest is missing or differs; the message names it."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """`data` at `path`, atomically (the bytes go into the temporary file before the rename)."""
    return write_atomic(path, lambda f: None, check=lambda tmp: tmp.write_bytes(data))


def split(path: Path, folder: Path, max_mib: float = 16.0) -> Path:
    """`path` into pieces of at most `max_mib` MiB in `folder`; returns the manifest's path."""
    size = max(1, int(max_mib * (1 << 20)))
    folder.mkdir(parents=True, exist_ok=True)
    whole, pieces = hashlib.sha256(), []
    with open(path, "rb") as f:
        for index, chunk in enumerate(iter(lambda: f.read(size), b"")):
            piece = folder / f"{path.name}.part{index:04d}"
            write_bytes_atomic(piece, chunk)
            whole.update(chunk)
            pieces.append({"file": piece.name, "bytes": len(chunk), "sha256": _sha256(chunk)})
    manifest = {"name": path.name, "bytes": sum(p["bytes"] for p in pieces), "sha256": whole.hexdigest(),
                "pieces": pieces}
    return write_json_atomic(folder / f"{path.name}{MANIFEST_SUFFIX}", manifest, indent=1)


def join(folder: Path, out: Path, name: str | None = None) -> Path:
    """The file `name` (default: the folder's only manifest) rebuilt at `out` from its pieces."""
    manifests = sorted(folder.glob(f"*{MANIFEST_SUFFIX}")) if name is None else [folder / f"{name}{MANIFEST_SUFFIX}"]
    if len(manifests) != 1 or not manifests[0].is_file():
        found = ", ".join(m.name for m in manifests if m.is_file()) or "none"
        raise PiecesError(f"{folder}: expected one manifest *{MANIFEST_SUFFIX} (found {found}); name the file to join")
    manifest = json.loads(manifests[0].read_text())
    data = bytearray()
    for piece in manifest["pieces"]:
        path = folder / piece["file"]
        if not path.is_file():
            raise PiecesError(f"{path} is missing ({len(manifest['pieces'])} pieces in {manifests[0].name})")
        chunk = path.read_bytes()
        if len(chunk) != piece["bytes"] or _sha256(chunk) != piece["sha256"]:
            raise PiecesError(f"{path} differs from {manifests[0].name} (size or sha256): copy it again")
        data += chunk
    if _sha256(bytes(data)) != manifest["sha256"]:
        raise PiecesError(f"the joined {manifest['name']} differs from its manifest's sha256")
    return write_bytes_atomic(out, bytes(data))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspine.utils.pieces",
                                description="Split a file into checked pieces of at most N MiB, or join them back.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="FILE FOLDER: write FILE's pieces and manifest into FOLDER")
    s.add_argument("file", type=Path)
    s.add_argument("folder", type=Path)
    s.add_argument("--max-mib", type=float, default=16.0, help="largest piece in MiB (default 16)")
    j = sub.add_parser("join", help="FOLDER OUT: rebuild the file of FOLDER's manifest at OUT, every piece checked")
    j.add_argument("folder", type=Path)
    j.add_argument("out", type=Path)
    j.add_argument("--name", default=None, help="which file, when FOLDER holds several manifests")
    args = p.parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.file, args.folder, args.max_mib)
            print(f"{args.file} -> {len(json.loads(manifest.read_text())['pieces'])} pieces, {manifest}")
        else:
            print(f"joined {join(args.folder, args.out, args.name)}")
    except (OSError, PiecesError) as exc:
        print(f"pieces: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
