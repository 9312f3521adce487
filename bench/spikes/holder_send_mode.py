"""Spike (issue 30, restore39): does a holder's serving thread spend less CPU per GiB when each
frame goes out through a blocking ``sendmsg`` (the kernel waits for room, as the verified
floor's blocking ``sendall`` does) instead of the socket's timeout mode (CPython polls, then
``sendmsg`` returns whatever fitted, and Python loops over the partial sends)?

A ReplicaServer in this process holds ``bench_peer_restore.py``'s 1 GiB state (its blocks tagged
at the seal); a Replicator in a forked process fetches it ``2 * ROUNDS + 1`` times (the first
connects and authenticates, untimed). Each fetch is served with ``Channel._send`` as it is (A)
or the blocking variant below (B), alternating; the figure is the serving thread's own CPU time
(``thread_time``) over its ``_serve_fetch`` calls for one fetch. Run under the CPU lock::

    cpulock python bench/spikes/holder_send_mode.py 8
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_peer_restore as peer  # noqa: E402
from elasticd.replication import channel, server  # noqa: E402

_served: list[float] = []
_serve_fetch = server.ReplicaServer._serve_fetch
_send = channel.Channel._send


def _metered(self, *args, **kwargs):
    start = time.thread_time()
    try:
        return _serve_fetch(self, *args, **kwargs)
    finally:
        _served.append(time.thread_time() - start)


def _blocking_send(self, *parts) -> None:
    """B: the frame's parts in blocking ``sendmsg`` calls (the socket's timeout lifted)."""
    if not self._gather or len(parts) < 2:
        return _send(self, *parts)
    timeout = self.sock.gettimeout()
    self.sock.settimeout(None)
    try:
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            sent = self.sock.sendmsg(views)
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0], sent = views[0][sent:], 0
    finally:
        self.sock.settimeout(timeout)


def _client(address, root: str, total: int, go, done, n: int) -> None:
    rep = peer.Replicator("restorer", peer.MemoryCoordinator(), peer.Keyspace("/bench"),
                          peer.SlotStore(f"{root}-r"), peer.SECRET, m=2,
                          peers_address=lambda node: address if node == "peer" else None,
                          timeout=60.0)
    rep.set_membership(peer.JOB, ["peer", "restorer"], {"peer": [peer.RANK]})
    buf = peer.touched(total)
    for _ in range(n):
        go.get()
        rep.fetch(peer.JOB, peer.RANK, (0, 1), buf)
        done.put(1)
    rep.close()
    rep.store.close()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    server.ReplicaServer._serve_fetch = _metered
    root = f"/dev/shm/elasticd-bench-{uuid.uuid4().hex[:10]}"
    store, lay = peer.held_state(root, peer.tensor_sizes(1024 << 20, 300))
    holder = peer.ReplicaServer("127.0.0.1", 0, peer.SECRET, "peer", peer.ShmSink(store),
                                idle_timeout=600).start()
    go, done = mp.Queue(), mp.Queue()
    n = 1 + 2 * rounds
    proc = mp.get_context("fork").Process(target=_client, args=(holder.address, root,
                                                                lay.total_size, go, done, n))
    proc.start()
    cpu: dict[str, list[float]] = {"A (as is)": [], "B (blocking)": []}
    try:
        for i in range(n):
            mode = "A (as is)" if i % 2 else "B (blocking)"
            channel.Channel._send = _send if i % 2 else _blocking_send
            _served.clear()
            go.put(1)
            done.get()
            if i:
                cpu[mode].append(round(sum(_served), 4))
    finally:
        proc.join(60)
        holder.stop()
        store.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(f"{root}-r", ignore_errors=True)
    print({"serving thread CPU s per 1 GiB fetch": cpu,
           "medians": {k: round(statistics.median(v), 4) for k, v in cpu.items()}})


if __name__ == "__main__":
    main()
