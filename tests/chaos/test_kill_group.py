"""Four nodes, m = 2: kill -9 both nodes of one replica group. Every copy of their shards is
gone, so recovery comes from the persistent tier, and says so; the nodes come back as
replacements with empty RAM and the job resumes at world size 4."""

from __future__ import annotations

import re

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_kill9_replica_group_recovers_from_the_persistent_tier(tmp_path, reference):
    shape = Shape(nodes=("n1", "n2", "n3", "n4"), standby=(), nnodes="4:4", persist_every=5)
    plan = FaultPlan().kill_group(at_step=22).restart_node(after=1.0)
    out = ChaosCluster(tmp_path, shape).run(plan)
    # The lost shards come from the tier; when the committed step is the persisted one, the
    # other ranks' shards of that same step may come from RAM (a peer's, for a rank torch gave
    # to a restarted node): one step on every rank either way.
    out.assert_all(sources=[{"persistent", "peer", "local"}], must=["persistent"],
                   reference=reference(shape))
    text = "".join(out.log_text(n) for n in out.cc.nodes)
    assert "lost in every peer's RAM" in text, "the workers did not say the shard was lost"
    # The daemons count it: restores from the persistent tier.
    assert re.search(r'elasticd_restores_total\{source="persistent"\} [1-9]',
                     "".join(out.metrics.values())), "no restore from the tier was counted"
