"""restore44: elasticd's fetch under the receive mark, many times over, watching for a stall.

The peer bench's holder process (bench_peer_restore.peer) holds --mib MiB; this process
fetches it --fetches times through a Replicator (the product's channel, marked) and records
each fetch's seconds. A stall shows as a fetch near the channel's timeout. Run as:
    PYTHONPATH=. /work/wt/cpulock python bench/results/restore44/stress.py --out F.json
"""

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench_peer_restore as b  # noqa: E402  (pins the tree on PYTHONPATH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--fetches", type=int, default=300)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    sizes = b.tensor_sizes(args.mib << 20, 100)
    root = f"/dev/shm/elasticd-stress-{uuid.uuid4().hex[:8]}"
    pipe, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=b.peer, args=(child, root, sizes), daemon=True)
    proc.start()
    replicator = raw = None
    times = []
    try:
        address, raw_port, total = pipe.recv()
        replicator = b.restorer(root, address)
        raw = b.socket.create_connection(("127.0.0.1", raw_port))  # the holder waits for it
        buf = b.touched(total)
        for _ in range(args.fetches):
            start = time.perf_counter()
            result = replicator.fetch(b.JOB, b.RANK, (0, 1), buf)
            times.append(time.perf_counter() - start)
            assert result.holder == "peer" and result.wire_bytes >= total
    finally:
        if raw is not None:
            raw.close()
        if replicator is not None:
            replicator.close()
            replicator.store.close()
        proc.join(30)
        shutil.rmtree(root, ignore_errors=True)
    summary = {"mib": args.mib, "fetches": len(times), "median_s": round(statistics.median(times), 4),
               "max_s": round(max(times), 4), "over_1s": sum(t > 1.0 for t in times),
               "code": b.code_tree.describe()}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary, seconds=[round(t, 4) for t in times]), f, indent=1)


if __name__ == "__main__":
    main()
