"""The per-step commit's etcd writes with real daemons: 3 elasticd nodes on one etcd training
examples/train.py (DDP, gloo, one worker per node, a snapshot every 20 ms step, m = 2).

Once every node trains at world size 3, for ``--window`` seconds: every write under the job's
``ckpt/`` prefix is recorded through a watch (key, size, revision), with the committed step at
the start and the end. Prints one JSON object. Runs against whichever elasticd is first on
``sys.path`` (``bench_commit_scale.py --daemons`` runs it for this tree and a base tree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.launcher import JOB_USER, LocalCluster
from elasticd.replication.commit import read_committed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["elasticd"].__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--step-time", type=float, default=0.02)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="commit-daemons-") as d:
        os.chmod(d, 0o755)
        c = LocalCluster(["n1", "n2", "n3"], workdir=d, lease_ttl=2, replication=True)
        try:
            c.start()
            env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
            subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "job",
                            "--nnodes", "3:3", "--nproc-per-node", "1", "--user", JOB_USER,
                            "--", TRAIN, "--steps", "1000000", "--step-time",
                            str(a.step_time)], env=env, check=True, capture_output=True,
                           timeout=60)
            keys = Keyspace(c.prefix)
            coord = EtcdCoordinator(EtcdSettings(parse_endpoints(c.etcd), timeout=5.0))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                got = read_committed(coord, keys, "job")
                if got is not None and got.step > 20:
                    break
                time.sleep(0.2)
            else:
                raise SystemExit("nothing committed in 120 s")
            events: list[tuple[bytes, int, int]] = []
            lock = threading.Lock()

            def on_events(batch):
                if isinstance(batch, Exception):
                    return
                with lock:
                    events.extend((e.kv.key, len(e.kv.value), e.kv.mod_revision) for e in batch)

            _, rev0 = coord.get_prefix(keys.replication("job").ckpt)
            watch = coord.watch_prefix(keys.replication("job").ckpt, on_events, rev0 + 1)
            c0 = read_committed(coord, keys, "job").step
            time.sleep(a.window)
            c1 = read_committed(coord, keys, "job").step
            rev1 = coord.revision()
            watch.cancel()
            with lock:
                evs = list(events)
            commits = len({r for k, _, r in evs if k == keys.replication("job").committed})
            revisions = len({r for _, _, r in evs})
            sizes = [s for _, s, _ in evs]
            print(json.dumps({
                "nodes": 3, "window_s": a.window, "step_time_s": a.step_time,
                "committed_steps_advanced": c1 - c0, "commit_writes": commits,
                "ckpt_write_revisions": revisions, "ckpt_keys_written": len(evs),
                "etcd_revisions_total": rev1 - rev0,
                "writes_per_committed_step": round(revisions / commits, 3) if commits else None,
                "keys_per_committed_step": round(len(evs) / commits, 3) if commits else None,
                "bytes_per_write_max": max(sizes, default=0),
                "bytes_per_write_median": statistics.median(sizes) if sizes else 0,
                "keys": sorted({k.decode().rsplit("/ckpt/", 1)[1] for k, _, _ in evs}),
            }))
            coord.close()
        finally:
            c.stop()


if __name__ == "__main__":
    main()
