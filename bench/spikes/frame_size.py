"""What a pretagged DATA frame costs per frame, apart from its bytes: the question behind the
snapshot's block size (issue 30).

A restore at another world size fetches whole blocks around the rows a new rank needs, so a
smaller block fetches fewer bytes it does not need; every block is also one frame, with its own
one-time Poly1305 keys and system calls. Two measurements, one process, no daemon:

* ``tagger``: one frame's fixed tag cost, ``one_time_tagger`` (a ChaCha20 cipher object for
  the one-time key, a Poly1305 object) plus its finalisation, against Poly1305 over a 1 MiB
  and a 4 MiB buffer already in cache. The receiver of a pretagged frame pays it twice (the
  frame's session tag, the block's tag), the sender once.
* ``stream``: ``send_stream`` / ``receive_stream`` of the same bytes in pretagged frames over
  real loopback TCP (the product's socket options), one thread each, for several block
  sizes, interleaved: each side's thread CPU per GiB.

Run under the CPU lock::

    flock /tmp/elasticd-cpu.lock python bench/spikes/frame_size.py \\
        --out bench/results/spikes/frame_size.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
import timeit

from elasticd.replication.channel import Channel, receive_stream, send_stream, tune
from elasticd.replication.seal import BlockTagger, FrameKey, one_time_tagger
from cryptography.hazmat.primitives.poly1305 import Poly1305


def tagger_costs() -> dict[str, float]:
    """Microseconds per call, median of 5 repeats."""
    key = os.urandom(32)
    n = 20000

    def per_call(fn, number: int = n) -> float:
        return statistics.median(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    mib = bytearray(1 << 20)
    four = bytearray(4 << 20)
    return {
        "one_time_tagger + tag (us per frame key)": round(per_call(
            lambda: one_time_tagger(key, 5).tag()), 2),
        "Poly1305 over 1 MiB in cache (us)": round(per_call(
            lambda: Poly1305(key).update(mib), 200), 1),
        "Poly1305 over 4 MiB in cache (us)": round(per_call(
            lambda: Poly1305(key).update(four), 50), 1),
    }


def stream(buf: bytearray, block: int, secret: bytes) -> dict[str, float]:
    """One transfer of ``buf`` in pretagged ``block``-byte frames over loopback TCP."""
    total = len(buf)
    tagger = BlockTagger(secret)
    tags = tagger.tag(buf, [(i, min(i + block, total)) for i in range(0, total, block)])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    for s in (a, b):
        tune(s)
    key = os.urandom(32)
    tx, rx = Channel(a), Channel(b)
    tx.send_key, rx.recv_key = FrameKey(key), FrameKey(key)
    rx.block_key = tagger.key(tags.salt)
    dst = memoryview(bytearray(total))
    cpu: dict[str, float] = {}

    def send() -> None:
        began = time.thread_time()
        # The product's chunk: since protocol v6 consecutive blocks go in runs of up to 4 MiB
        # (before, each tagged block was its own frame whatever the chunk).
        send_stream(tx, (memoryview(buf),), max(block, 4 << 20), tags)
        cpu["send"] = time.thread_time() - began

    sender = threading.Thread(target=send)
    wall = time.perf_counter()
    sender.start()
    began = time.thread_time()
    frames = receive_stream(rx, total, dst)
    cpu["recv"] = time.thread_time() - began
    sender.join()
    wall = time.perf_counter() - wall
    if bytes(dst[-block:]) != bytes(buf[-block:]) or bytes(dst[:block]) != bytes(buf[:block]):
        raise AssertionError("received bytes differ")
    for s in (a, b, listener):
        s.close()
    gib = total / 2**30
    return {"frames": frames, "wall_s_per_gib": wall / gib,
            "recv_cpu_s_per_gib": cpu["recv"] / gib, "send_cpu_s_per_gib": cpu["send"] / gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes per transfer, MiB")
    parser.add_argument("--blocks-kib", default="4096,2048,1024,256")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--out", default="")
    a = parser.parse_args()
    tags = tagger_costs()
    for k, v in tags.items():
        print(f"{k}: {v}")
    buf = bytearray(os.urandom(1 << 20) * a.mib)
    secret = os.urandom(32)
    sizes = [int(s) << 10 for s in a.blocks_kib.split(",")]
    runs: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}
    for _ in range(a.rounds):
        for s in sizes:
            runs[s].append(stream(buf, s, secret))
    table = {}
    for s in sizes:
        med = {k: round(statistics.median(r[k] for r in runs[s]), 3)
               for k in ("wall_s_per_gib", "recv_cpu_s_per_gib", "send_cpu_s_per_gib")}
        med["frames"] = runs[s][0]["frames"]
        table[f"{s >> 10} KiB blocks"] = med
        print(f"{s >> 10:5d} KiB blocks: {med}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "frame_size", "command": "bench/spikes/frame_size.py "
                       + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                  if k != "out" and v),
                       "mib": a.mib, "rounds": a.rounds, "tagger": tags,
                       "stream_medians": table,
                       "runs": {f"{s >> 10} KiB": runs[s] for s in sizes}}, f, indent=1)


if __name__ == "__main__":
    main()
