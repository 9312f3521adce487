"""Restore from a peer's RAM against torch.load from disk, for the same training state.

The state is ``--mib`` MiB held in ``--tensors`` float32 tensors of varied sizes (a realistic
count: a model plus its optimizer state). A peer daemon (a separate process, as it would be)
holds it as a replica in its shared-memory slot store, behind a :class:`ReplicaServer`. This
process restores it with :meth:`Replicator.fetch` into a preallocated, pre-touched buffer over
loopback: authenticated, chunked, checksummed on the wire, and verified end to end against the
snapshot's xxh3 block checksums. Baselines measured in the same run:

* ``raw socket``: the same bytes as 4 MiB ``sendall`` / ``recv_into`` into a preallocated
  buffer, nothing else (the ceiling of any loopback restore);
* ``torch.load (page cache warm)``: ``torch.load`` of the same state saved with ``torch.save``
  to a file in /tmp, file cached;
* ``torch.load (cold)``: the same after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file, so
  its bytes come from the disk.

Figures are medians of ``--repeat`` runs, interleaved. torch is imported for the baseline only,
after the peer process was forked. Run with ``flock /tmp/elasticd-cpu.lock`` on shared
machines::

    python bench/bench_peer_restore.py --mib 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import time
import uuid

import numpy as np

from wording import speed
from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout
from elasticd.store.shm import SlotStore
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.memory import MemoryCoordinator
from elasticd.recovery.replicator import Replicator
from elasticd.replication.shm_sink import ShmSink
from elasticd.replication.transport import ReplicaServer

SECRET = b"bench-secret-0123456789abcdef"
JOB, RANK = "bench", 0
CHUNK = 4 << 20
PAGE = 4096


def tensor_sizes(total: int, count: int) -> list[int]:
    """Element counts of ``count`` float32 tensors summing to about ``total`` bytes: a few big
    matrices and many small vectors, as in a model's state dict."""
    rng = np.random.default_rng(0)
    weights = rng.pareto(1.2, count) + 0.01
    sizes = np.maximum(1, (weights / weights.sum() * total / 4).astype(np.int64))
    return [int(s) for s in sizes]


