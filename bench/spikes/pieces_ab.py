"""Spike (issue 30, restore40): what do a one-holder fetch's pieces and its fixed requests cost?

restore39 named pipelining a striped fetch's piece requests (the next asked for before the
last has landed) as a possible gain for the peer-restore point: one holder's 1 GiB goes as 4
pieces (PIECES_PER_HOLDER), each a round trip while the holder's sender waits. This measures
the most pipelining could give: the same fetch in 4 pieces against 1 (``PIECES_PER_HOLDER``
set before each), beside the verified floor, and a fetch of one 1 MiB block (``select``: the
describe, header and one piece requests alone), in ``bench_peer_restore.py``'s set-up (a
holder process, 1 GiB in 300 tensors), interleaved, order turning each round::

    cpulock python bench/spikes/pieces_ab.py 12 > bench/results/restore40/pieces_ab.txt
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
import verified_floor  # noqa: E402

import elasticd.recovery.fetch as fetch_module  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    sizes = b.tensor_sizes(1024 << 20, 300)
    root = f"/dev/shm/elasticd-pieces-{uuid.uuid4().hex[:10]}"
    pipe, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=b.peer, args=(child, root, sizes), daemon=True)
    proc.start()
    rep = raw = None
    try:
        address, raw_port, total = pipe.recv()
        rep = b.restorer(root, address)
        raw = socket.create_connection(("127.0.0.1", raw_port))
        verified_floor.tune(raw)
        buf = b.touched(total)
        rep.fetch(b.JOB, b.RANK, (0, 1), buf)
        runs: dict[str, list[float]] = {"4 pieces": [], "1 piece": [], "floor": [],
                                        "one block": []}

        def pieces(n: int) -> float:
            fetch_module.PIECES_PER_HOLDER = n
            start = time.perf_counter()
            rep.fetch(b.JOB, b.RANK, (0, 1), buf)
            return time.perf_counter() - start

        def floor() -> float:
            start = time.perf_counter()
            raw.sendall(b"v")
            verified_floor.receive(raw, buf[:total])
            return time.perf_counter() - start

        def one_block() -> float:
            start = time.perf_counter()
            rep.fetch(b.JOB, b.RANK, (0, 1), buf, select=lambda header: [0])
            return time.perf_counter() - start

        ways = [("4 pieces", lambda: pieces(4)), ("1 piece", lambda: pieces(1)),
                ("floor", floor)]
        for i in range(rounds):
            for name, way in ways[i % 3:] + ways[: i % 3]:
                runs[name].append(way())
            runs["one block"].append(one_block())
    finally:
        fetch_module.PIECES_PER_HOLDER = 4
        if raw is not None:
            raw.close()
        if rep is not None:
            rep.close()
            rep.store.close()
        proc.join(30)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(f"{root}-restorer", ignore_errors=True)
    for name, v in runs.items():
        print(f"{name:10} median {statistics.median(v):.4f} s  runs "
              f"{[round(x, 3) for x in v]}")
    paired = statistics.median(a / c for a, c in zip(runs["4 pieces"], runs["1 piece"]))
    print(f"4 pieces over 1 piece, median of rounds: {paired:.3f}x the time")
    for name in ("4 pieces", "1 piece"):
        print(f"floor over {name}, median of rounds: "
              f"{statistics.median(f / p for f, p in zip(runs['floor'], runs[name])):.3f}x")


if __name__ == "__main__":
    main()
