"""The chaos suite's failure-free reference, computed both ways, for every reference shape the
suite uses: a failure-free :class:`~tests.chaos.harness.ChaosCluster` run (real etcd, real
daemons, torchrun; what ``reference_weights`` was) and the job's script as plain gloo ranks
(``plain_reference``, what it is now). Records each one's seconds and whether the final
weights are equal bit for bit (they must be, for the plain run to stand in for the cluster's).

    python bench/chaos_reference.py --out bench/results/chaos_reference.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.chaos.harness import Shape, cluster_reference, plain_reference  # noqa: E402

#: Every distinct ``Shape.reference()`` of the chaos scenarios that pass ``reference=``.
SHAPES = {
    # test_kill_node, test_kill_worker, test_corrupt_replica, test_pause_daemon (with
    # standby), test_partition, test_node_departures (sigterm), test_etcd_faults
    "3 nodes, 50 steps, zero": Shape(),
    # test_drain
    "3 nodes, 150 steps, zero": Shape(steps=150),
    # test_kill_group
    "4 nodes, 50 steps, zero": Shape(nodes=("n1", "n2", "n3", "n4"), standby=(), nnodes="4:4"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="chaos-reference-") as tmp:
        for i, (name, shape) in enumerate(SHAPES.items()):
            t0 = time.monotonic()
            cluster = cluster_reference(shape, os.path.join(tmp, f"cluster-{i}"))
            t1 = time.monotonic()
            plain = plain_reference(shape.reference(), os.path.join(tmp, f"plain-{i}"))
            t2 = time.monotonic()
            a = torch.load(cluster, weights_only=True)
            b = torch.load(plain, weights_only=True)
            equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            rows.append({"shape": name, "cluster_seconds": round(t1 - t0, 1),
                         "plain_seconds": round(t2 - t1, 1), "bitwise_equal": equal,
                         "tensors": len(a)})
            print(json.dumps(rows[-1]), flush=True)
    doc = {"command": "python bench/chaos_reference.py --out " + (args.out or "-"),
           "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
