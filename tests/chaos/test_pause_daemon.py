"""SIGSTOP of one daemon for longer than its lease TTL (its agent and workers keep running): the
peers declare the node dead and restart their workers at once (proactive abort), the standby
takes its place; when the daemon wakes up it finds itself declared dead and fences: it stops
its own workers before it rejoins, so that no stale worker keeps training."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_sigstop_daemon_is_aborted_around_and_fences(tmp_path, reference):
    shape = Shape(step_time=0.1)
    plan = FaultPlan().pause_daemon("n2", seconds=3 * shape.lease_ttl, at_step=15)
    out = ChaosCluster(tmp_path, shape).run(plan)
    out.assert_all(sources=[{"local", "peer"}], reference=reference(shape),
                   # The standby's rank comes from a peer's RAM; when the returning node
                   # forces a second restart, that shard is local by then but still reported
                   # "peer" (ckpt_open says where the bytes came from).
                   must={"peer"})
    kinds = {(e["kind"], e["node"]) for e in out.events}
    assert ("failed", "n2") in kinds and ("fenced", "n2") in kinds, kinds


def test_sigstop_daemon_without_standby_restores_the_committed_step(tmp_path):
    # No standby, so the job shrinks to the two live nodes and restores every shard of the
    # paused node from the one peer that holds it. This run once restored step 0 (a "fresh
    # start"): a step was committed naming a holder that had overwritten its copy (the commit
    # race, docs/replication.md); assert_steps_lost checks the committed step is restored.
    # 150 steps: the grow when n2 returns (6 s pause, then its rejoin) must come before the
    # job's end; at 60 steps the faster recovery let the job finish at world 2 first.
    shape = Shape(standby=(), nnodes="2:3", zero=False, steps=150, step_time=0.1)
    plan = FaultPlan().pause_daemon("n2", seconds=3 * shape.lease_ttl, at_step=15)
    out = ChaosCluster(tmp_path, shape).run(plan)
    # Two recoveries: the shrink to two nodes, and the grow when n2 comes back. Whether a
    # survivor keeps its rank (local) or takes the paused node's (peer) is torch's choice.
    out.assert_all(sources=[{"local", "peer"}, {"local", "peer"}])
