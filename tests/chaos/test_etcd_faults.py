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
    # Slower steps, so that the job still trains when etcd comes back (and every lease it
    # held has expired): nobody may be declared dead for an outage of etcd itself.
    shape = Shape(step_time=0.3)
    plan = FaultPlan().pause_etcd(seconds=3 * shape.lease_ttl, at_step=8)
    out = ChaosCluster(tmp_path, shape).run(plan)
    out.assert_all(sources=[], reference=reference(shape))
    resumed = out.faults[0].undone_at
    last = max(e.seen for e in out.cc.logs.events if e.kind == "step")
    assert last > resumed + 1, (
        f"the job had ended before etcd came back (paused at {out.faults[0].at:.2f}, resumed "
        f"at {resumed:.2f}, last step seen at {last:.2f}): the scenario tested nothing")
    assert not [e for e in out.events if e["kind"] == "failed"], out.events
