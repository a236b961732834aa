"""The user's documentation as one text: README.md, then every docs/*.md in name order. The
tests that check what the documents say (their commands, quoted outputs, stated figures) read
this, so a passage can move between the README and docs/ without losing its test."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docs_text() -> str:
    return "\n".join(p.read_text() for p in documents())
