"""Progress reporting as a small hook interface: the benchmarks call it, never print.
Passing no hook gives a silent run."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def begin(self, total: int, title: str) -> None:
        """A run of `total` requests starts."""

    def step(self, note: str) -> None:
        """One request finished; `note` is a short description of it."""

    def end(self) -> None:
        """The run is over (finished or stopped)."""


class Silent:
    def begin(self, total: int, title: str) -> None:
        pass

    def step(self, note: str) -> None:
        pass

    def end(self) -> None:
        pass


def or_silent(progress: Progress | None) -> Progress:
    return Silent() if progress is None else progress
