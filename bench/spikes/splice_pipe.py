"""Spike (issue 30, restore40): can the daemon pass a restore's payload to the worker through a
pipe, by ``splice`` from the holder's socket, so that the bytes are copied once (pipe ->
the worker's tensors) instead of twice (socket -> restore scratch, scratch -> tensors)?

The worker would check each block against its tag itself, with the snapshot's block key (its
own job's data: a worker that skipped the check would only harm its own job); the daemon keeps
the connection, its session keys and the whole protocol (pieces, deadlines, failover) and reads
the frames' prefixes itself; only payload bytes go through the pipe. Measured here on one
stream of 1 MiB blocks from a sender process, CPU seconds of every receiving process summed
(the sender is the same for all):

* ``scratch_then_copy`` (today): one process receives each block into a kept, touched
  ``/dev/shm`` mapping and checks its tag as it lands; then one ``memmove`` of it into the
  destination (the worker's copy out of scratch);
* ``splice_to_worker``: a "daemon" process ``splice``s each block from the socket into a pipe
  (``F_SETPIPE_SZ`` 1 MiB); a "worker" process reads the pipe into the destination with
  ``readinto`` and checks the tag there;
* ``recv_in_worker`` (the least any scheme costs): the destination's process receives from the
  socket straight into it and checks the tag (bench/spikes/worker_receive.py's design).

Interleaved, ``--reps`` rounds, medians::

    cpulock python bench/spikes/splice_pipe.py --reps 7 --out bench/results/restore40/splice_pipe.json
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
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

from proc_cpu import cpu_seconds  # noqa: E402
from verified_floor import KEY, PREFIX, BlockMac, _nonce, recv_exactly, tune  # noqa: E402

MIB = 1 << 20
BLOCK = MIB
F_SETPIPE_SZ = 1031


def sender(conn, total: int) -> None:
    data = np.random.default_rng(1).integers(0, 255, total, dtype=np.uint8)
    buf = memoryview(data).cast("B")
    aead = ChaCha20Poly1305(KEY)
    n = total // BLOCK
    tags = [aead.encrypt(_nonce(b), b"", buf[b * BLOCK : (b + 1) * BLOCK]) for b in range(n)]
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    tune(sock)
    with sock:
        while sock.recv(1) == b"s":
            for b in range(n):
                sock.sendall(PREFIX.pack(b, tags[b]))
                sock.sendall(buf[b * BLOCK : (b + 1) * BLOCK])
    listener.close()


def worker(conn, read_fd: int, total: int) -> None:
    """Reads blocks from the pipe into its destination, checking each against its tag (the
    tags come over ``conn``, as the daemon would forward them from the frames' prefixes)."""
    dest = np.ones(total, np.uint8)
    view = memoryview(dest).cast("B")
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    conn.send(("ready", cpu_seconds(os.getpid())))
    while (msg := conn.recv()) != "quit":
        dest.fill(0)
        tags = msg
        for b, tag in enumerate(tags):
            mac = BlockMac(b)
            got, at = 0, b * BLOCK
            while got < BLOCK:
                n = pipe.readinto(view[at + got : at + BLOCK])
                if not n:
                    raise EOFError("pipe closed")
                mac.update(view[at + got : at + got + n])
                got += n
            if mac.tag() != tag:
                raise ValueError(f"block {b} fails its tag")
        conn.send(("done", int(dest[: 1 << 16].sum()), cpu_seconds(os.getpid())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    total = args.mib * MIB
    ctx = mp.get_context("fork")
    pipe_s, child_s = mp.Pipe()
    send_proc = ctx.Process(target=sender, args=(child_s, total), daemon=True)
    send_proc.start()
    port = pipe_s.recv()
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, BLOCK)
    ctl, child_w = mp.Pipe()
    work_proc = ctx.Process(target=worker, args=(child_w, r, total), daemon=True)
    work_proc.start()
    os.close(r)
    assert ctl.recv()[0] == "ready"
    sock = socket.create_connection(("127.0.0.1", port))
    tune(sock)
    dest = np.ones(total, np.uint8)
    dview = memoryview(dest).cast("B")
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="elasticd-spike-")
    expect = np.random.default_rng(1).integers(0, 255, 1 << 16, dtype=np.uint8)
    prefix = memoryview(bytearray(PREFIX.size))
    try:
        os.ftruncate(fd, total)
        scratch_map = mmap.mmap(fd, total)
        scratch = memoryview(scratch_map)
        scratch[::4096] = b"\1" * len(range(0, total, 4096))
        base = np.frombuffer(scratch_map, np.uint8, 1).ctypes.data

        def receive_checked(into: memoryview) -> None:
            """Every block into ``into``, each checked against its tag as it lands."""
            dest.fill(0)
            sock.sendall(b"s")
            for b in range(total // BLOCK):
                recv_exactly(sock, prefix)
                _, tag = PREFIX.unpack(prefix)
                mac = BlockMac(b)
                recv_exactly(sock, into[b * BLOCK : (b + 1) * BLOCK], mac.update)
                if mac.tag() != tag:
                    raise ValueError(b)

        def scratch_then_copy() -> float:
            receive_checked(scratch)
            ctypes.memmove(dest.ctypes.data, base, total)
            assert np.array_equal(dest[: 1 << 16], expect)
            return 0.0

        def recv_in_worker() -> float:
            receive_checked(dview)
            assert np.array_equal(dest[: 1 << 16], expect)
            return 0.0

        def splice_to_worker() -> float:
            # The worker gets the tags first (the daemon would forward each piece's tags,
            # read from its frames' prefixes, with it; the sender's are fixed here), then the
            # bytes: the daemon reads each prefix itself and splices the block into the pipe.
            before = cpu_seconds(work_proc.pid)
            ctl.send(_all_tags(total))
            sock.sendall(b"s")
            for _ in range(total // BLOCK):
                recv_exactly(sock, prefix)
                left = BLOCK
                while left:
                    left -= os.splice(sock.fileno(), w, left)
            msg = ctl.recv()
            assert msg[0] == "done" and msg[1] == int(expect.sum()), msg
            return msg[2] - before

        cache: dict[int, list[bytes]] = {}

        def _all_tags(n: int) -> list[bytes]:
            if n not in cache:
                data = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
                aead = ChaCha20Poly1305(KEY)
                cache[n] = [aead.encrypt(_nonce(b), b"", memoryview(data)[b * BLOCK :
                                                                        (b + 1) * BLOCK])
                            for b in range(n // BLOCK)]
            return cache[n]

        ways = {"scratch_then_copy": scratch_then_copy, "splice_to_worker": splice_to_worker,
                "recv_in_worker": recv_in_worker}
        cpu: dict[str, list[float]] = {k: [] for k in ways}
        wall: dict[str, list[float]] = {k: [] for k in ways}
        for k in ways:
            ways[k]()
        names = list(ways)
        for rnd in range(args.reps):
            for k in names[rnd % 3:] + names[: rnd % 3]:
                c, t = time.process_time(), time.perf_counter()
                other = ways[k]()
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.process_time() - c + other)
        sock.sendall(b"q")
        ctl.send("quit")
        scratch.release()
        scratch_map.close()
    finally:
        sock.close()
        os.close(w)
        os.close(fd)
        os.unlink(path)
        send_proc.join(10)
        work_proc.join(10)
    gib = total / (1 << 30)
    result = {"spike": "splice_pipe",
              "command": " ".join(["bench/spikes/splice_pipe.py"] + sys.argv[1:]),
              "bytes": total, "reps": args.reps,
              "cpu_seconds_per_gib": {k: round(statistics.median(v) / gib, 4)
                                      for k, v in cpu.items()},
              "wall_seconds_per_gib": {k: round(statistics.median(v) / gib, 4)
                                       for k, v in wall.items()},
              "cpu_runs": {k: [round(x, 4) for x in v] for k, v in cpu.items()}}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
