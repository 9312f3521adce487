"""etcd faults: its leader killed, or every member paused (SIGSTOP) for longer than the lease
TTL. Coordination goes away for a while; training must not lose a step for it."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_kill9_etcd_leader_training_goes_on(tmp_path, reference):
    shape = Shape()
    out = ChaosCluster(tmp_path, shape).run(FaultPlan().kill_etcd_leader(at_step=15))
    out.assert_all(sources=[], reference=reference(shape))


def test_etcd_paused_longer_than_the_lease_ttl(tmp_path, reference):
    shape = Shape()
    out = ChaosCluster(tmp_path, shape).run(
        FaultPlan().pause_etcd(seconds=3 * shape.lease_ttl, at_step=15))
    out.assert_all(sources=[], reference=reference(shape))
