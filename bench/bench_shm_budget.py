"""Shared memory a replicated node holds, beside the budget formula in docs/operations.md.

A 3-node LocalCluster with peer replication (m = 2) trains examples/train.py (one rank per
node) until every node has committed steps; each node's /metrics then gives the bytes of its
latest snapshot (S), of its own slot files and of the replicas it holds. The baseline is the
formula: own slots 2 x S (double-buffered), replicas 2 x (m - 1) x S (two newest copies), each
rounded up to whole pages per slot.

    PYTHONPATH=. .venv/bin/python bench/bench_shm_budget.py --out bench/results/shm_budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from elasticd.launcher import JOB_USER, LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "examples", "train.py")
PAGE = os.sysconf("SC_PAGE_SIZE")
NAMES = ("elasticd_snapshot_bytes", "elasticd_local_slot_bytes", "elasticd_replica_bytes_held",
         "elasticd_committed_step", "elasticd_replication_seconds_count",
         "elasticd_replication_seconds_sum")


def value(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    if m is None:
        raise SystemExit(f"{name} missing from /metrics")
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--commits", type=int, default=20, help="committed steps to wait for")
    p.add_argument("--out", default="bench/results/shm_budget.json")
    args = p.parse_args()
    m = 2
    workdir = tempfile.mkdtemp(prefix="bench-shm-budget-")
    c = LocalCluster(["n1", "n2", "n3"], workdir=workdir, lease_ttl=2, replication=True)
    nodes = {}
    try:
        c.start()
        env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
        subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "job", "--nnodes",
                        "3:3", "--nproc-per-node", "1", "--user", JOB_USER, "--", TRAIN,
                        "--steps", "100000", "--step-time", "0.05"], env=env, check=True,
                       capture_output=True, timeout=60)
        c.wait_for(lambda: all(value(c.nodes[n].http("/metrics"), "elasticd_committed_step")
                               > args.commits for n in c.nodes), 180, "committed steps")
        time.sleep(1)
        for n in c.nodes:
            text = c.nodes[n].http("/metrics")
            nodes[n] = {k: value(text, k) for k in NAMES}
    finally:
        c.stop()
    results = {}
    for n, v in nodes.items():
        s = v["elasticd_snapshot_bytes"]
        slot = -(-int(s) // PAGE) * PAGE
        results[n] = {
            "snapshot_bytes": int(s),
            "own_slot_bytes": int(v["elasticd_local_slot_bytes"]),
            "replica_bytes": int(v["elasticd_replica_bytes_held"]),
            "formula_own_slot_bytes": 2 * slot,
            "formula_replica_bytes": 2 * (m - 1) * slot,
            "push_seconds_mean": round(v["elasticd_replication_seconds_sum"]
                                       / max(1, v["elasticd_replication_seconds_count"]), 5),
        }
    out = {"benchmark": "shm_budget", "command": "bench/bench_shm_budget.py --out " + args.out,
           "m": m, "nodes": results}
    print(json.dumps(out, indent=2))
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
