"""EtcdHealth: one log line per outage, and one more when the outage changes kind (etcd back,
but refusing elasticd's credentials: after an etcd data loss its users are gone too)."""

from __future__ import annotations

import logging

from elasticd.testing.clock import FakeClock
from elasticd.coordination.api import AuthError, Unavailable
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
