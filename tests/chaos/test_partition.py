"""One node partitioned from everything else (etcd included) for 3x the lease TTL: every packet
its processes send or receive is dropped (cgroup + eBPF, see partition.py), so its peers get no
TCP reset. They see its lease expire and restart their workers at once (proactive abort), the
standby takes its place; when the network heals, the node finds itself declared dead, fences
(stops its stale workers) and rejoins."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape
from tests.chaos.partition import available

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]

WHY_NOT = available()


@pytest.mark.skipif(bool(WHY_NOT), reason=f"no partitions on this machine: {WHY_NOT}")
def test_partitioned_node_is_aborted_around_and_fences(tmp_path, reference):
    shape = Shape(step_time=0.1)
    plan = FaultPlan().partition("n2", seconds=3 * shape.lease_ttl, at_step=15)
    out = ChaosCluster(tmp_path, shape, partitions=True).run(plan)
    out.assert_all(sources=[{"local", "peer"}], reference=reference(shape),
                   # The standby's rank comes from a peer's RAM; when the returning node
                   # forces a second restart, that shard is local by then but still reported
                   # "peer" (ckpt_open says where the bytes came from).
                   must={"peer"})
    kinds = {(e["kind"], e["node"]) for e in out.events}
    assert ("failed", "n2") in kinds and ("fenced", "n2") in kinds, kinds
