"""``elasticctl drain NODE``: the node hands its replicas to others (every committed step keeps
m copies without it), then leaves the job cleanly; the standby takes its place, restoring the
drained node's rank from a peer, and the job goes on. Steps lost equal the sync lag when the
workers stopped (1 in the run on ops' drain: the step trained after snapshots were paused)."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_drain_node_standby_takes_over_from_peers(tmp_path, reference):
    # 150 steps: elasticctl drain (a new interpreter) returns seconds after the drain starts;
    # with 50 steps CI once saw the job end before the drained node's workers stopped.
    shape = Shape(steps=150)
    out = ChaosCluster(tmp_path, shape).run(FaultPlan().drain("n2", at_step=20))
    out.assert_all(sources=[{"local", "peer"}], reference=reference(shape),
                   must={"peer"})
    assert not any(e["kind"] == "failed" and e["node"] == "n2" for e in out.events), (
        "a drain was recorded as a failure")
