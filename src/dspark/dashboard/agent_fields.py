"""What a node's agent reports, checked and shaped for the snapshot: its memory, the head's
liveness, the runtime line and the switch under way. Anything an agent sends that is not what
the page can show becomes None, never an error (an agent may be older, newer or hostile)."""

from __future__ import annotations

import math
import time
from typing import cast

from dspark.node import host_memory


def rounded(x: float | None, nd: int = 3) -> float | None:
    """The snapshot's rounding: None stays None."""
    return None if x is None else round(x, nd)


def number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def memory(m: object) -> dict | None:
    """A node's memory as its agent reports it (dspark.node.host_memory); None for anything else."""
    if not isinstance(m, dict) or m.get("source") not in host_memory.SOURCES:
        return None
    figures: dict[str, int] = {}
    for k in ("total_bytes", "used_bytes", "available_bytes"):
        v = m.get(k)
        if not number(v) or cast(float, v) < 0:
            return None
        figures[k] = int(cast(float, v))
    if not figures["total_bytes"]:
        return None
    return {**figures, "source": m["source"]}


def liveness(live: object) -> dict | None:
    """The head's last liveness round and the last proof of life, as the agent reports them."""
    if not isinstance(live, dict):
        return None
    at = live.get("proof_at")
    age = time.time() - at if isinstance(at, (int, float)) and not isinstance(at, bool) else None
    proof = live.get("proof") if live.get("proof") in ("progress", "probe") else None
    detail = live.get("proof_detail")
    return {"ok": live.get("ok") is True, "proof": proof,
            "proof_age_s": rounded(max(age, 0.0), 1) if age is not None else None,
            "proof_detail": detail if isinstance(detail, str) else ""}


def line(x: object) -> str | None:
    """A runtime line's name as an agent reports it (None from an agent before runtime lines, or
    for anything that is not a name: the page shows it in one table cell)."""
    return x if isinstance(x, str) and 0 < len(x) <= 64 else None


def switch(sw: object) -> dict | None:
    """The head's switch under way (dspark.lines.state.Switch.to_json()), with how long it has run;
    None when there is none or the record is not one the page can show."""
    if not isinstance(sw, dict) or line(sw.get("from")) is None or line(sw.get("to")) is None:
        return None
    at = sw.get("at")
    known = isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)
    age = time.time() - cast(float, at) if known else None
    sid = sw.get("id")
    return {"id": sid if isinstance(sid, str) else "", "from": sw["from"], "to": sw["to"],
            "rollback": sw.get("rollback") is True, "at": at if age is not None else None,
            "for_s": rounded(max(age, 0.0), 1) if age is not None else None}
