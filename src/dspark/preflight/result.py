"""One check's verdict and the report of a run: the shape every check returns."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    """One line of `dspark check`: what was looked at, what was seen, and how to fix it."""

    name: str          # e.g. "net.link"; stable, for --json readers
    status: str        # ok, warn or fail
    seen: str          # what was seen, in words
    fix: str = ""      # what to do (warn and fail)


def ok(name: str, seen: str) -> Check:
    return Check(name, OK, seen)


def warn(name: str, seen: str, fix: str) -> Check:
    return Check(name, WARN, seen, fix)


def fail(name: str, seen: str, fix: str) -> Check:
    return Check(name, FAIL, seen, fix)


@dataclass
class Report:
    node: str
    checks: list[Check] = field(default_factory=list)
    identity: dict | None = None   # this node's identity (what its agent serves in /state)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warned(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    def lines(self) -> list[str]:
        width = max((len(c.name) for c in self.checks), default=0)
        out = []
        for c in self.checks:
            out.append(f"{c.status:<4}  {c.name:<{width}}  {c.seen}")
            if c.fix and c.status != OK:
                out.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
        return out

    def summary(self) -> str:
        n = len(self.checks)
        return (f"{self.node}: {n} checks, {len(self.failed)} failed, {len(self.warned)} warned"
                + ("" if not self.failed else " (" + ", ".join(c.name for c in self.failed) + ")"))

    def to_json(self) -> str:
        return json.dumps({"node": self.node, "ok": not self.failed, "checks": [asdict(c) for c in self.checks],
                           "identity": self.identity}, indent=2)
