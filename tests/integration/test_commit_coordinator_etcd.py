"""The commit coordinator on a real etcd: three nodes (own etcd clients, replica servers and
shared-memory stores) snapshot a step every 50 ms; the node that coordinates the commits is
killed (nothing revoked, its election lease left to expire) and the survivors form the next
round at once. Commits resume within one lease TTL (plus etcd's expiry tick and an election),
no commit ever goes back or names a holder that lost its copy, and the whole job's etcd writes
per committed step stay at most two."""

from __future__ import annotations

import time

import pytest

from elasticd.replication.commit import decode_committed, read_committed
from tests.conftest import connect
from tests.replication_nodes import JOB, Cluster, Stepper

pytestmark = pytest.mark.etcd

TTL = 2


def coordinator(cluster: Cluster) -> str | None:
    for node in cluster.live():
        if node.replicator.tracker.reporter.leading(JOB) is not None:
            return node.name
    return None


@pytest.mark.timeout(90)
def test_killing_the_coordinator_costs_one_lease_ttl_and_no_wrong_commit(etcd, prefix):
    clients = []

    def client():
        clients.append(connect(etcd))
        return clients[-1]

    cluster = Cluster(client, 3, 2, prefix=prefix, lease_ttl=TTL)
    commits: list[tuple[int, int]] = []
    watcher = connect(etcd)
    key = cluster.keys.replication(JOB).committed
    writes = []

    def on_events(events):
        if isinstance(events, Exception):
            return
        for e in events:
            writes.append((time.monotonic(), e.kv.key, len(e.kv.value)))
            if e.kv.key == key and e.kv.value:
                commits.append(decode_committed(e.kv.value).version)

    watch = watcher.watch_prefix(cluster.keys.replication(JOB).ckpt, on_events, 0)
    try:
        three = {"n1": [0, 1], "n2": [2, 3], "n3": [4, 5]}
        cluster.set_membership(["n1", "n2", "n3"], three, round=1)
        with Stepper(cluster, three):
            time.sleep(2.0)
        assert commits, "nothing committed"
        # Per committed step: the commit and at most one ahead record (fences, withdrawals,
        # the grid and the round's placement are not per step).
        k = cluster.keys.replication(JOB)
        per_step = {k.committed, k.commit_ahead}
        steady = [w for w in writes if w[1] in per_step]
        # + 1: the first ahead record may come before the first commit (seen: 33 for 16)
        assert len(steady) <= 2 * len(set(commits)) + 1, \
            f"{len(steady)} writes for {len(set(commits))} commits"
        assert max(size for _, _, size in writes) <= 4096
        victim = coordinator(cluster)
        assert victim is not None
        before = len(commits)
        survivors = [n for n in ("n1", "n2", "n3") if n != victim]
        two = {survivors[0]: [0, 1, 2], survivors[1]: [3, 4, 5]}
        killed = time.monotonic()
        cluster.kill(victim)  # its election lease is left to expire
        cluster.set_membership(survivors, two, round=2)
        with Stepper(cluster, two) as stepper:
            stepper.step = 1024  # the new round's steps are newer (and on any grid)
            deadline = killed + TTL + 4
            while time.monotonic() < deadline and not any(
                    c[1] > 1024 for c in commits[before:]):
                time.sleep(0.02)
            resumed = time.monotonic() - killed
        print(f"commits resumed {resumed:.2f} s after the kill of {victim}")
        assert any(c[1] > 1024 for c in commits[before:]), "commits never resumed"
        # the lease expires TTL (+ up to 0.5 s: etcd's expiry tick) after its last keep-alive,
        # which was up to TTL/3 before the kill; then an election and one report per node
        assert resumed <= TTL + 1.5, f"commits resumed {resumed:.2f} s after the kill"
        assert coordinator(cluster) in survivors
        assert commits == sorted(commits), f"the committed step went back: {commits}"
        final = read_committed(cluster.coords[0], cluster.keys, JOB)
        for rank in final.ranks:
            for name in final.holders[rank]:
                node = cluster[name]
                assert (node.local.latest(JOB, rank, version=final.version)
                        or node.sink.store.latest(JOB, rank, version=final.version)), \
                    f"{name} is named a holder of rank {rank} {final.version} but lacks it"
    finally:
        watch.cancel()
        watcher.close()
        cluster.close()
