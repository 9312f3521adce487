"""The idle daemon's footprint: RSS and CPU of three idle daemons over a measurement window,
beside the same figures for the etcd they talk to and a bare `python -c 'import time; ...'`
interpreter (the floor any Python daemon pays).

    .venv/bin/python bench/bench_idle.py --seconds 60 --out bench/results/idle.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import psutil

from elasticd.launcher import LocalCluster


def sample(procs: list[psutil.Process], seconds: float) -> list[dict]:
    before = [p.cpu_times() for p in procs]
    time.sleep(seconds)
    out = []
    for p, b in zip(procs, before):
        a = p.cpu_times()
        cpu = (a.user + a.system - b.user - b.system) / seconds
        out.append({"rss_mib": round(p.memory_info().rss / 2**20, 1),
                    "cpu_percent_of_core": round(100 * cpu, 3)})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--ttl", type=int, default=5)
    p.add_argument("--nodes", type=int, default=3, help="idle daemons")
    p.add_argument("--loop-interval", type=float, default=1.0)
    p.add_argument("--out", default="bench/results/idle.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as d:
        cluster = LocalCluster([f"n{i + 1}" for i in range(args.nodes)], workdir=d,
                               lease_ttl=args.ttl, loop_interval=args.loop_interval)
        bare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        try:
            cluster.start()
            time.sleep(3)  # past start-up
            procs = [psutil.Process(n.pid) for n in cluster.nodes.values()]
            procs.append(psutil.Process(cluster.etcd_server.members[0].pid))
            procs.append(psutil.Process(bare.pid))
            s = sample(procs, args.seconds)
        finally:
            bare.kill()
            bare.wait()
            cluster.stop()
    daemons = s[: args.nodes]
    result = {
        "benchmark": "idle_daemon",
        "command": "bench/bench_idle.py " + " ".join(sys.argv[1:]),
        "window_seconds": args.seconds,
        "lease_ttl_seconds": args.ttl,
        "loop_interval_seconds": args.loop_interval,
        "daemons": daemons,
        "daemon_rss_mib_max": max(x["rss_mib"] for x in daemons),
        "daemon_cpu_percent_max": max(x["cpu_percent_of_core"] for x in daemons),
        "baselines": {"etcd": s[-2], "bare_python_interpreter": s[-1]},
        "targets": {"rss_mib": 150, "cpu_percent_of_core": 2},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
