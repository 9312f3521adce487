"""A replica corrupted in a peer's memory: the owner dies, the only other copy of its shard has
a flipped byte. It is detected by its block tag (or checksum) and never loaded; the persistent
tier is used."""

from __future__ import annotations

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


def test_corrupt_replica_is_refused_and_the_tier_used(tmp_path, reference):
    # The kill must land before the next persisted step (30): were the tier's newest step
    # newer than the committed one in RAM, the restore would rightly take it from the tier
    # for every rank and never read the corrupt copy (CI once: the kill asked at step 22
    # landed after step 25 was persisted, with persist_every=5).
    shape = Shape(persist_every=10)
    plan = FaultPlan().kill_node("n2", at_step=22).corrupt_replicas("n2")
    out = ChaosCluster(tmp_path, shape).run(plan)
    # The dead node's shard comes from the tier. The survivors' shards of the same step may
    # come from RAM (theirs, or a peer's when torch gave a survivor another rank) when the
    # committed step is the persisted one: one step on every rank either way.
    out.assert_all(sources=[{"persistent", "peer", "local"}], must=["persistent"],
                   reference=reference(shape))
    text = "".join(out.log_text(n) for n in out.cc.nodes)
    # A replica that came by a push keeps its owner's block tags and is served with them
    # (protocol v5, in runs since v6): the flipped byte fails its block tag as it lands, before any checksum
    # pass; a copy adopted after a restart has no tags and fails its checksum instead.
    assert "fails its block tag" in text or "checksum" in text, \
        "no worker reported the corrupt copy"
