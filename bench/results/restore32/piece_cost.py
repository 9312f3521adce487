"""What one fetch request costs beside its bytes: the same 385 MiB snapshot (1 MiB blocks,
tags kept by its two holders, as a push leaves them) fetched whole by ``fetch_shard`` from two
holder processes in pieces of 4 MiB (~96 requests) and of 64 MiB (~6), interleaved, CPU
seconds of this process (the fetching daemon's part) and of the holders (/proc), median of
``--repeat`` rounds each. (cost(4 MiB) - cost(64 MiB)) / (requests(4) - requests(64)) is the
CPU one request adds. Run under the CPU lock from bench/ (imports the bench's holder)::

    cd bench && python results/restore32/piece_cost.py --repeat 7
"""

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import time
import uuid

sys.path.insert(0, ".")
from bench_sharded_restore import SECRET, cpu_seconds, holder  # noqa: E402
from bench_stripe import JOB, RANK, sealed_snapshot  # noqa: E402
from elasticd.clock import SystemClock  # noqa: E402
from elasticd.recovery.fetch import fetch_shard  # noqa: E402
from elasticd.replication.lanes import Connections  # noqa: E402
from elasticd.replication.seal import BlockTagger  # noqa: E402
from elasticd.replication.transport import ReplicaClient  # noqa: E402
from elasticd.snapshot.reader import parse_header  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=385)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    root = f"/dev/shm/elasticd-bench-piececost-{uuid.uuid4().hex[:10]}"
    ctx = mp.get_context("fork")
    pipes, procs, book = [], [], {}
    for i in range(2):
        a, b = ctx.Pipe()
        p = ctx.Process(target=holder, args=(b, f"h{i}", f"{root}/h{i}"), daemon=True)
        p.start()
        book[f"h{i}"] = a.recv()
        pipes.append(a)
        procs.append(p)
    rows = {}
    try:
        d, snap = sealed_snapshot(args.mib << 20)
        lay = parse_header(snap).layout
        tags = BlockTagger(SECRET).tag(snap, [lay.block_range(i) for i in range(lay.num_blocks)])
        for name in book:
            with ReplicaClient.connect(*book[name], SECRET, "pusher", timeout=60.0) as c:
                c.push(d, snap[: d.header_bytes], snap[d.header_bytes :], tags=tags)
        del snap
        buf = bytearray(d.total_bytes)
        buf[:] = bytes(len(buf))  # faulted in once
        pool = Connections("restorer", SECRET, book.get, timeout=60.0)
        for rnd in range(args.repeat + 1):
            for mib in ((4, 64) if rnd % 2 else (64, 4)):
                cpu, held = time.process_time(), sum(cpu_seconds(p.pid) for p in procs)
                got = fetch_shard(JOB, RANK, d.version, buf, me="restorer", holders=list(book),
                                  connections=pool, own=(), clock=SystemClock(),
                                  stripe_bytes=mib << 20)
                own = time.process_time() - cpu
                hs = sum(cpu_seconds(p.pid) for p in procs) - held
                if rnd:
                    rows.setdefault(mib, []).append((own, hs, got.tag_checked_bytes))
        pool.close()
    finally:
        for a in pipes:
            a.send("stop")
        for p in procs:
            p.join(10)
        shutil.rmtree(root, ignore_errors=True)
    payload = lay.total_size - lay.data_offset
    out = {"command": "cd bench && python results/restore32/piece_cost.py " + " ".join(sys.argv[1:]),
           "snapshot_bytes": d.total_bytes, "block_size": lay.block_size}
    for mib, r in sorted(rows.items()):
        out[f"{mib} MiB pieces"] = {
            "requests": -(-payload // (mib << 20)),
            "fetcher_cpu_s": round(statistics.median(x[0] for x in r), 4),
            "holders_cpu_s": round(statistics.median(x[1] for x in r), 4),
            "fetcher_runs": [round(x[0], 4) for x in r], "holders_runs": [round(x[1], 4) for x in r],
            "tag_checked": r[0][2]}
    a, b = out["4 MiB pieces"], out["64 MiB pieces"]
    n = a["requests"] - b["requests"]
    out["per_request_ms"] = {"fetcher": round(1e3 * (a["fetcher_cpu_s"] - b["fetcher_cpu_s"]) / n, 3),
                             "holders": round(1e3 * (a["holders_cpu_s"] - b["holders_cpu_s"]) / n, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
