"""The dashboard's timeline: the nodes' events (dspark.node.states.NodeState.events) merged in
time order, each taken once from its node's ring, and the dashboard's own "lost" (an agent gone
without a word: a kill -9, a host down). EVENTS_KEPT in memory, the newest EVENTS_SHOWN of them
in each snapshot."""

from __future__ import annotations

import math
from collections import deque

from dspark.dashboard.agent_fields import number
from dspark.node import states as A

EVENTS_KEPT = 512
EVENTS_SHOWN = 100
EVENT_TEXT_MAX = 240


def node_event(e: object, node: str) -> dict | None:
    """One event of a node's ring (dspark.node.states.NodeState.events); None for anything else."""
    if not isinstance(e, dict) or not number(e.get("at")) or e["at"] <= 0:
        return None
    kind, detail = e.get("kind"), e.get("detail", "")
    if not isinstance(kind, str) or not 0 < len(kind) <= 32 or not isinstance(detail, str):
        return None
    return {"at": round(float(e["at"]), 3), "node": node, "kind": kind, "detail": detail[:EVENT_TEXT_MAX],
            "by": "node"}


class Timeline:
    def __init__(self) -> None:
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        # Per node: the newest event taken from its ring, and the events taken at exactly that time.
        self._taken: dict[str, tuple[float, frozenset]] = {}

    def take(self, node: str, events: object) -> None:
        """The events of a node's ring that the timeline does not hold yet: those after the newest
        taken (the ring is in time order; a restarted node's new ring starts later)."""
        if not isinstance(events, list):
            return
        taken_at, taken_keys = self._taken.get(node, (-math.inf, frozenset()))
        newest, keys = taken_at, set(taken_keys)
        for e in events[-A.EVENTS_MAX:]:
            ev = node_event(e, node)
            if ev is None:
                continue
            key = (ev["at"], ev["kind"], ev["detail"])
            if ev["at"] < taken_at or (ev["at"] == taken_at and key in taken_keys):
                continue
            self.add(ev)
            if ev["at"] > newest:
                newest, keys = ev["at"], set()
            keys.add(key)
        self._taken[node] = (newest, frozenset(keys))

    def add(self, ev: dict) -> None:
        self.events.append(ev)
        if len(self.events) > 1 and self.events[-2]["at"] > ev["at"]:  # nodes' events interleave
            ordered = sorted(self.events, key=lambda e: e["at"])
            self.events.clear()
            self.events.extend(ordered)

    def shown(self) -> list[dict]:
        """The newest EVENTS_SHOWN, oldest first: the snapshot's "events"."""
        return list(self.events)[-EVENTS_SHOWN:]
