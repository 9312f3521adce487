"""Spike (issue 30, restore41): does the sharded bench's floor sender send from cache?

``bench_sharded_restore.py``'s verified floor sends each new rank's bytes from a 64 MiB buffer
cycled over and over (``RAW_CHUNK``: "the size keeps it out of cache"), where elasticd's
holders send the snapshot's own bytes out of their slots. On this host (32 MiB of L3) a
``perf`` of the holders put 2.3x as many samples in ``_copy_from_iter`` (the kernel's copy
of the sent bytes) on elasticd's serving threads as on the floor's senders, for about the
same bytes. This measures a sender's CPU per GiB sent over loopback, one way at a time, from:

* ``cycled_64mib``: a 64 MiB buffer sent over and over (the floor's source today);
* ``fresh_1gib``: 1 GiB of anonymous memory, touched once, sent front to back;
* ``slot_1gib``: a 1 GiB ``/dev/shm`` file, written once and mapped, sent front to back (what a
  holder's slot is).

The receiver (another process) ``recv_into``'s one 4 MiB buffer. Each round runs the three in
a turning order; medians of ``--reps`` rounds::

    cpulock python bench/spikes/source_cache.py --reps 7 --out bench/results/restore41/source_cache.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import time

GIB = 1 << 30
BLOCK = 4 << 20


def sink(port: int) -> None:
    """Receives and drops everything of each connection into one buffer."""
    listener = socket.create_server(("127.0.0.1", port))
    buf = memoryview(bytearray(BLOCK))
    while True:
        conn, _ = listener.accept()
        with conn:
            first = conn.recv_into(buf)
            if first == 0:
                return
            while conn.recv_into(buf):
                pass


def send(port: int, source: memoryview, total: int) -> float:
    """CPU seconds of this thread to send ``total`` bytes out of ``source`` (cycled)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.thread_time()
        sent = 0
        while sent < total:
            at = sent % len(source)
            n = min(BLOCK, len(source) - at, total - sent)
            sock.sendall(source[at : at + n])
            sent += n
        spent = time.thread_time() - start
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    receiver = mp.get_context("fork").Process(target=sink, args=(port,), daemon=True)
    receiver.start()
    time.sleep(0.5)
    path = f"/dev/shm/elasticd-spike-source-{os.getpid()}"
    try:
        cycled = memoryview(bytearray(os.urandom(64 << 20)))
        fresh = mmap.mmap(-1, GIB)
        fresh.write(os.urandom(1 << 20) * 1024)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, GIB)
        slot = mmap.mmap(fd, GIB)
        slot.write(os.urandom(1 << 20) * 1024)
        os.close(fd)
        sources = {"cycled_64mib": cycled, "fresh_1gib": memoryview(fresh),
                   "slot_1gib": memoryview(slot)}
        names = list(sources)
        runs: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            for i in range(len(names)):
                name = names[(rep + i) % len(names)]
                runs[name].append(send(port, sources[name], GIB))
        out = {"benchmark": "source_cache", "reps": args.reps, "sent_gib_each": 1,
               "sender_cpu_seconds_per_gib_median": {n: round(statistics.median(v), 4)
                                                     for n, v in runs.items()},
               "runs": {n: [round(x, 4) for x in v] for n, v in runs.items()}}
        med = out["sender_cpu_seconds_per_gib_median"]
        out["cycled_64mib_over_slot_1gib"] = round(med["cycled_64mib"] / med["slot_1gib"], 3)
        print(json.dumps(out, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
        for view in sources.values():
            view.release()
        fresh.close()
        slot.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)
        with socket.create_connection(("127.0.0.1", port)) as sock:  # ends the sink
            sock.shutdown(socket.SHUT_WR)
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()


if __name__ == "__main__":
    main()
