"""The cluster's event log in etcd: failures, departures, joins, fencings.

One key per (node, lease, kind): ``<prefix>/events/<node>/<lease>/<kind>``, created only if
absent, so when every survivor sees the same failure exactly one event is recorded (the first
observer's). Retention is bounded: past ``retention`` events the oldest (by create revision)
are deleted.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from elasticd.coordination import records
from elasticd.coordination.api import Coordinator
from elasticd.coordination.keys import Keyspace

log = logging.getLogger(__name__)

KIND = "event"


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing that happened to a node.

    Attributes:
        kind: failed | left | joined | fenced | rejoined | recovered (a rank restored after a
            failure: data has job, rank, source, seconds, steps_lost, step) | drained |
            drain_failed.
        lease: the node's lease at the time (hex in keys).
        at: wall time when it was recorded.
        detail: one human sentence.
        data: kind-specific numbers (e.g. ``detection_seconds``).
        instance: tells apart events of a kind that happen more than once per lease
            (recoveries, drains); part of the key, empty for once-per-lease kinds.
    """

    kind: str
    node: str
    lease: int
    at: float
    by: str
    detail: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    instance: str = ""


class EventLog:
    """Writes and reads events under one cluster prefix."""

    def __init__(self, coord: Coordinator, keys: Keyspace, retention: int = 1000) -> None:
        self._coord = coord
        self._keys = keys
        self.retention = retention

    def record(self, event: Event) -> bool:
        """Records ``event`` unless the same (node, lease, kind) already is; True if written."""
        kind = f"{event.kind}@{event.instance}" if event.instance else event.kind
        key = self._keys.event(event.node, event.lease, kind)
        written = self._coord.create(key, records.encode_dataclass(KIND, event))
        if written:  # past ``retention`` events, the oldest (by create revision) go
            kvs, _ = self._coord.get_prefix(self._keys.events)
            excess = max(0, len(kvs) - self.retention)
            for kv in sorted(kvs, key=lambda kv: kv.create_revision)[:excess]:
                self._coord.delete(kv.key)
        return written

    def exists(self, node: str, lease: int, kind: str) -> bool:
        return self._coord.get(self._keys.event(node, lease, kind)) is not None

    def list(self) -> list[Event]:
        """Every retained event, oldest first; unreadable ones are skipped with a warning."""
        kvs, _ = self._coord.get_prefix(self._keys.events)
        out = []
        for kv in sorted(kvs, key=lambda kv: kv.create_revision):
            try:
                out.append(records.decode_dataclass(Event, kv.value, KIND, kv.key))
            except records.RecordError as exc:
                log.warning("skipping event: %s", exc)
        return out
