"""The local demo: an embedded etcd and three daemons on this host; one is killed with SIGKILL
and the survivors' detection of it is shown with its latency. It ends by itself and cleans up.

Run it with ``python -m elasticd.demo`` (README: the first set-up command does this for you).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

from elasticd.cli.main import NODE_TABLE, EVENT_TABLE
from elasticd.launcher import LocalCluster


def _say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:6.2f} s] {text}", flush=True)


def _rows(cluster: LocalCluster) -> list[dict]:
    now = time.time()
    return [{**r, "heartbeat_age_seconds": round(now - r["heartbeat_at"], 1)}
            for r in cluster.node_records().values()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticd.demo", description=__doc__)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--lease-ttl", type=int, default=2)
    p.add_argument("--victim", default="n2")
    p.add_argument("--keep", action="store_true", help="keep logs (default: print and delete)")
    args = p.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="elasticd-demo-")
    names = [f"n{i + 1}" for i in range(args.nodes)]
    cluster = LocalCluster(names, workdir=workdir, lease_ttl=args.lease_ttl)
    t0 = time.monotonic()
    try:
        _say(t0, f"starting etcd and {args.nodes} daemons (lease TTL {args.lease_ttl} s); "
                 f"logs in {workdir}")
        cluster.start()
        _say(t0, f"all {args.nodes} daemons registered; etcd at {cluster.etcd}")
        print(NODE_TABLE.render(_rows(cluster)), flush=True)
        time.sleep(1.0)

        victim = cluster.nodes[args.victim]
        _say(t0, f"kill -9 {args.victim} (pid {victim.pid}) and everything it runs")
        killed_wall = time.time()
        victim.kill()

        failed = cluster.wait_for(
            lambda: [e for e in cluster.events() if e["kind"] == "failed"
                     and e["node"] == args.victim], args.lease_ttl + 10, "the failure record")[0]
        latency = failed["at"] - killed_wall
        _say(t0, f"{failed['by']} recorded the failure of {args.victim} {latency:.2f} s after "
                 f"the kill (lease TTL {args.lease_ttl} s)")
        survivors = [n for n in names if n != args.victim]
        for n in survivors:
            st = cluster.wait_for(
                lambda n=n: (s := cluster.nodes[n].http("/status")) and
                args.victim not in {q["node"] for q in s["peers"]} and s, 5, f"{n}'s view")
            _say(t0, f"{n} says: {st['sentence']}")
        print(NODE_TABLE.render(_rows(cluster)), flush=True)
        print("\nevents:\n" + EVENT_TABLE.render(
            [{**e, "at_iso": time.strftime("%H:%M:%S", time.localtime(e["at"]))}
             for e in cluster.events()]), flush=True)
        metrics_url = f"http://{cluster.nodes[survivors[0]].address}/metrics"
        _say(t0, f"metrics were at {metrics_url}; stopping the cluster")
        return 0
    finally:
        cluster.stop()
        if args.keep:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        _say(t0, "done: every daemon and etcd stopped")


if __name__ == "__main__":
    sys.exit(main())
