"""Spike (issue 30, restore40): what would a worker that receives its own rows save, against
today's daemon receiving into restore scratch and the worker copying the rows out?

restore39 left one lever of the size the sharded CPU point needs: the workers' copy of their
rows into the live tensors (0.19-0.21 CPU s a restore over two workers, the biggest item beyond
the verified floor). A worker receiving the holders' stream itself would land each wanted row
in its tensor straight from the socket and drop the copy, but it would then receive the
blocks' bytes it does not want too (a block is the unit a tag checks), into a small buffer.
This measures both ways on the same stream, one receiving process, CPU seconds of that process
(the sender is another process and the same for both):

* ``scratch_then_copy`` (today): each block received into a kept, touched mapping of a
  ``/dev/shm`` file (restore scratch), fed to its Poly1305 as it lands and checked; then one
  ``memmove`` per wanted piece out of the mapping into the tensors (``worker/slot_rows.py``).
  In the product the two halves run in two processes (daemon, worker); the CPU is the sum.
* ``receive_into_tensors`` (the design): each block received piece by piece, a wanted piece
  straight into its tensor, an unwanted one into one 1 MiB buffer, every piece fed to the
  block's Poly1305, the tag checked at the block's end.

The state is ``--tensors`` float32 tensors of varied sizes (``--mib`` in all), laid back to back
in 1 MiB blocks (the product's block size), each tagged once before the timing; the receiver
wants the first ``--wanted`` of each tensor's rows (a reshard's share of an old rank: contiguous
rows of each tensor), and only the blocks holding wanted bytes are sent (the product's
``select``). Interleaved, ``--reps`` rounds, medians::

    cpulock python bench/spikes/worker_receive.py --reps 7 --out bench/results/restore40/worker_receive.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: E402

from verified_floor import KEY, PREFIX, BlockMac, _nonce, recv_exactly, tune  # noqa: E402

MIB = 1 << 20
BLOCK = MIB


def tensor_sizes(total: int, count: int) -> list[int]:
    """Byte sizes (multiples of 4) of ``count`` tensors summing to about ``total``: a few big
    matrices, many small vectors (as bench_peer_restore.py draws them)."""
    rng = np.random.default_rng(0)
    weights = rng.pareto(1.2, count) + 0.01
    return [4 * max(1, int(w)) for w in weights / weights.sum() * total / 4]


def plan(sizes: list[int], wanted: float) -> tuple[list[int], list[list[tuple[int, int, int]]]]:
    """The blocks to send, and per block its pieces ``(length, tensor or -1, offset in it)``
    in stream order (-1: bytes the receiver does not want)."""
    spans = []  # (stream offset, length, tensor or -1, offset in tensor)
    at = 0
    for i, n in enumerate(sizes):
        keep = int(n * wanted) // 4 * 4
        if keep:
            spans.append((at, keep, i, 0))
        if n - keep:
            spans.append((at + keep, n - keep, -1, 0))
        at += n
    blocks: dict[int, list[tuple[int, int, int]]] = {}
    for start, length, tensor, _ in spans:
        pos = start
        while pos < start + length:
            b = pos // BLOCK
            n = min(start + length, (b + 1) * BLOCK) - pos
            blocks.setdefault(b, []).append((n, tensor, pos - start))
            pos += n
    send = [b for b, pieces in sorted(blocks.items()) if any(t >= 0 for _, t, _ in pieces)]
    return send, [blocks[b] for b in send]


def sender(conn, total: int, blocks: list[int]) -> None:
    data = np.random.default_rng(1).integers(0, 255, total, dtype=np.uint8)
    buf = memoryview(data).cast("B")
    aead = ChaCha20Poly1305(KEY)
    tags = {b: aead.encrypt(_nonce(b), b"", buf[b * BLOCK : min((b + 1) * BLOCK, total)])
            for b in blocks}
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    tune(sock)
    with sock:
        while sock.recv(1) == b"s":
            for b in blocks:
                sock.sendall(PREFIX.pack(b, tags[b]))
                sock.sendall(buf[b * BLOCK : min((b + 1) * BLOCK, total)])
    listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=600, help="MiB of state (all tensors)")
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--wanted", type=float, default=0.75,
                        help="share of each tensor's rows the receiver wants")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    sizes = tensor_sizes(args.mib * MIB, args.tensors)
    total = sum(sizes)
    blocks, pieces = plan(sizes, args.wanted)
    stream = sum(min(BLOCK, total - b * BLOCK) for b in blocks)
    wanted = sum(n for ps in pieces for n, t, _ in ps if t >= 0)

    pipe, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=sender, args=(child, total, blocks), daemon=True)
    proc.start()
    port = pipe.recv()
    sock = socket.create_connection(("127.0.0.1", port))
    tune(sock)
    tensors = [np.ones(n // 4, np.float32) for n in sizes]  # touched: live training state
    dest = [memoryview(t).cast("B") for t in tensors]
    ptrs = [t.ctypes.data for t in tensors]
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="elasticd-spike-")
    try:
        os.ftruncate(fd, stream)
        scratch_map = mmap.mmap(fd, stream)
        scratch = memoryview(scratch_map)
        scratch[::4096] = b"\1" * len(range(0, stream, 4096))  # kept scratch: touched
        base = np.frombuffer(scratch_map, np.uint8, 1).ctypes.data
        discard = memoryview(bytearray(BLOCK))
        prefix = memoryview(bytearray(PREFIX.size))

        def check(mac: BlockMac, tag: bytes, b: int) -> None:
            if mac.tag() != tag:
                raise ValueError(f"block {b} fails its tag")

        def scratch_then_copy() -> None:
            sock.sendall(b"s")
            at, where = 0, []
            for b, ps in zip(blocks, pieces):
                recv_exactly(sock, prefix)
                n, tag = PREFIX.unpack(prefix)
                length = sum(p[0] for p in ps)
                mac = BlockMac(n)
                recv_exactly(sock, scratch[at : at + length], mac.update)
                check(mac, tag, b)
                where.append(at)
                at += length
            for at, ps in zip(where, pieces):  # the worker's copy out of the mapping
                for n, t, off in ps:
                    if t >= 0:
                        ctypes.memmove(ptrs[t] + off, base + at, n)
                    at += n

        def receive_into_tensors() -> None:
            sock.sendall(b"s")
            for b, ps in zip(blocks, pieces):
                recv_exactly(sock, prefix)
                n, tag = PREFIX.unpack(prefix)
                mac = BlockMac(n)
                for length, t, off in ps:
                    view = dest[t][off : off + length] if t >= 0 else discard[:length]
                    recv_exactly(sock, view, mac.update)
                check(mac, tag, b)

        ways = {"scratch_then_copy": scratch_then_copy,
                "receive_into_tensors": receive_into_tensors}
        cpu: dict[str, list[float]] = {k: [] for k in ways}
        wall: dict[str, list[float]] = {k: [] for k in ways}
        # What each tensor must hold after either way: its wanted rows as sent, zeros after.
        data = np.random.default_rng(1).integers(0, 255, total, dtype=np.uint8)
        expect, at = [], 0
        for n in sizes:
            keep = int(n * args.wanted) // 4 * 4
            e = np.zeros(n, np.uint8)
            e[:keep] = data[at : at + keep]
            expect.append(e.view(np.float32))
            at += n
        del data
        for k in ways:  # warm both once
            ways[k]()
        for r in range(args.reps):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for k in order:
                for t in tensors:
                    t.fill(0)
                c, w = time.process_time(), time.perf_counter()
                ways[k]()
                cpu[k].append(time.process_time() - c)
                wall[k].append(time.perf_counter() - w)
                assert all(np.array_equal(a.view(np.uint8), e.view(np.uint8))
                           for a, e in zip(tensors, expect)), k
        sock.sendall(b"q")
        scratch.release()
        scratch_map.close()
    finally:
        sock.close()
        os.close(fd)
        os.unlink(path)
        proc.join(10)
    gib = stream / (1 << 30)
    result = {
        "spike": "worker_receive", "command": " ".join(["bench/spikes/worker_receive.py"]
                                                       + sys.argv[1:]),
        "stream_bytes": stream, "wanted_bytes": wanted, "blocks": len(blocks),
        "pieces": sum(len(p) for p in pieces), "reps": args.reps,
        "cpu_seconds_per_stream_gib": {k: round(statistics.median(v) / gib, 4)
                                       for k, v in cpu.items()},
        "wall_seconds": {k: round(statistics.median(v), 4) for k, v in wall.items()},
        "cpu_runs": {k: [round(x, 4) for x in v] for k, v in cpu.items()},
    }
    a, b = (statistics.median(cpu[k]) for k in ways)
    result["design_over_today"] = round(b / a, 3)
    result["saved_cpu_seconds_per_wanted_gib"] = round((a - b) / (wanted / (1 << 30)), 4)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
