"""Atomic writes: a file appears whole under its final name or not at all.

Each writer fills a temporary file beside the target (same directory, so the rename cannot cross
file systems), makes it world-readable (an SGLang server may run as another user), then renames it
over the target. A failure mid-write leaves the old file (or none) and no temporary behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO


def write_atomic(path: str | Path, fill: Callable[[IO[str]], None], *, check: Callable[[Path], None] | None = None,
                 mode: int = 0o644) -> Path:
    """Write `path` through `fill(file)`; `check(tmp_path)` may validate the bytes before the rename
    (raise to abandon the write). Parent folders are created. Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fill(f)
        os.chmod(tmp, mode)
        if check is not None:
            check(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str, **kwargs) -> Path:
    return write_atomic(path, lambda f: f.write(text), **kwargs)


def write_json_atomic(path: str | Path, payload, *, indent: int | None = 2, **kwargs) -> Path:
    """`payload` as JSON (a trailing newline; non-ASCII kept)."""
    return write_text_atomic(path, json.dumps(payload, indent=indent, ensure_ascii=False) + "\n", **kwargs)


def write_jsonl_atomic(path: str | Path, records: Iterable[dict], **kwargs) -> Path:
    """One JSON object per line."""
    def fill(f: IO[str]) -> None:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return write_atomic(path, fill, **kwargs)
