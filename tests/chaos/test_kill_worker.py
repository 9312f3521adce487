"""kill -9 of one worker (its agent and daemon stay up): torchrun restarts the group at the same
world size and every rank restores from its own daemon's RAM.

No standby here: with one, the restart is a new rendezvous round that the standby may join in
place of a healthy node (ranks move, and come from peers), which test_kill_node covers."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_kill9_worker_restores_every_rank_from_local_ram(tmp_path, reference):
    shape = Shape(standby=())
    out = ChaosCluster(tmp_path, shape).run(FaultPlan().kill_worker("n2", at_step=20))
    out.assert_all(sources=[{"local"}], reference=reference(shape))
