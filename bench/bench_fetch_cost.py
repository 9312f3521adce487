"""Where a daemon's fetch of one shard for a restore spends its time: the steps of
:func:`~elasticd.recovery.fetch.fetch_into_store` (what ``ckpt_fetch`` runs for a shard
not held here) and of the ``ckpt_open`` that follows, each timed apart, wall and CPU.

Two holder processes (ShmSink replicas behind ReplicaServers, as in
``bench_sharded_restore.py``) hold a sealed snapshot of ``--mib`` MiB. Each round, into a fresh
:class:`SlotStore` (a node that does not hold the job yet, as after a failure):

* ``reserve``: ``SlotStore.reserve`` of a slot for it, as ``fetch_into_store`` does: one slot,
  ``fallocate``d and pre-touched (``--both-slots``: both double-buffer slots of a new (job,
  rank), what it did before, for the comparison);
* ``striped fetch``: :func:`fetch_shard` from both holders into the slot (every piece's blocks
  checked as they land, the whole copy verified at the end);
* ``complete``: ``SlotStore.complete`` (the copy becomes a local snapshot);
* ``open, verified``: ``SlotStore.latest(pin=True, verify=True)``, what ``ckpt_open`` does.

Reported per step: wall seconds, this process's CPU seconds, the holders' CPU seconds
(medians of ``--repeat`` rounds). Run under the CPU lock::

    flock /tmp/elasticd-cpu.lock python bench/bench_fetch_cost.py --mib 367 \
        --out bench/results/fetch_cost.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import time
import uuid

from bench_sharded_restore import SECRET, cpu_seconds, holder
from bench_stripe import JOB, RANK, sealed_snapshot
from elasticd.snapshot.reader import parse_header
from elasticd.store.shm import SlotStore
from elasticd.clock import SystemClock
from elasticd.replication.lanes import Connections
from elasticd.recovery.fetch import fetch_shard
from elasticd.replication.transport import ReplicaClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=367, help="MiB of snapshot")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (median)")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--both-slots", action="store_true",
                        help="reserve both double-buffer slots (what fetches did before)")
    args = parser.parse_args()
    root = f"/dev/shm/elasticd-bench-fetchcost-{uuid.uuid4().hex[:10]}"
    ctx = mp.get_context("fork")
    pipes, procs, book = [], [], {}
    for i in range(2):
        a, b = ctx.Pipe()
        p = ctx.Process(target=holder, args=(b, f"h{i}", f"{root}/h{i}"), daemon=True)
        p.start()
        book[f"h{i}"] = a.recv()
        pipes.append(a)
        procs.append(p)
    steps: dict[str, list[tuple[float, float, float]]] = {}
    try:
        d, snap = sealed_snapshot(args.mib << 20)
        for name in book:
            with ReplicaClient.connect(*book[name], SECRET, "pusher", timeout=60.0) as c:
                c.push(d, snap[: d.header_bytes], snap[d.header_bytes :])
        del snap
        pool = Connections("restorer", SECRET, book.get, timeout=60.0)

        def timed(name, fn):
            wall, cpu = time.perf_counter(), time.process_time()
            held = sum(cpu_seconds(p.pid) for p in procs)
            result = fn()
            steps.setdefault(name, []).append((
                time.perf_counter() - wall, time.process_time() - cpu,
                sum(cpu_seconds(p.pid) for p in procs) - held))
            return result

        for rnd in range(args.repeat + 1):  # the first round connects: not counted
            store = SlotStore(f"{root}/local{rnd}")
            try:
                slot = timed("reserve", lambda: store.reserve(JOB, RANK, d.total_bytes,
                                                              both=args.both_slots))
                timed("striped fetch", lambda: fetch_shard(
                    JOB, RANK, d.version, slot.buffer, me="restorer",
                    holders=["restorer", *book], connections=pool, own=(),
                    clock=SystemClock()))
                header = parse_header(slot.buffer, job=JOB, rank=RANK)
                timed("complete", lambda: store.complete(slot, header))
                view = timed("open, verified",
                             lambda: store.latest(JOB, RANK, pin=True, verify=True))
                view.release()
            finally:
                store.close()
            if rnd == 0:
                steps.clear()
        pool.close()
    finally:
        for a in pipes:
            a.send("stop")
        for p in procs:
            p.join(10)
        shutil.rmtree(root, ignore_errors=True)
    results = {name: {"wall_seconds": round(statistics.median(r[0] for r in rows), 4),
                      "own_cpu_seconds": round(statistics.median(r[1] for r in rows), 4),
                      "holders_cpu_seconds": round(statistics.median(r[2] for r in rows), 4)}
               for name, rows in steps.items()}
    out = {"benchmark": "fetch_cost",
           "command": " ".join(["bench/bench_fetch_cost.py", *sys.argv[1:]]),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "platform": platform.platform()},
           "mib": args.mib, "snapshot_bytes": d.total_bytes, "holders": len(book),
           "repeat": args.repeat, "results": results}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
