"""Striped restore: one snapshot fetched from several holders at once, each paced to a fixed
rate, against the same snapshot fetched from one of them.

Three holder processes (as three daemons would be) each hold the same sealed snapshot of
``--mib`` MiB in a :class:`~elasticd.testing.replication.MemorySink` behind a real
:class:`ReplicaServer`, and each serves fetches through a token bucket of ``--rate-mb`` MB/s
(1e6 bytes) shared by all its connections, well below loopback (~4 GB/s for one fetch here):
that is the only way to show on one host what striping buys across hosts, where each holder's
link or memory bandwidth is the limit. The bucket is bench-only: in each holder process the
server's ``send_spans`` is wrapped so that every DATA chunk waits for its tokens first.

This process restores with the product's recovery code, :func:`fetch_shard` (authenticated,
every frame tagged, each piece's blocks checked as they land, the whole copy verified at the
end), into a preallocated, pre-touched buffer, in the same run:

* ``striped, N holders``: every holder at once (the figure);
* ``1 holder, striped code``: the same code given one holder (pieces one after another);
* ``1 holder, whole FETCH``: one whole-snapshot FETCH, the path before striping (baseline).

It reports each one's GB/s, and the striped rate over the sum of the holders' nominal rates
(target >= 0.8) and over N times the measured one-holder rate. Figures are medians of
``--repeat`` interleaved runs. Run under the CPU lock::

    flock /tmp/elasticd-cpu.lock python bench/bench_stripe.py --mib 1024 \
        --out bench/results/stripe.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time

import numpy as np

from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout, seal
from elasticd.snapshot.reader import parse_header, verify_payload
from elasticd.clock import SystemClock
from elasticd.replication import server as server_module
from elasticd.replication.api import Descriptor
from elasticd.replication.lanes import Connections
from elasticd.testing.replication import MemorySink
from elasticd.recovery.fetch import STRIPE_BYTES, fetch_shard
from elasticd.replication.transport import ReplicaClient, ReplicaServer

SECRET = b"bench-secret-0123456789abcdef"
JOB, RANK = "bench-stripe", 0
CHUNK = 1 << 20  # the holders' DATA chunk: the bucket's grain (5 ms at 200 MB/s)


class TokenBucket:
    """``rate`` bytes per second, at most ``burst`` bytes ahead; thread-safe."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait:
            time.sleep(wait)


class PacedChannel:
    """A server channel whose DATA chunks each wait for the bucket (everything else as is)."""

    def __init__(self, channel, bucket: TokenBucket) -> None:
        self._channel, self._bucket = channel, bucket

    def send_data(self, offset, chunk) -> None:
        self._bucket.take(len(chunk))
        self._channel.send_data(offset, chunk)

    def send_run(self, offset, blocks) -> None:
        self._bucket.take(sum(len(chunk) for _, chunk in blocks))
        self._channel.send_run(offset, blocks)

    def __getattr__(self, name):
        return getattr(self._channel, name)


def holder(conn, index: int, rate: float) -> None:
    """A holder process: a ReplicaServer whose fetches are paced to ``rate`` bytes/s."""
    bucket = TokenBucket(rate, CHUNK)
    real = server_module.send_spans

    def paced_send_spans(channel, spans, chunk, tags=None, max_frame=None):
        return real(PacedChannel(channel, bucket), spans, chunk, tags, max_frame)

    server_module.send_spans = paced_send_spans  # bench only: this process's server
    srv = ReplicaServer("127.0.0.1", 0, SECRET, f"h{index}", MemorySink(), idle_timeout=600.0,
                        chunk_size=CHUNK).start()
    conn.send(srv.address)
    conn.recv()  # until told to stop
    srv.stop()


