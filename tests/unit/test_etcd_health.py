"""EtcdHealth: one log line per outage, and one more when the outage changes kind (etcd back,
but refusing elasticd's credentials: after an etcd data loss its users are gone too)."""

from __future__ import annotations

import logging

from elasticd.testing.clock import FakeClock
from elasticd.coordination.api import AuthError, Refused, Unavailable
from elasticd.coordination.health import EtcdHealth


def test_one_line_per_kind_of_failure_within_an_outage(caplog):
    starts, ends = [], []
    health = EtcdHealth(FakeClock(), lambda: starts.append(1), ends.append, describe="etcd")
    caplog.set_level(logging.WARNING, logger="elasticd.coordination.health")
    for _ in range(3):
        health.failed(Unavailable("gone"))
    for _ in range(5):
        health.failed(AuthError("refused: create elasticd's user again"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "unreachable" in lines[0]
    assert "refuses our credentials" in lines[1] and "create elasticd's user again" in lines[1]
    assert starts == [1] and not health.up  # still one outage, counted once
    health.ok()
    assert ends and health.up and len(caplog.records) == 3


def test_an_ended_outage_keeps_every_kind_it_had():
    """What a caller repairs after an outage depends on what it was: etcd refusing requests
    while its users change keeps every watch stream; etcd gone for a moment may not."""
    health = EtcdHealth(FakeClock())
    health.failed(Refused("revision of auth store is old"))
    health.failed(Refused("revision of auth store is old"))
    health.ok()
    assert health.last_outage_kinds == {"refuses our requests"}
    health.failed(Unavailable("gone"))
    health.failed(Refused("revision of auth store is old"))
    health.ok()
    assert health.last_outage_kinds == {"unreachable", "refuses our requests"}
