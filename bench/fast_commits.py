"""How far the committed step falls behind on a very fast job (a known problem, not fixed).

Two simulated nodes (tests/replication_nodes.py: own shared-memory stores, own replica server on
127.0.0.1, in-memory etcd), one rank each, snapshot every step as the checkpoint service would
(a snapshot refused by a pending commit is skipped and reported), with the daemon's settings
(commit_wait 0). Prints the committed step, commits, withdrawals and snapshots taken. With
50 ms steps every step commits; with 1 ms steps the two nodes' acknowledged steps differ
(each pushes whatever is newest when its lane is free, and unblocks at its own time after a
withdrawal), so almost nothing is common to commit: the committed step stays far behind.

    PYTHONPATH=. flock /tmp/elasticd-cpu.lock .venv/bin/python bench/fast_commits.py --step-ms 1
"""

from __future__ import annotations

import argparse
import threading
import time

from elasticd.store.shm import CommitPending, SlotBusy
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.replication.commit import read_committed
from tests.replication_nodes import JOB, Cluster


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--commit-wait", type=float, default=0.0)
    a = p.parse_args()
    store = MemoryStore()
    cluster = Cluster(lambda: MemoryCoordinator(store), 2, 2, commit_wait=a.commit_wait,
                      withdraw_after=0.5)
    taken: dict[str, int] = {}

    def train(name: str, rank: int) -> None:
        node, n = cluster[name], 0
        for step in range(1, a.steps + 1):
            try:
                node.snapshot(rank, step, world=2)
                n += 1
            except CommitPending as exc:
                node.replicator.on_commit_pending(JOB, exc.version, skipped=(0, step))
            except SlotBusy:
                pass
            time.sleep(a.step_ms / 1e3)
        taken[name] = n

    try:
        cluster.set_membership(["n1", "n2"], {"n1": [0], "n2": [1]}, round=1)
        threads = [threading.Thread(target=train, args=(n, r)) for n, r in (("n1", 0), ("n2", 1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        committed = read_committed(cluster.coords[0], cluster.keys, JOB)
        stats = [cluster[n].replicator.stats() for n in ("n1", "n2")]
        print(f"{a.steps} steps of {a.step_ms} ms: committed step "
              f"{committed.step if committed else None}, commits "
              f"{sum(s.commits_total for s in stats)}, withdrawals "
              f"{[s.withdrawals_total for s in stats]}, snapshots taken {taken}")
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