def make_arrays(sizes: list[int]) -> dict[str, np.ndarray]:
    block = np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32)
    out = {}
    for i, n in enumerate(sizes):
        reps = -(-n // block.size)
        out[f"layer{i:03d}.param"] = np.tile(block, reps)[:n] + np.float32(i)
    return out


def touched(size: int) -> memoryview:
    buf = bytearray(size)
    buf[::PAGE] = b"\1" * len(range(0, size, PAGE))
    return memoryview(buf)


# -- the peer (child process) ------------------------------------------------------------------


def peer(conn, root: str, sizes: list[int]) -> None:
    """Holds the state as a replica and serves it, over elasticd and over a raw socket."""
    arrays = make_arrays(sizes)
    specs = [TensorSpec(k, "float32", v.shape) for k, v in arrays.items()]
    lay = layout(specs, job=JOB)
    store = SlotStore(root)
    slot = store.reserve(JOB, RANK, lay.total_size)
    for e in lay.entries:
        np.frombuffer(slot.buffer, np.uint8, e.nbytes, e.offset)[:] = arrays[e.name].view(np.uint8)
    store.complete(slot, SnapshotHeader(JOB, 1, 0, RANK, 1, lay, {}))
    del arrays
    server = ReplicaServer("127.0.0.1", 0, SECRET, "peer", ShmSink(store), idle_timeout=600).start()
    payload = store.latest(JOB, RANK).buffer
    raw = socket.create_server(("127.0.0.1", 0))
    conn.send((server.address, raw.getsockname()[1], lay.total_size))
    sock, _ = raw.accept()
    with sock:
        while sock.recv(1) == b"g":  # one raw transfer per request
            for off in range(0, len(payload), CHUNK):
                sock.sendall(payload[off : off + CHUNK])
    raw.close()
    del payload
    server.stop()
    store.close()


# -- the measurements (this process) -----------------------------------------------------------


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed early")
        got += n


def torch_baselines(sizes: list[int], path: str, repeat: int) -> tuple[list[float], list[float]]:
    import torch  # the baseline only; the daemon side never imports torch

    state = {k: torch.from_numpy(v) for k, v in make_arrays(sizes).items()}
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    del state
    torch.load(path)  # warm the page cache
    warm, cold = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        loaded = torch.load(path)
        warm.append(time.perf_counter() - start)
        del loaded
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        start = time.perf_counter()
        loaded = torch.load(path)
        cold.append(time.perf_counter() - start)
        del loaded
    return warm, cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB of state")
    parser.add_argument("--tensors", type=int, default=300, help="tensors in the state")
    parser.add_argument("--repeat", type=int, default=3, help="runs per variant (median)")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    sizes = tensor_sizes(args.mib << 20, args.tensors)
    tag = uuid.uuid4().hex[:10]
    root, path = f"/dev/shm/elasticd-bench-{tag}", f"/tmp/elasticd-bench-{tag}.pt"
    pipe, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=peer, args=(child, root, sizes), daemon=True)
    proc.start()
    replicator = raw = None
    try:
        address, raw_port, total = pipe.recv()
        replicator = Replicator("restorer", MemoryCoordinator(), Keyspace("/bench"),
                                SlotStore(f"{root}-restorer"), SECRET, m=2,
                                peers_address=lambda n: address if n == "peer" else None,
                                timeout=60.0)
        replicator.set_membership(JOB, ["peer", "restorer"], {"peer": [RANK]})
        raw = socket.create_connection(("127.0.0.1", raw_port))
        buf = touched(total)
        replicator.fetch(JOB, RANK, (0, 1), buf)  # connect and authenticate once, as a daemon
        peer_s, raw_s = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = replicator.fetch(JOB, RANK, (0, 1), buf)
            peer_s.append(time.perf_counter() - start)
            assert result.holder == "peer" and result.wire_bytes >= total
            start = time.perf_counter()
            raw.sendall(b"g")
            for off in range(0, total, CHUNK):
                recv_exactly(raw, buf[off : min(off + CHUNK, total)])
            raw_s.append(time.perf_counter() - start)
        warm_s, cold_s = torch_baselines(sizes, path, args.repeat)
    finally:
        if raw is not None:
            raw.close()
        if replicator is not None:
            replicator.close()
            replicator.store.close()
        proc.join(30)
        shutil.rmtree(root, ignore_errors=True)
        if os.path.exists(path):
            os.unlink(path)

    rows = [("elasticd fetch from peer RAM (verified)", peer_s),
            ("raw socket, 4 MiB recv_into (ceiling)", raw_s),
            ("torch.load, page cache warm", warm_s),
            ("torch.load, cold (fadvise DONTNEED)", cold_s)]
    med = {name: statistics.median(s) for name, s in rows}
    peer_med, warm_med = med[rows[0][0]], med[rows[2][0]]
    print(f"restore of {args.mib} MiB in {len(sizes)} tensors ({total} bytes with header), "
          f"median of {args.repeat}")
    print(f"{'method':42} {'seconds':>8} {'GB/s':>7} {'vs raw':>7} {'vs peer':>8}")
    raw_med = med[rows[1][0]]
    results = {}
    for name, _ in rows:
        s = med[name]
        print(f"{name:42} {s:8.3f} {total / s / 1e9:7.2f} {raw_med / s:7.0%} {s / peer_med:7.1f}x")
        results[name] = {"seconds": round(s, 4), "gb_per_s": round(total / s / 1e9, 3)}
    print(f"peer restore is {speed(peer_med, warm_med, 'torch.load (warm)')} and "
          f"{speed(peer_med, med[rows[3][0]], 'torch.load (cold)')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "peer_restore",
                       "command": " ".join(["bench/bench_peer_restore.py"] + sys.argv[1:]),
                       "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                   "platform": platform.platform()},
                       "mib": args.mib, "tensors": len(sizes), "repeat": args.repeat,
                       "results": results}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
