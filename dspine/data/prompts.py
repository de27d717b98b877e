"""`Prompt` (one OpenAI-format user message with its id and source), the files prompts are read
from, and the JSONL export format (`{"id", "source", "messages"}` per line).

Pure Python: no torch.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from dspine.utils.atomic import write_jsonl_atomic


@dataclass(frozen=True)
class Prompt:
    """One prompt: `messages` in OpenAI chat format (here always one user turn)."""

    id: str
    messages: list[dict]
    source: str

    @property
    def text(self) -> str:
        """Content of the last user message."""
        return self.messages[-1]["content"]


def user_message(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def package_root(module: str) -> Path | None:
    """The folder of the installed package `module`, located without importing it; None when absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(module: str, dist: str, relpath: str) -> Path:
    """A data file shipped inside an installed package, located without importing it."""
    root = package_root(module)
    if root is None:
        raise FileNotFoundError(f"package {dist!r} is not installed; `pip install {dist}`.")
    path = root / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {dist!r}.")
    return path


def read_bytes(path: Path) -> bytes:
    """The file's content, decompressed when its name ends in `.gz`."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return f.read()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in read_bytes(path).decode("utf-8").split("\n") if line.strip()]


def save_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    """Write prompts as JSONL (`{"id", "source", "messages"}` per line), atomically."""
    write_jsonl_atomic(path, ({"id": p.id, "source": p.source, "messages": p.messages} for p in prompts))


def load_prompts(path: str | Path) -> list[Prompt]:
    with open(path) as f:
        return [Prompt(r["id"], r["messages"], r["source"]) for r in map(json.loads, f) if r]


def exported_prompts(prompts_dir: str | Path | None, stem: str) -> list[Prompt] | None:
    """The export `<prompts_dir>/<stem>.jsonl` (`export_prompts`), or None without a `prompts_dir`."""
    if prompts_dir is None:
        return None
    path = Path(prompts_dir).expanduser() / f"{stem}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"--prompts-dir {prompts_dir} has no {path.name}: write it with "
                                "dspine.data.prompt_sources.export_prompts, or drop --prompts-dir")
    return load_prompts(path)
