"""kill -9 of a whole node (daemon, agent, workers, and its RAM): the standby replaces it and
the dead node's rank comes back from its replica in a peer's RAM."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_kill9_node_standby_takes_over_from_peer_ram(tmp_path, reference):
    shape = Shape()
    out = ChaosCluster(tmp_path, shape).run(FaultPlan().kill_node("n2", at_step=20))
    out.assert_all(sources=[{"peer", "local"}], reference=reference(shape),
                   must={"peer"})
