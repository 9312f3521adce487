"""Failure detection latency: kill -9 one of three daemons, time until a survivor records it.

Baseline: the lease TTL itself (detection can never beat it: the victim's last keep-alive may
have been sent just before the kill). Each run starts a fresh cluster on a fresh etcd.

    .venv/bin/python bench/bench_detection.py --runs 10 --ttl 2 --out bench/results/detection.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from elasticd.launcher import LocalCluster


def one_run(ttl: int, victim: str, workdir: str, nodes: int = 3) -> float:
    cluster = LocalCluster([f"n{i + 1}" for i in range(nodes)], workdir=workdir, lease_ttl=ttl)
    try:
        cluster.start()
        time.sleep(1.0 + (hash(workdir) % 1000) / 1000 * ttl / 3)  # random keep-alive phase
        killed = time.time()
        cluster.nodes[victim].kill()
        ev = cluster.wait_for(lambda: [e for e in cluster.events()
                                       if e["kind"] == "failed" and e["node"] == victim],
                              ttl + 20, "failure event", interval=0.01)[0]
        return ev["at"] - killed
    finally:
        cluster.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--ttl", type=int, default=2)
    p.add_argument("--nodes", type=int, default=3, help="daemons (one is killed), at least 2")
    p.add_argument("--out", default="bench/results/detection.json")
    args = p.parse_args()
    latencies = []
    for i in range(args.runs):
        victim = f"n{i % args.nodes + 1}"
        with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as d:
            lat = one_run(args.ttl, victim, d, args.nodes)
        latencies.append(lat)
        print(f"run {i + 1}: killed {victim}, failure recorded after {lat:.3f} s", flush=True)
    result = {
        "benchmark": "failure_detection",
        "command": "bench/bench_detection.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "lease_ttl_seconds": args.ttl,
        "nodes": args.nodes,
        "baseline": {"name": "lease TTL", "seconds": args.ttl},
        "target_seconds": args.ttl + 1,
        "runs": len(latencies),
        "median_seconds": round(statistics.median(latencies), 3),
        "worst_seconds": round(max(latencies), 3),
        "best_seconds": round(min(latencies), 3),
        "latencies_seconds": [round(x, 3) for x in latencies],
        "within_target": sum(1 for x in latencies if x <= args.ttl + 1),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "latencies_seconds"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
