"""Where a gen-data run's records go: an append-only `<out>.partial` while it runs, `<out>` at the end.

* `append(record)`: one JSON line per record, written in one call and flushed (fsynced at least
  every `SYNC_EVERY_S` seconds and on close), so a killed run keeps every finished record and loses
  at most the requests in flight. A line cut by a kill mid-write has no newline: it is cut off when
  the file is opened again, so a record is only ever read whole.
* `RecordStore(out, resume=True)`: the records already in `<out>` (a finished earlier run) and in
  `<out>.partial` are done (`done` holds their ids) and are kept. Without `resume`, an existing
  `<out>.partial` (an interrupted run's work) is an error naming `--resume`; an old `<out>` is
  replaced at the end.
* `finish(order)`: `<out>` is written atomically (temporary file + rename, `write_atomic`) with
  every kept record once (the first of an id wins), in the order of `order` (ids not in it after
  the others, in file order); then `<out>.partial` is removed. Records are copied one at a time:
  memory holds one offset per record, not the records.
* A kept record with another `target` fingerprint than the run's is refused (GenDataError): one
  file never mixes targets.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dspine.train.gen_data_errors import GenDataError
from dspine.utils.atomic import write_atomic

SYNC_EVERY_S = 5.0


def partial_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


class RecordStore:
    """The records of one `--out` file (see the module docstring); `stamp` is the run's
    `{"name", "fingerprint"}` target stamp."""

    def __init__(self, out: str | Path, *, resume: bool, stamp: dict | None = None):
        self.out, self.partial = Path(out), partial_path(out)
        self.stamp = stamp
        self._where: dict[str, tuple[Path, int, int]] = {}     # id -> (file, offset, bytes)
        if self.partial.exists() and not resume:
            raise GenDataError(f"{self.partial} holds the records of an interrupted run: pass --resume to continue "
                               "it, or delete it to start over")
        if resume:
            if self.out.is_file():
                self._scan(self.out, torn_ok=False)
            if self.partial.is_file():
                self._scan(self.partial, torn_ok=True)
        self.resumed = len(self._where)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.partial, "ab")
        self._offset = self._file.tell()
        self._synced = time.monotonic()

    @property
    def done(self) -> set[str]:
        return set(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def _scan(self, path: Path, torn_ok: bool) -> None:
        """Index the records of `path`; in the partial file a last line without newline is cut off."""
        offset = 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.endswith(b"\n") and torn_ok:
                    break
                if line.strip():
                    self._index(path, lineno, line, offset)
                offset += len(line)
        if torn_ok and offset < path.stat().st_size:
            with open(path, "r+b") as f:
                f.truncate(offset)

    def _index(self, path: Path, lineno: int, line: bytes, offset: int) -> None:
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(rec.get("ids"), list)
        except (json.JSONDecodeError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise GenDataError(f"{path}:{lineno}: not a gen-data record; delete the file or pick another --out")
        target = rec.get("target")
        if self.stamp and isinstance(target, dict) and target.get("fingerprint") != self.stamp["fingerprint"]:
            raise GenDataError(f"{path}:{lineno}: written for target {target.get('name')!r} (fingerprint "
                               f"{target.get('fingerprint')}), not {self.stamp['name']!r} (fingerprint "
                               f"{self.stamp['fingerprint']}); resume with that --target or write another --out")
        self._where.setdefault(rec["id"], (path, offset, len(line)))

    def append(self, record: dict) -> None:
        """Write one finished record (one write, flushed); a record of an id already kept is ignored."""
        if record["id"] in self._where:
            return
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self._file.write(line)
        self._file.flush()
        self._where[record["id"]] = (self.partial, self._offset, len(line))
        self._offset += len(line)
        if time.monotonic() - self._synced >= SYNC_EVERY_S:
            os.fsync(self._file.fileno())
            self._synced = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def finish(self, order: list[str]) -> int:
        """Write `<out>` (see the module docstring) and remove the partial file; the record count."""
        self.close()
        rank = {key: i for i, key in enumerate(order)}
        seq = {key: i for i, key in enumerate(self._where)}
        keys = sorted(self._where, key=lambda k: (rank.get(k, len(rank)), seq[k]))

        def fill(f) -> None:
            handles: dict[Path, object] = {}
            try:
                for key in keys:
                    path, offset, size = self._where[key]
                    if path not in handles:
                        handles[path] = open(path, "rb")
                    handles[path].seek(offset)
                    line = handles[path].read(size).decode("utf-8")
                    f.write(line if line.endswith("\n") else line + "\n")
            finally:
                for handle in handles.values():
                    handle.close()

        write_atomic(self.out, fill)
        self.partial.unlink(missing_ok=True)
        return len(keys)
