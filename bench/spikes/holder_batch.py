"""Spike (issue 30, restore40): does a holder spend less CPU on a fetch when it builds every
frame's prefix first and then sends the frames back to back, instead of building each between
two multi-MiB ``sendmsg`` calls (where its Python may run with cold caches: restore39's
~35 ms/GiB of interpreter samples on the serving thread)?

The holder process (``bench_peer_restore.py``'s, 1 GiB in 300 tensors) gets a ``send_runs``
that reads a flag file on each call: ``a`` runs the product's ``send_runs``, ``b`` has the
product's ``send_runs`` record its frames, builds every prefix (the runs', and the untagged
header's DATA prefix) in one pass, then sends. Fetches alternate
a/b, ``N`` pairs, the holder's CPU read around each::

    cpulock python bench/spikes/holder_batch.py 40
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_peer_restore as b  # noqa: E402  (pins the code tree before elasticd)
from proc_cpu import cpu_seconds  # noqa: E402

import elasticd.replication.channel as channel_module  # noqa: E402
import elasticd.replication.runs as runs  # noqa: E402
from elasticd.replication.messages import data_prefix, run_prefix  # noqa: E402

#: Which way the holder sends the next fetch: "a" (the product's) or "b" (prefixes first).
FLAG = f"/tmp/elasticd-holder-batch-{os.getpid()}"
PRODUCT = runs.send_runs


class _Frames:
    """A :class:`~elasticd.replication.runs.RunSender` that keeps the frames the product's
    ``send_runs`` asks for instead of sending them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def send_run(self, offset: int, blocks: list) -> None:
        self.calls.append(("run", offset, blocks))

    def send_data(self, offset: int, chunk) -> None:
        self.calls.append(("data", offset, chunk))


def send_runs(channel, pieces, tags, chunk: int, max_frame: int) -> int:
    """The product's ``send_runs`` when the flag says "a"; when it says "b", the same frames
    (the product's grouping, recorded), every prefix built before the first is sent."""
    with open(FLAG) as f:
        if f.read().strip() != "b":
            return PRODUCT(channel, pieces, tags, chunk, max_frame)
    kept = _Frames()
    count = PRODUCT(kept, pieces, tags, chunk, max_frame)
    # As Channel.send_run and Channel.send_data build them, in the same order (the session
    # key's sequence numbers are taken in the order the frames go).
    frames = [(run_prefix(at, [(len(c), t) for t, c in part], channel.send_key),
               *(c for _, c in part)) if kind == "run"
              else (data_prefix(at, part, channel.send_key), part)
              for kind, at, part in kept.calls]
    for parts in frames:
        channel._send(*parts)
    return count


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    channel_module.send_runs = send_runs  # the holder, forked below, sends with it
    with open(FLAG, "w") as f:
        f.write("a")
    sizes = b.tensor_sizes(1024 << 20, 300)
    root = f"/dev/shm/elasticd-batch-{uuid.uuid4().hex[:8]}"
    pipe, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=b.peer, args=(child, root, sizes), daemon=True)
    proc.start()
    rep = None
    cpu: dict[str, list[float]] = {"a": [], "b": []}
    wall: dict[str, list[float]] = {"a": [], "b": []}
    try:
        address, raw_port, total = pipe.recv()
        rep = b.restorer(root, address)
        buf = b.touched(total)
        rep.fetch(b.JOB, b.RANK, (0, 1), buf)
        for i in range(pairs):
            for way in (("a", "b") if i % 2 == 0 else ("b", "a")):
                with open(FLAG, "w") as f:
                    f.write(way)
                before, start = cpu_seconds(proc.pid), time.perf_counter()
                rep.fetch(b.JOB, b.RANK, (0, 1), buf)
                wall[way].append(time.perf_counter() - start)
                cpu[way].append(cpu_seconds(proc.pid) - before)
        with socket.create_connection(("127.0.0.1", raw_port)) as raw:
            raw.sendall(b"q")  # the holder's raw server ends, then the holder
    finally:
        if rep is not None:
            rep.close()
            rep.store.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(f"{root}-restorer", ignore_errors=True)
        os.unlink(FLAG)
    for way in cpu:
        print(way, "holder cpu med", round(statistics.median(cpu[way]), 4), "wall med",
              round(statistics.median(wall[way]), 4))
    print("b lower cpu in", sum(y < x for x, y in zip(cpu["a"], cpu["b"])), "of", pairs,
          "; paired cpu ratio", round(statistics.median(y / x for x, y in zip(cpu["a"],
                                                                              cpu["b"])), 3),
          "wall ratio", round(statistics.median(y / x for x, y in zip(wall["a"], wall["b"])), 3))


if __name__ == "__main__":
    main()
