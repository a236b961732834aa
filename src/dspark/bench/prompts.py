"""Reproducible, unique token-ID prompts of exact lengths, each with a SHA-256 fingerprint.

A prompt is a pure function of (seed, purpose, length, index): the same run plan gives the
same token ids on any machine and Python version (SHAKE-256 output, not `random`), so a
"before" and an "after" report can prove they sent identical input. Different keys give
different first tokens, so no two prompts of one plan share a KV-cache block and the
server's prefix cache never serves one prompt from another.

Token ids are sent as-is (`prompt: [ids]`), so the server's tokenizer is never involved
and the length the server sees is exactly the length asked for.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

SCHEME = "dspark-bench-prompt/1"  # part of every key: change it and every fingerprint changes
# Ids drawn from [TOKEN_LOW, TOKEN_HIGH): inside the tiny local model's vocabulary (4096) and
# ordinary BPE tokens of DeepSeek V4's (~129K), clear of the special ids at either end.
TOKEN_LOW = 1000
TOKEN_HIGH = 4000


@dataclass(frozen=True)
class Prompt:
    key: str
    token_ids: tuple[int, ...]
    sha256: str

    def __len__(self) -> int:
        return len(self.token_ids)


def token_ids(key: str, length: int, low: int = TOKEN_LOW, high: int = TOKEN_HIGH) -> list[int]:
    """`length` ids in [low, high), derived from `key` alone."""
    if length <= 0:
        raise ValueError(f"prompt length must be positive, not {length}")
    if not 0 <= low < high:
        raise ValueError(f"bad token range [{low}, {high})")
    span = high - low
    raw = hashlib.shake_256(key.encode()).digest(4 * length)
    return [low + v % span for v in struct.unpack(f"<{length}I", raw)]


def fingerprint(ids: list[int] | tuple[int, ...]) -> str:
    """SHA-256 of the ids as little-endian uint32: what the server received, independent of
    how the prompt was made."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def make(seed: int, purpose: str, length: int, index: int | str = 0) -> Prompt:
    key = f"{SCHEME}|seed={seed}|{purpose}|len={length}|{index}"
    ids = tuple(token_ids(key, length))
    return Prompt(key=key, token_ids=ids, sha256=fingerprint(ids))


def set_fingerprint(fingerprints: list[str]) -> str:
    """One SHA-256 over an ordered list of prompt fingerprints (a whole run plan)."""
    h = hashlib.sha256()
    for f in fingerprints:
        h.update(bytes.fromhex(f))
    return h.hexdigest()
