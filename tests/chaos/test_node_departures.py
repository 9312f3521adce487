"""A node leaves and comes back: SIGTERM (a clean departure: the standby takes its place), and a
node killed then restarted (the job shrinks to two nodes, then grows back to three)."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_sigterm_node_leaves_cleanly_and_the_standby_takes_over(tmp_path, reference):
    shape = Shape()
    out = ChaosCluster(tmp_path, shape).run(FaultPlan().sigterm_node("n2", at_step=20))
    out.assert_all(sources=[{"local", "peer"}], reference=reference(shape),
                   must={"peer"})
    assert out.cc.node("n2").proc.returncode == 0, "the daemon did not exit cleanly on SIGTERM"
    assert any(e["kind"] == "left" and e["node"] == "n2" for e in out.events), (
        "n2's departure was not recorded as such")
    assert not any(e["kind"] == "failed" and e["node"] == "n2" for e in out.events), (
        "a clean departure was recorded as a failure")


def test_node_rejoins_and_the_world_size_comes_back(tmp_path):
    # The state is replicated across ranks (no ZeRO), so it restores at another world size.
    # Slow steps leave the restarted node time to join before the job ends (it joins once its
    # zygote has imported torch: at 60 steps it grew back at step 40 in CI).
    shape = Shape(standby=(), nnodes="2:3", zero=False, steps=80, step_time=0.2)
    plan = FaultPlan().kill_node("n3", at_step=12).restart_node("n3", at_step=16)
    out = ChaosCluster(tmp_path, shape).run(plan)
    out.assert_finished()
    out.assert_samples_exactly_once()
    out.assert_nothing_left()
    assert [a.world for a in out.attempts] == [3, 2, 3], out.summary()
    shrink, grow = out.recoveries
    assert set(shrink.sources.values()) <= {"local", "peer"}, out.summary()
    assert shrink.step == shrink.committed, out.summary()
    # The step committed by 2 ranks is restored by 3 (the new rank loads a copy of an old
    # rank's shard): before, the job started over from step 0 when the node rejoined.
    assert grow.step >= shrink.step + 1, out.summary()
    out.assert_steps_lost()
    out.assert_sources({"local", "peer"}, {"local", "peer"})