def sealed_snapshot(nbytes: int) -> tuple[Descriptor, bytearray]:
    n = nbytes // 4
    lay = layout([TensorSpec("state", "float32", (n,))], job=JOB)
    buf = bytearray(lay.total_size)
    e = lay.entries[0]
    np.frombuffer(buf, np.float32, n, e.offset)[:] = np.random.default_rng(0).random(
        n, dtype=np.float32)
    seal(buf, SnapshotHeader(JOB, 7, 0, RANK, 3, lay, {"step": 7}))
    d = Descriptor(JOB, RANK, 0, 7, lay.total_size, lay.data_offset)
    return d, buf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB of snapshot")
    parser.add_argument("--holders", type=int, default=3, help="holder processes")
    parser.add_argument("--rate-mb", type=float, default=200.0,
                        help="each holder's pace, MB/s (1e6 bytes)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per variant (median)")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    rate = args.rate_mb * 1e6

    ctx = mp.get_context("fork")  # before the snapshot exists: the holders do not inherit it
    pipes, procs = [], []
    for i in range(args.holders):
        a, b = ctx.Pipe()
        p = ctx.Process(target=holder, args=(b, i, rate), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    book = {f"h{i}": a.recv() for i, a in enumerate(pipes)}
    names = list(book)
    try:
        d, snap = sealed_snapshot(args.mib << 20)
        for name in names:  # replicate it to every holder (pushes are not paced)
            with ReplicaClient.connect(*book[name], SECRET, "pusher", timeout=60.0) as c:
                c.push(d, snap[: d.header_bytes], snap[d.header_bytes :])
        into = bytearray(d.total_bytes)
        into[:] = b"\x01" * len(into)  # pre-touched
        pool = Connections("restorer", SECRET, book.get, timeout=60.0)

        def striped(holders: list[str]) -> float:
            into[: d.header_bytes] = bytes(d.header_bytes)
            t0 = time.perf_counter()
            result = fetch_shard(JOB, RANK, d.version, into, me="restorer",
                                 holders=["restorer", *holders], connections=pool,
                                 own=(), clock=SystemClock())
            seconds = time.perf_counter() - t0
            assert result.descriptor == d and not result.attempts, result
            assert len(result.served) == len(holders), result.served
            return seconds

        def whole() -> float:
            into[: d.header_bytes] = bytes(d.header_bytes)
            t0 = time.perf_counter()
            client, _ = pool.get(names[0])
            got = client.fetch(JOB, RANK, into, d.version)
            header = parse_header(into, job=JOB, rank=RANK)
            verify_payload(into, header)  # end to end, as the recovery path does
            seconds = time.perf_counter() - t0
            assert got == d
            return seconds

        variants = {
            f"striped, {len(names)} holders": lambda: striped(names),
            "1 holder, striped code": lambda: striped(names[:1]),
            "1 holder, whole FETCH (before striping)": whole,
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeat):
            for name, run in variants.items():
                times[name].append(run())
                assert bytes(into) == bytes(snap), name
        pool.close()
    finally:
        for a in pipes:
            a.send("stop")
        for p in procs:
            p.join(10)

    gb = d.total_bytes / 1e9
    results = {k: {"seconds": round(statistics.median(v), 4),
                   "gb_per_s": round(gb / statistics.median(v), 4),
                   "runs": [round(x, 4) for x in v]} for k, v in times.items()}
    stripe_rate = results[f"striped, {len(names)} holders"]["gb_per_s"]
    one = results["1 holder, striped code"]["gb_per_s"]
    out = {
        "benchmark": "stripe",
        "command": " ".join(["bench/bench_stripe.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "mib": args.mib, "holders": len(names), "holder_rate_gb_per_s": rate / 1e9,
        "stripe_bytes": STRIPE_BYTES, "chunk_bytes": CHUNK, "repeat": args.repeat,
        "results": results,
        "striped_over_sum_of_holder_rates": round(stripe_rate / (len(names) * rate / 1e9), 3),
        "striped_over_n_times_one_holder_measured": round(stripe_rate / (len(names) * one), 3),
        "target": "striped >= 0.8 x the sum of the holders' rates",
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
