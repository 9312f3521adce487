"""Spike (issue 30, restore41): does a holder's CPU per GiB grow when it serves two fetches at once?

In the sharded bench on this host elasticd's holders spent 1.4-1.9x the floor's senders' CPU per
restore (restore41's hold), and their serving threads ~1.4x per byte sent (a metered run),
while in the peer bench, one fetch from one holder, the two are even (0.263 against 0.266 CPU s
per GiB). One difference: in the sharded bench a holder serves two fetching daemons at once (a
thread each), where the floor's sender serves its connections one after the other. This
spike holds ``bench_peer_restore.py``'s 1 GiB state (300 tensors, its blocks tagged at the seal)
in one holder process, behind a ReplicaServer and a raw floor sender that serves each
connection in a thread of its own, and has two client processes fetch it whole, in four modes
a round (turning order): elasticd by one client, by both at once, the floor by one, by both.
The figure is the holder process's CPU seconds per GiB it sent (``/proc``), medians over
``--reps`` rounds::

    cpulock python bench/spikes/holder_concurrency.py --reps 7 --out bench/results/restore41/holder_concurrency.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_peer_restore as peer  # noqa: E402
import verified_floor  # noqa: E402
from proc_cpu import cpu_seconds  # noqa: E402

MODES = ("elasticd x1", "elasticd x2", "floor x1", "floor x2")


def holder(conn, root: str, sizes: list[int]) -> None:
    """The state in a slot, served by a ReplicaServer and by a raw sender (a thread a
    connection, each request ``v`` one whole verified-floor transfer)."""
    store, lay = peer.held_state(root, sizes)
    server = peer.ReplicaServer("127.0.0.1", 0, peer.SECRET, "peer", peer.ShmSink(store),
                                idle_timeout=600).start()
    payload = store.latest(peer.JOB, peer.RANK).buffer
    source = verified_floor.TaggedSource(payload)
    raw = socket.create_server(("127.0.0.1", 0))

    def serve(sock: socket.socket) -> None:
        with sock:
            verified_floor.tune(sock)
            while sock.recv(1) == b"v":
                source.send(sock)

    def accept() -> None:
        while True:
            try:
                sock, _ = raw.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    conn.send((server.address, raw.getsockname()[1], lay.total_size))
    conn.recv()  # until told to stop
    raw.close()
    server.stop()  # the slot's files go with the parent's rmtree of the store (its views
    # are still exported to the raw sender here, so the store is not closed)


def client(conn, root: str, address, raw_port: int, total: int, name: str) -> None:
    """Fetches on command: ``fetch`` (elasticd) or ``floor``; answers ``done``."""
    replicator = peer.Replicator(name, peer.MemoryCoordinator(), peer.Keyspace("/bench"),
                                 peer.SlotStore(f"{root}-restorer"), peer.SECRET, m=2,
                                 peers_address=lambda n: address if n == "peer" else None,
                                 timeout=60.0)
    replicator.set_membership(peer.JOB, ["peer", name], {"peer": [peer.RANK]})
    raw = socket.create_connection(("127.0.0.1", raw_port))
    verified_floor.tune(raw)
    buf = peer.touched(total)
    replicator.fetch(peer.JOB, peer.RANK, (0, 1), buf)  # connect and authenticate once
    conn.send("ready")
    try:
        while (what := conn.recv()) != "stop":
            if what == "fetch":
                replicator.fetch(peer.JOB, peer.RANK, (0, 1), buf)
            else:
                raw.sendall(b"v")
                verified_floor.receive(raw, buf[:total])
            conn.send("done")
    finally:
        raw.close()
        replicator.close()
        replicator.store.close()
        shutil.rmtree(f"{root}-restorer", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    sizes = peer.tensor_sizes(1024 << 20, 300)
    root = f"/dev/shm/elasticd-bench-{uuid.uuid4().hex[:10]}"
    fork = mp.get_context("fork")
    mine, theirs = fork.Pipe()
    proc = fork.Process(target=holder, args=(theirs, root, sizes), daemon=True)
    proc.start()
    clients, pipes = [], []
    try:
        address, raw_port, total = mine.recv()
        for i in range(2):
            a, b = fork.Pipe()
            c = fork.Process(target=client, args=(b, f"{root}-c{i}", address, raw_port, total,
                                                  f"restorer{i}"), daemon=True)
            c.start()
            assert a.recv() == "ready"
            clients.append(c)
            pipes.append(a)
        gib = total / (1 << 30)
        per_gib: dict[str, list[float]] = {m: [] for m in MODES}
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(args.reps):
            for i in range(len(MODES)):
                mode = MODES[(rep + i) % len(MODES)]
                what = "fetch" if mode.startswith("elasticd") else "floor"
                used = pipes[: 2 if mode.endswith("x2") else 1]
                before, start = cpu_seconds(proc.pid), time.perf_counter()
                for p in used:
                    p.send(what)
                for p in used:
                    assert p.recv() == "done"
                wall[mode].append(time.perf_counter() - start)
                per_gib[mode].append((cpu_seconds(proc.pid) - before) / (gib * len(used)))
        med = {m: round(statistics.median(v), 4) for m, v in per_gib.items()}
        out = {"benchmark": "holder_concurrency", "reps": args.reps, "state_bytes": total,
               "holder_cpu_seconds_per_gib_sent_median": med,
               "wall_seconds_median": {m: round(statistics.median(v), 4) for m, v in wall.items()},
               "elasticd_over_floor": {n: round(med[f"elasticd {n}"] / med[f"floor {n}"], 3)
                                       for n in ("x1", "x2")},
               "runs": {m: [round(x, 4) for x in v] for m, v in per_gib.items()}}
        print(json.dumps(out, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
    finally:
        for p in pipes:
            p.send("stop")
        for c in clients:
            c.join(30)
        mine.send("stop")
        proc.join(30)
        for p in (proc, *clients):
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
        for i in range(2):
            shutil.rmtree(f"{root}-c{i}-restorer", ignore_errors=True)


if __name__ == "__main__":
    main()
