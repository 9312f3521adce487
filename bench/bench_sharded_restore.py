"""Restore of sharded (FSDP2) training state at world size 2 from a world of 3: elasticd from
peers' RAM against ``torch.distributed.checkpoint.load`` from local disk, same run.

The state is an FSDP2 model (``fully_shard`` per ``Linear`` and at the root, gloo, CPU) with
Adam's state, sized by ``--mib`` (parameters plus ``exp_avg`` and ``exp_avg_sq``: three bytes
of state per byte of parameters). Layer widths are neither even nor multiples of 3 (and the
last layer has 5 rows), so the shards FSDP2 makes are uneven at world size 3 and at 2.

* World 3 (three spawned processes, gloo): one real training step, then each rank saves through
  a real :class:`~elasticd.Checkpointer` into a :class:`CheckpointService` of its own (so the
  snapshot is exactly what a daemon seals for an FSDP2 save: local shards plus their DCP chunk
  metadata), and pushes the sealed snapshot over the replication transport to the two holders
  the commit record names (m = 2: old rank r to holders ``h{r}`` and ``h{r+1 mod 3}``). The same
  ranks write ``dcp.save(get_state_dict(model, optim))`` to a directory on the local disk.
  None of this is timed.
* Holders: three processes, each a :class:`ReplicaServer` over a shared-memory
  :class:`ShmSink`, holding two of the three old ranks' snapshots as replicas.
* World 2: two new nodes, each a daemon process (a :class:`CheckpointService` with a real
  :class:`Replicator` whose coordinator holds the commit record of the world-3 step, behind a
  real :class:`LocalServer` socket) and a worker process (the two workers form a gloo group)
  with a freshly built FSDP2 model and Adam. The new nodes hold nothing of the old step: every
  byte comes from the holders.

Timed, for both new ranks at once (concurrently, from a barrier; the figure is the slower
rank's time), interleaved over ``--repeat`` rounds after one untimed warm-up round:

* ``elasticd``: ``Checkpointer.restore(state)`` — the product's whole restore. Since restore42
  the worker fetches its rows itself (:mod:`elasticd.worker.direct`): it asks its daemon for
  sessions to each needed old rank's holders (``ckpt_sessions``), fetches the headers into
  staging, plans the row copies with the resharder's code, and fetches the needed blocks
  striped across the holders with each planned row range landing straight in its live
  tensor (``elasticd_fetch.direct_fetch`` gives its figures). With
  ``ELASTICD_DIRECT_FETCH=0`` (or a daemon that cannot hand sessions over) it is the daemon's
  path: the ranks agree
  on the committed step, each asks its daemon (``ckpt_fetch``) for the old ranks its new shards
  need (:func:`~elasticd.worker.shards.needed_ranks`: new rank 0 needs old 0 and 1, new 1
  needs old 1 and 2), and the daemon fetches from those snapshots only the checksum blocks
  holding rows the new rank's shards overlap (:mod:`~elasticd.recovery.ranges`), striped
  across its two holders (:func:`~elasticd.recovery.fetch.fetch_shard`, every block checked)
  into a scratch segment; the worker maps it, copies its old rank's tensors out (the other's
  are read in place), and the :class:`Resharder` builds the new local shards, which the model
  and optimizer load. Before each run the daemons drop what the
  previous run fetched (the job's slots; the restore scratch kept for the job's next restore,
  ``store/scratch_pool.py``, stays, as between two restores on a node), so every run fetches
  from the peers again.
* ``dcp.load, page cache warm``: ``get_state_dict``, ``dcp.load`` of the world-3 save into it,
  ``set_state_dict`` (the standard FSDP2 recipe), with every file read once just before;
* ``dcp.load, cold``: the same after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file.
* ``loopback floor``: what any restore from peers' RAM on this host must at least do: each new
  rank receives as many bytes as its new shards hold over raw loopback TCP (replication's socket
  options), a third from each holder at once, into a buffer faulted in beforehand; nothing is
  authenticated, checked, resharded or loaded. Where this alone takes as long as ``dcp.load``
  from the page cache, no restore from peers can beat it on this host.

Before every run each rank zeroes its parameters and optimizer state; after it, a digest of
every local shard (xxh3) must equal, bitwise, what the other method gives in the same round,
and differ from the zeroed state. One thread per rank (``torch.set_num_threads(1)``): two
ranks on a two-core machine. The slot stores live in ``/dev/shm`` (4 KiB pages), or with
``--huge-tmpfs`` on a tmpfs the bench mounts with ``huge=within_size`` (and unmounts), as
``systemd/run-elasticd-shm.mount`` gives a node. Run under the CPU lock::

    flock /tmp/elasticd-cpu.lock python bench/bench_sharded_restore.py --mib 1100 \
        --repeat 3 --out bench/results/sharded_restore.json
    flock /tmp/elasticd-cpu.lock python bench/bench_sharded_restore.py --mib 1100 \
        --repeat 3 --huge-tmpfs --out bench/results/sharded_restore_huge.json

Each timed round runs elasticd and the floor back to back, so besides the ratio of the medians
the result pairs them round by round (``cpu_per_restore_paired_by_round``: every process's CPU
per restore over the floor's in the same round, their median, how many are <= 1.5x): more
``--repeat`` rounds, more paired samples in one run. ``elasticd_fetch`` also says, over the
timed rounds, where each daemon's partial copies landed (a kept segment of the same old rank,
another kept one, a new file) and how often each worker mapped the scratch anew or reused the
mapping it kept.

``--profile DIR`` writes cProfile stats (``pstats``) of every thread of each daemon and holder
and of each worker's timed restores to ``DIR``: for finding costs, not for figures (the
profiler slows the Python it watches). bench/results/sharded_restore_profile.txt is one.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import wait
from typing import Any

import code_tree

code_tree.pin()  # before elasticd is imported: the tree on PYTHONPATH, not the cwd's

import verified_floor  # noqa: E402
from proc_cpu import cpu_seconds  # noqa: E402
from elasticd.store.service import CheckpointService
from elasticd.store.huge_pages import probe
from elasticd.store.shm import SlotStore
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.daemon.local_api import LocalServer
from elasticd.replication.commit import Committed, record_commit
from elasticd.recovery.replicator import Replicator
from elasticd.replication.shm_sink import ShmSink
from elasticd.replication.seal import BlockTagger
from elasticd.replication.transport import ReplicaServer

SECRET = b"bench-secret-0123456789abcdef"
JOB = "bench-shard"
OLD, NEW = 3, 2
STEP = 1
VARIANTS = ("elasticd", "dcp_warm", "dcp_cold", "floor")
#: ``--spike-worker-fetch``: the worker fetches its own rows (bench/spikes/worker_fetch.py).
SPIKE = "worker_fetch"
FLOOR = ("verified floor: each new rank's state bytes over raw TCP from the 3 holders at "
         "once, every 4 MiB block checked against its Poly1305 tag as it lands, nothing else")
LABELS = {"elasticd": "elasticd restore from peers' RAM (Checkpointer.restore)",
          "dcp_warm": "dcp.load from local disk, page cache warm",
          "dcp_cold": "dcp.load from local disk, cold (fadvise DONTNEED)",
          "floor": FLOOR,
          SPIKE: "spike, not the product's path: the worker fetches its own rows into its live "
                 "tensors (bench/spikes/worker_fetch.py)"}
#: What the raw senders send from (its content does not matter; the size keeps it out of cache).
RAW_CHUNK = 64 << 20


#: ``--profile``: the directory each profiled process writes its cProfile stats to (set in the
#: parent before the processes fork or spawn; empty: no profiling).
PROFILE_ENV = "ELASTICD_BENCH_PROFILE"
#: The elasticd directory the parent imported; each spawned process checks it imported it too.
TREE_ENV = "ELASTICD_BENCH_TREE"


class ThreadProfiles:
    """cProfile in every thread of a process (cProfile sees only the thread that enabled it):
    each thread started after :meth:`install` runs under a profiler of its own, and
    :meth:`dump` writes them all, merged, to ``<dir>/<name>.prof``."""

    def __init__(self, name: str) -> None:
        self.name, self.dir, self.profiles = name, os.environ.get(PROFILE_ENV, ""), []

    def install(self) -> "ThreadProfiles":
        if not self.dir:
            return self
        import cProfile

        run, profiles = threading.Thread.run, self.profiles

        def profiled(thread) -> None:
            prof = cProfile.Profile()
            profiles.append(prof)
            prof.runcall(run, thread)

        threading.Thread.run = profiled
        return self

    def main(self) -> Any:
        """A profiler for the calling thread (enable and disable it around what to see)."""
        import cProfile

        prof = cProfile.Profile()
        self.profiles.append(prof)
        return prof

    def dump(self) -> None:
        if not self.dir or not self.profiles:
            return
        import pstats

        stats = None
        for prof in self.profiles:
            prof.create_stats()
            if not prof.stats:
                continue
            if stats is None:
                stats = pstats.Stats(prof)
            else:
                stats.add(prof)
        if stats is not None:
            stats.dump_stats(os.path.join(self.dir, f"{self.name}.prof"))


def holders_of(rank: int) -> tuple[str, str]:
    """The two holders of old rank ``rank``'s snapshot (m = 2, a ring as placement makes)."""
    return f"h{rank}", f"h{(rank + 1) % OLD}"


def widths(mib: int, layers: int) -> list[int]:
    """Layer widths for about ``mib`` MiB of parameters plus Adam state: alternately w and
    w + 4 with w = 1 (mod 6), so no width is a multiple of 2 or 3, then a 5-row head."""
    params = mib * (1 << 20) / 3 / 4
    w = max(7, int(math.sqrt(params / layers)))
    w -= (w - 1) % 6
    return [w + 4 * (i % 2) for i in range(layers + 1)] + [5]


def state_bytes(dims: list[int]) -> int:
    return 3 * 4 * sum(a * b + b for a, b in zip(dims, dims[1:]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- holder and daemon processes (forked before torch is imported anywhere) --------------------


def raw_sender(listener: socket.socket) -> None:
    """The verified floor's sender: per connection, reads a block count and sends that many
    4 MiB blocks, each behind its tag (made once, here, before anything is timed), from a
    64 MiB buffer over and over (verified_floor.py), with the product's socket options."""
    source = verified_floor.TaggedSource(memoryview(bytearray(os.urandom(RAW_CHUNK))))
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        with sock:
            verified_floor.tune(sock)
            count = int.from_bytes(sock.recv(8, socket.MSG_WAITALL), "little")
            source.send(sock, count)


def holder(conn, name: str, root: str, raw: bool = False) -> None:
    """A peer holding replicas in shared memory, served by a ReplicaServer (its address sent
    on ``conn``); with ``raw``, also the verified floor's sender (its address sent next)."""
    profiles = ThreadProfiles(f"holder-{name}").install()
    store = SlotStore(root)
    server = ReplicaServer("127.0.0.1", 0, SECRET, name, ShmSink(store),
                           idle_timeout=3600.0).start()
    conn.send(server.address)
    if raw:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=raw_sender, args=(listener,), daemon=True).start()
        conn.send(listener.getsockname())
    conn.recv()  # until told to stop
    server.stop()
    store.close()
    profiles.dump()


def daemon(conn, control, name: str, root: str, sock: str, book: dict) -> None:
    """A new node's daemon: checkpoint service + replicator + local socket. ``control`` (from
    its worker): "forget" drops the job's slots (not the scratch kept for its next restore)
    and returns the replicator's counters;
    "membership" is the membership change a new world starts with (the replicator is told,
    as the daemon's loop tells it when a node of the job fails), answered at once."""
    profiles = ThreadProfiles(f"daemon-{name}").install()
    store = SlotStore(root)
    coord, keys = MemoryCoordinator(), Keyspace("/bench")
    record_commit(coord, keys, JOB, Committed(0, STEP, tuple(range(OLD)),
                                              {r: holders_of(r) for r in range(OLD)}))
    replicator = Replicator(name, coord, keys, store, SECRET, m=2,
                            peers_address=lambda n: tuple(book[n]) if n in book else None,
                            timeout=300.0)
    service = CheckpointService(store, name, replicator=replicator)
    server = LocalServer(sock, service.handlers())
    server.start()
    conn.send("ready")
    try:
        while True:
            ready = wait([conn, control])
            if conn in ready:
                break
            what = control.recv()
            if what == "forget":
                counters = dict(replicator.counters)
                # The job's slots go (what a run fetched whole); its restore scratch kept
                # for the next restore stays, as it does on a node between two restores
                # (remove_job, the job leaving the node, would delete it).
                for held_job, rank, _, _ in store.holdings():
                    if held_job == JOB:
                        store.remove(JOB, rank)
                # What the restore scratch was: a kept segment of the same old rank, another
                # kept one, or a new file (the kept pages and the workers' kept mappings).
                control.send({"counters": counters, "shm_bytes": store.bytes_held(),
                              "scratch_handed": dict(getattr(store.scratch, "handed", {}))})
            elif what == "membership":
                changed = getattr(getattr(service, "restores", None), "membership_changed", None)
                if changed is not None:
                    changed(JOB)
                control.send("ok")
    finally:
        server.stop()
        replicator.close()
        store.close()
        profiles.dump()


# -- torch side (spawned processes) --------------------------------------------------------------


def build(dims: list[int]):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model, opt, dims: list[int], seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, dims[0], generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def local_tensors(model, opt):
    """(name, local tensor) of every parameter's shard and every optimizer state tensor."""
    names = {p: n for n, p in model.named_parameters()}
    out = [(f"model/{n}", p.to_local()) for n, p in model.named_parameters()]
    for p, st in opt.state.items():
        for k, v in sorted(st.items()):
            out.append((f"optim/{names[p]}/{k}", v.to_local() if hasattr(v, "to_local") else v))
    return out


def digest(model, opt) -> dict[str, str]:
    """xxh3 of every local tensor's bytes, with its dtype and shape."""
    import torch
    import xxhash

    return {n: f"{t.dtype}{tuple(t.shape)}:" + xxhash.xxh3_64_hexdigest(
        t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        for n, t in local_tensors(model, opt)}


def clear(model, opt) -> None:
    import torch

    with torch.no_grad():
        for _, t in local_tensors(model, opt):
            t.zero_()


def drop_cache(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(directory: str) -> None:
    buf = bytearray(8 << 20)
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


class TimedTransport:
    """The worker's daemon client, timing each op (seconds summed per op name)."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, {}

    def call(self, op: str, **fields):
        start = time.perf_counter()
        try:
            return self.inner.call(op, **fields)
        finally:
            self.seconds[op] = self.seconds.get(op, 0.0) + time.perf_counter() - start

    def send(self, op: str, **fields):
        return self.inner.send(op, **fields)

    def start(self, op: str, **fields):
        """The call made now, timed (a tree measured may be older than
        elasticd.worker.transport, so this is not one of its Transports)."""
        return _Answered(self.call(op, **fields))

    def close(self) -> None:
        self.inner.close()


class _Answered:
    def __init__(self, reply) -> None:
        self.reply = reply

    def result(self):
        return self.reply

    def close(self) -> None:
        for fd in self.reply.get("_fds", ()):
            os.close(fd)


def timed_load_into(seconds: list[float]):
    """Wraps state.load_into (the reshard and the loads) to time it, where restore() finds it
    (its module's own name for it)."""
    from elasticd.worker import restore as restore_module
    from elasticd.worker import state as state_module

    real = state_module.load_into

    def load_into(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    state_module.load_into = restore_module.load_into = load_into


def saver(rank: int, port: int, dims: list[int], book: dict, dcp_dir: str, root: str) -> None:
    """An old rank (world 3): one training step, its elasticd snapshot pushed to its two
    holders, and its part of the DCP save."""
    code_tree.check(os.environ[TREE_ENV])
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elasticd.worker.checkpointer import Checkpointer
    from elasticd.testing.transport import InProcessTransport
    from elasticd.replication.shm_sink import descriptor_of
    from elasticd.replication.transport import ReplicaClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=OLD)
    try:
        model, opt = build(dims)
        train_step(model, opt, dims, seed=rank)
        store = SlotStore(root)
        store.tagger = BlockTagger(SECRET).tag  # as a daemon seals its snapshots (node.py)
        try:
            service = CheckpointService(store, f"old{rank}")
            with Checkpointer(transport=InProcessTransport(service.handlers()), job=JOB,
                              rank=rank, world_size=OLD, local_world_size=1) as ckpt:
                assert ckpt.save(STEP, {"model": model, "optim": opt}), "snapshot skipped"
                ckpt.wait()
                assert ckpt.stats["saves"] == 1, ckpt.stats
            view = store.latest(JOB, rank, pin=True)
            d = descriptor_of(view)
            for h in holders_of(rank):
                with ReplicaClient.connect(*book[h], SECRET, f"old{rank}", timeout=300.0) as c:
                    c.push(d, view.buffer[: d.header_bytes],
                           view.buffer[d.header_bytes : d.total_bytes], tags=view.tags)
            view.release()
        finally:
            store.close()
            shutil.rmtree(root, ignore_errors=True)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def pull_verified(raw_book: list, buf: memoryview) -> None:
    """The verified floor: ``buf`` (whole 4 MiB blocks) filled over raw loopback TCP, a third
    from each holder at once, every block checked against its tag as it lands."""
    blocks = len(buf) // verified_floor.BLOCK
    cuts = [blocks * i // len(raw_book) * verified_floor.BLOCK for i in range(len(raw_book) + 1)]

    def pull(address, part: memoryview) -> None:
        with socket.create_connection(tuple(address)) as s:
            verified_floor.tune(s)
            s.sendall((len(part) // verified_floor.BLOCK).to_bytes(8, "little"))
            verified_floor.receive(s, part)

    threads = [threading.Thread(target=pull, args=(a, buf[lo:hi]))
               for a, lo, hi in zip(raw_book, cuts, cuts[1:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class CpuMeter:
    """CPU seconds of every process on the restore's path over one variant's run: the two
    daemons and three holders (read from /proc by rank 0) and the workers (each its own,
    summed over the ranks). Call :meth:`start` after the barrier that opens the run and
    :meth:`stop` after the all-reduce that closes it (every rank is done by then)."""

    def __init__(self, rank: int, pids: dict[str, int]) -> None:
        self.rank, self.pids = rank, pids
        self._procs: dict[str, float] = {}
        self._mine = 0.0

    def _read(self) -> dict[str, float]:
        return {n: cpu_seconds(pid) for n, pid in self.pids.items()} if self.rank == 0 else {}

    def start(self) -> None:
        self._procs, self._mine = self._read(), time.process_time()

    def stop(self) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        mine = torch.tensor([0.0] * NEW, dtype=torch.float64)
        mine[self.rank] = time.process_time() - self._mine
        dist.all_reduce(mine)
        after = self._read()
        out = {n: after[n] - t for n, t in self._procs.items()}
        out.update({f"worker rank {r}": float(mine[r]) for r in range(NEW)})
        return out


def worker(rank: int, port: int, dims: list[int], sock: str, control, dcp_dir: str,
           repeat: int, out_path: str, raw_book: list, pids: dict, idle: float,
           variants: tuple = VARIANTS, book: dict | None = None) -> None:
    """A new rank (world 2): runs every variant ``repeat + 1`` times (the first round is the
    first restore of these processes, after ``idle`` seconds) and writes its timings to
    ``out_path``."""
    code_tree.check(os.environ[TREE_ENV])
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elasticd.worker.checkpointer import Checkpointer
    from elasticd.worker.client import DaemonClient
    from elasticd.worker.scratch_maps import SCRATCH_MAPS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=NEW)
    try:
        model, opt = build(dims)
        train_step(model, opt, dims, seed=100 + rank)  # Adam state exists, other values
        state = {"model": model, "optim": opt}
        transport = TimedTransport(DaemonClient(sock, timeout=600.0))
        loads: list[float] = []
        timed_load_into(loads)
        ckpt = Checkpointer(transport=transport, job=JOB, rank=rank, world_size=NEW,
                            local_world_size=1)
        meter = CpuMeter(rank, pids)
        local_bytes = sum(t.numel() * t.element_size() for _, t in local_tensors(model, opt))
        # The floor receives this rank's state bytes in whole blocks: into a fresh buffer
        # (not faulted in) in the first round, as elasticd's first restore has fresh memory
        # too, and into that same buffer, faulted in by then, in the timed rounds.
        floor_bytes = -(-local_bytes // verified_floor.BLOCK) * verified_floor.BLOCK
        floor_buf = None
        spike = None
        if SPIKE in variants:  # test-only: it is given the cluster secret
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "spikes"))
            from worker_fetch import WorkerFetch

            spike = WorkerFetch(rank, JOB, OLD, (0, STEP), holders_of, book, SECRET)
        profiles = ThreadProfiles(f"worker-{rank}")
        prof = profiles.main() if profiles.dir else None
        rows = []
        for rnd in range(repeat + 1):
            digests = {}
            for variant in variants:
                fetched = None
                if variant != "floor":
                    clear(model, opt)
                    zeroed = digest(model, opt)
                if variant == "elasticd":
                    control.send("forget")
                    fetched = control.recv()
                elif variant.startswith("dcp") and rank == 0:
                    (warm_cache if variant == "dcp_warm" else drop_cache)(dcp_dir)
                if rnd == 0 and variant in ("elasticd", "floor", SPIKE):
                    # As after a failure: memory freed a while ago (the saver processes',
                    # the other variants') has gone back to the host (free page reporting).
                    time.sleep(idle)
                dist.barrier()
                meter.start()
                start = time.perf_counter()
                parts = {}
                if variant == "floor":
                    if floor_buf is None:
                        floor_buf = mmap.mmap(-1, floor_bytes)  # fresh: faulted in as it lands
                    pull_verified(raw_book, memoryview(floor_buf))
                elif variant == SPIKE:
                    parts = spike.restore(state)
                elif variant == "elasticd":
                    transport.seconds.clear()
                    loads.clear()
                    # (An elasticd before these counters, run by this bench for an A/B: 0.)
                    maps = (getattr(SCRATCH_MAPS, "made", 0), getattr(SCRATCH_MAPS, "reused", 0))
                    # The window opens at the membership change, which the daemon is told
                    # first (what it prepares then counts inside the window).
                    control.send("membership")
                    assert control.recv() == "ok"
                    if prof is not None and rnd:
                        prof.enable()
                    step = ckpt.restore(state)
                    if prof is not None and rnd:
                        prof.disable()
                    res = ckpt.last_restore
                    assert (step, res.saved_world_size, res.source) == (STEP, OLD, "peer"), res
                    parts = {"restore_seconds": res.seconds, "nbytes": res.nbytes,
                             "ckpt_fetch_seconds": transport.seconds.get("ckpt_fetch", 0.0),
                             "daemon_calls_seconds": sum(transport.seconds.values()),
                             "load_into_seconds": sum(loads),
                             # Restore scratch mapped anew / through the mapping kept.
                             "scratch_maps": [getattr(SCRATCH_MAPS, "made", 0) - maps[0],
                                              getattr(SCRATCH_MAPS, "reused", 0) - maps[1]],
                             # The worker's own fetch (worker/direct.py), when it took it.
                             "direct": getattr(res, "direct", None)}
                else:
                    msd, osd = get_state_dict(model, opt)
                    t1 = time.perf_counter()
                    sd = {"model": msd, "optim": osd}
                    dcp.load(sd, checkpoint_id=dcp_dir)
                    t2 = time.perf_counter()
                    set_state_dict(model, opt, model_state_dict=sd["model"],
                                   optim_state_dict=sd["optim"])
                    parts = {"get_state_dict": t1 - start, "dcp_load": t2 - t1,
                             "set_state_dict": time.perf_counter() - t2}
                seconds = time.perf_counter() - start
                slowest = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                cpu = meter.stop()
                rows.append({"round": rnd, "variant": variant, "rank": rank,
                             "seconds": seconds, "slowest_rank_seconds": float(slowest),
                             "daemon_before": fetched, "cpu": cpu if rank == 0 else None,
                             **parts})
                if variant != "floor":
                    got = digest(model, opt)
                    assert got != zeroed and got.keys() == zeroed.keys(), variant
                    digests[variant] = got
            differ = [n for n in digests["elasticd"]
                      if len({digests[v][n] for v in digests}) != 1]
            assert not differ, f"rank {rank}: elasticd and dcp.load differ on {differ[:5]}"
        control.send("forget")  # leave the daemon's counters after the last run in the log
        rows.append({"round": repeat + 1, "variant": "final", "rank": rank,
                     "daemon_before": control.recv(), "local_state_bytes": local_bytes})
        ckpt.close()
        if spike is not None:
            spike.close()
        profiles.dump()
        with open(out_path, "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


# -- orchestration ---------------------------------------------------------------------------


def run_spawned(ctx, target, args_of, n: int, timeout: float) -> None:
    procs = [ctx.Process(target=target, args=args_of(i)) for i in range(n)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:  # also when the bench is stopped (SIGTERM): no rank outlives it
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"{target.__name__} processes failed (index, exit code): {bad}")


def dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1100,
                        help="MiB of state (parameters + Adam's two moments), about")
    parser.add_argument("--layers", type=int, default=12, help="Linear layers (plus a head)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per phase")
    parser.add_argument("--huge-tmpfs", action="store_true",
                        help="put every slot store on a tmpfs of its own mounted with "
                             "huge=within_size (root), as systemd/run-elasticd-shm.mount does, "
                             "instead of /dev/shm")
    parser.add_argument("--idle", type=float, default=10.0,
                        help="seconds of idle before the first round's elasticd and floor runs "
                             "(memory freed before goes back to the host meanwhile)")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--profile", default="",
                        help="write cProfile stats of every daemon and holder thread and of "
                             "the workers' timed restores to this directory (slows the "
                             "runs: for finding costs, not for figures)")
    parser.add_argument("--spike-worker-fetch", action="store_true",
                        help="also run, each round after the floor, the spike of a worker "
                             "that fetches its own rows (bench/spikes/worker_fetch.py; "
                             "test-only: its workers hold the cluster secret)")
    args = parser.parse_args()
    variants = VARIANTS + ((SPIKE,) if args.spike_worker_fetch else ())
    # A run stopped by SIGTERM (a hold's `timeout`) still stops its processes and removes its
    # stores: killed outright, one left 4.3 GB in /dev/shm (bench/results/restore36/).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ[TREE_ENV] = code_tree.package_dir()  # read by the spawned processes
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ[PROFILE_ENV] = os.path.abspath(args.profile)
    dims = widths(args.mib, args.layers)
    total_state = state_bytes(dims)
    tag = uuid.uuid4().hex[:10]
    work = tempfile.mkdtemp(prefix="elasticd-bench-shard-", dir="/tmp")
    mount_point = ""
    if args.huge_tmpfs:
        mount_point = os.path.join(work, "huge")
        os.mkdir(mount_point, 0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=75%,mode=0700",
                        f"elasticd-bench-{tag}", mount_point], check=True)
        shm = os.path.join(mount_point, "stores")
    else:
        shm = f"/dev/shm/elasticd-bench-shard-{tag}"
    pages = probe(shm)
    dcp_dir = os.path.join(work, "dcp")
    fork, spawn = mp.get_context("fork"), mp.get_context("spawn")
    stops, procs = [], []
    started = time.perf_counter()
    try:
        book, pids, raw_book = {}, {}, []
        for i in range(OLD):
            a, b = fork.Pipe()
            p = fork.Process(target=holder, args=(b, f"h{i}", f"{shm}/h{i}", True), daemon=True)
            p.start()
            book[f"h{i}"] = list(a.recv())
            raw_book.append(a.recv())
            pids[f"holder h{i}"] = p.pid
            stops.append(a)
            procs.append(p)
        controls = []
        for i in range(NEW):
            a, b = fork.Pipe()
            mine, theirs = fork.Pipe()
            p = fork.Process(target=daemon, args=(b, mine, f"n{i}", f"{shm}/n{i}",
                                                  os.path.join(work, f"n{i}.sock"), book),
                             daemon=True)
            p.start()
            assert a.recv() == "ready"
            pids[f"daemon n{i}"] = p.pid
            stops.append(a)
            procs.append(p)
            controls.append(theirs)
        t0 = time.perf_counter()
        port = free_port()
        run_spawned(spawn, saver, lambda r: (r, port, dims, book, dcp_dir, f"{shm}/old{r}"),
                    OLD, args.timeout)
        save_seconds = time.perf_counter() - t0
        dcp_bytes = dir_bytes(dcp_dir)
        port = free_port()
        outs = [os.path.join(work, f"worker{r}.json") for r in range(NEW)]
        run_spawned(spawn, worker, lambda r: (r, port, dims, os.path.join(work, f"n{r}.sock"),
                                              controls[r], dcp_dir, args.repeat, outs[r],
                                              raw_book, pids, args.idle, variants, book),
                    NEW, args.timeout)
        rows = [row for path in outs for row in json.load(open(path))]
    finally:
        for a in stops:
            try:
                a.send("stop")
            except OSError:  # gone already (a SIGTERM reaches the whole process group)
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(shm, ignore_errors=True)
        if mount_point:
            subprocess.run(["umount", mount_point], check=True)
        shutil.rmtree(work, ignore_errors=True)
    left = [n for n in os.listdir("/dev/shm") if tag in n]
    assert not left, f"left in /dev/shm: {left}"
    summary = summarise(args, dims, total_state, dcp_bytes, save_seconds, rows,
                        time.perf_counter() - started, variants)
    summary["slot_pages"] = pages.describe()
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")


def paired_cpu(timed: list[dict], variant: str = "elasticd", base: str = "floor") -> dict:
    """elasticd's CPU per restore over the floor's (``variant``'s over ``base``'s), every
    process, round by round: the two ran in each round, so each round is one paired sample of
    the ratio (the floor's own CPU moves by ±15 % from run to run on this host); the median
    over the rounds, and how many were <= 1.5x. ``--repeat`` sets how many."""
    total = {(r["variant"], r["round"]): sum(r["cpu"].values()) for r in timed
             if r["rank"] == 0 and r["variant"] in (variant, base)}
    rounds = sorted(k for v, k in total if v == variant and (base, k) in total)
    ratios = [total[variant, k] / total[base, k] for k in rounds]
    return {"rounds": rounds,
            f"{variant}_cpu_seconds": [round(total[variant, k], 3) for k in rounds],
            f"{base}_cpu_seconds": [round(total[base, k], 3) for k in rounds],
            "ratios": [round(x, 3) for x in ratios],
            "median_ratio": round(statistics.median(ratios), 3),
            "rounds_at_most_1_5x": sum(x <= 1.5 for x in ratios)}


def direct_figures(rows: list) -> dict | None:
    """The medians of the worker's own fetches' figures over ``rows`` (``RestoreResult.direct``
    of each timed restore), with how many restores took that path."""
    took = [r for r in rows if r]
    if not took:
        return None
    return {"restores": len(took), "of": len(rows),
            **{k: statistics.median(r[k] for r in took)
               for k in ("wire_bytes", "routed_bytes", "remote_ranks", "seconds")}}


def spike_summary(results: dict, timed: list[dict], runs) -> dict:
    """``--spike-worker-fetch``: the spike beside the floor and beside elasticd's own path,
    each paired round by round, and where its time went (rank 0, medians)."""
    spike, floor, el = (results[LABELS[v]] for v in (SPIKE, "floor", "elasticd"))
    parts = ("headers_seconds", "plan_seconds", "fetch_seconds", "load_seconds",
             "wire_bytes", "routed_bytes")
    return {"spike_worker_fetch": {
        "over_verified_floor": {
            "cpu_seconds_per_restore_timed_paired_median":
                paired_cpu(timed, SPIKE)["median_ratio"],
            "timed_rounds_seconds": round(spike["seconds"] / floor["seconds"], 3),
            "first_round_seconds": round(spike["first_round_seconds"]
                                         / floor["first_round_seconds"], 3)},
        "over_elasticd": {
            "cpu_seconds_per_restore_timed_paired_median":
                paired_cpu(timed, SPIKE, "elasticd")["median_ratio"],
            "timed_rounds_seconds": round(spike["seconds"] / el["seconds"], 3)},
        "cpu_per_restore_paired_by_round": paired_cpu(timed, SPIKE),
        "rank0_medians": {k: round(statistics.median(runs(SPIKE, k)), 4) for k in parts}}}


def summarise(args, dims, total_state, dcp_bytes, save_seconds, rows, wall,
              variants: tuple = VARIANTS) -> dict:
    timed = [r for r in rows if 1 <= r["round"] <= args.repeat and r["variant"] in variants]
    first = [r for r in rows if r["round"] == 0 and r["variant"] in variants]

    def runs(variant: str, key: str = "slowest_rank_seconds", rank: int = 0,
             among: list | None = None) -> list[float]:
        return [r[key] for r in (timed if among is None else among)
                if r["variant"] == variant and r["rank"] == rank]

    gib = total_state / (1 << 30)

    def cpu_of(variant: str, among: list) -> dict:
        """CPU seconds per restore of each process (median over ``among``'s rounds), the total,
        and the same per restored GiB of state."""
        per_run = runs(variant, "cpu", 0, among)
        names = sorted(per_run[0])
        med = {n: statistics.median(c[n] for c in per_run) for n in names}
        total = statistics.median(sum(c.values()) for c in per_run)
        return {"per_restore": {**{n: round(v, 3) for n, v in med.items()},
                                "total": round(total, 3)},
                "per_restored_gib": {**{n: round(v / gib, 3) for n, v in med.items()},
                                     "total": round(total / gib, 3)}}

    results = {}
    for v in variants:
        s = runs(v)
        med = statistics.median(s)
        results[LABELS[v]] = {
            "seconds": round(med, 4), "gb_per_s_of_state": round(total_state / med / 1e9, 3),
            "runs": [round(x, 4) for x in s],
            "per_rank_median_seconds": [round(statistics.median(runs(v, "seconds", r)), 4)
                                        for r in range(NEW)],
            "first_round_seconds": round(runs(v, among=first)[0], 4),
            "cpu_seconds_timed": cpu_of(v, timed), "cpu_seconds_first_round": cpu_of(v, first)}
        if v.startswith("dcp"):
            for part in ("get_state_dict", "dcp_load", "set_state_dict"):
                results[LABELS[v]][f"{part}_median_seconds_rank0"] = round(
                    statistics.median(runs(v, part)), 4)
    # What each new rank's daemon fetched from the peers per restore (counter deltas).
    fetch = []
    for rank in range(NEW):
        befores = [r["daemon_before"]["counters"] for r in rows
                   if r["rank"] == rank and r["daemon_before"] is not None]
        deltas = [{k: b.get(k, 0) - a.get(k, 0) for k in ("fetches", "fetch_bytes",
                                                           "fetch_micros")}
                  for a, b in zip(befores, befores[1:])]
        timed_deltas = deltas[1 : args.repeat + 1]
        handed = [r["daemon_before"].get("scratch_handed", {}) for r in rows
                  if r["rank"] == rank and r["daemon_before"] is not None]
        handed_timed = [{k: b.get(k, 0) - a.get(k, 0) for k in b}
                        for a, b in zip(handed, handed[1:])][1 : args.repeat + 1]
        fetch.append({
            "old_snapshots_fetched_per_restore": statistics.median(d["fetches"]
                                                                   for d in timed_deltas),
            "wire_bytes_per_restore": statistics.median(d["fetch_bytes"] for d in timed_deltas),
            "fetch_seconds_median (daemon: striped fetch + verify, per restore)": round(
                statistics.median(d["fetch_micros"] for d in timed_deltas) / 1e6, 4),
            "restore_seconds_median (Checkpointer's own figure)": round(statistics.median(
                runs("elasticd", "restore_seconds", rank)), 4),
            "ckpt_fetch_seconds_median (worker waits on its daemon: reserve, striped fetch, "
            "verify, complete, open)": round(statistics.median(
                runs("elasticd", "ckpt_fetch_seconds", rank)), 4),
            "all_daemon_calls_seconds_median": round(statistics.median(
                runs("elasticd", "daemon_calls_seconds", rank)), 4),
            "load_into_seconds_median (reshard + model/optimizer load_state_dict)": round(
                statistics.median(runs("elasticd", "load_into_seconds", rank)), 4),
            "restored_bytes_per_restore": statistics.median(
                runs("elasticd", "nbytes", rank)),
            # The worker's own fetch (elasticd/worker/direct.py): how many timed restores
            # took it, and its figures' medians (None: the daemon's path every time).
            "direct_fetch": direct_figures(runs("elasticd", "direct", rank)),
            # Over the timed rounds: the scratch the daemon's partial copies landed in (a kept
            # segment of the same old rank, another kept one, a new file) and the worker's
            # mappings of it (made, or kept from the restore before).
            "timed_rounds_scratch_handed": {k: sum(d.get(k, 0) for d in handed_timed)
                                            for k in ("same", "other", "new")},
            "timed_rounds_scratch_maps_made_reused": [
                sum(m[i] for m in runs("elasticd", "scratch_maps", rank) if m) for i in (0, 1)],
            # The first round, in processes that had restored nothing yet: what a recovery's
            # fresh workers and daemons see (first imports, first-touch memory, caches).
            "first_round": {k: round(r[k], 4) for r in first
                            if r["variant"] == "elasticd" and r["rank"] == rank
                            for k in ("seconds", "restore_seconds", "ckpt_fetch_seconds",
                                      "load_into_seconds")}})
    el = results[LABELS["elasticd"]]
    floor = results[LABELS["floor"]]
    warm = results[LABELS["dcp_warm"]]["seconds"]
    cold = results[LABELS["dcp_cold"]]["seconds"]
    local = [r["local_state_bytes"] for r in rows if r["variant"] == "final"]

    def ratio(key: str, part: str | None = None) -> float:
        if part is None:
            return round(el[key] / floor[key], 3)
        return round(el[key]["per_restore"]["total"] / floor[key]["per_restore"]["total"], 3)

    paired = paired_cpu(timed)
    over = {"cpu_seconds_per_restore_timed_paired_median": paired["median_ratio"],
            "timed_rounds_seconds": ratio("seconds"),
            "first_round_seconds": ratio("first_round_seconds"),
            "cpu_seconds_per_restore_timed": ratio("cpu_seconds_timed", "total"),
            "cpu_seconds_per_restore_first_round": ratio("cpu_seconds_first_round", "total")}
    return {
        "benchmark": "sharded_restore",
        "command": " ".join(["bench/bench_sharded_restore.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "code": code_tree.describe(),
        "state": {"mib_asked": args.mib, "bytes": total_state,
                  "gib": round(total_state / (1 << 30), 3),
                  "what": "FSDP2 (fully_shard per Linear + root, gloo, CPU) parameters and "
                          "Adam exp_avg/exp_avg_sq (+ step)",
                  "layer_dims": dims, "new_rank_local_state_bytes": local,
                  "dcp_save_bytes_on_disk": dcp_bytes},
        "setup": {"old_world": OLD, "new_world": NEW, "holders": OLD, "copies_per_old_rank": 2,
                  "holders_of_old_rank": {r: list(holders_of(r)) for r in range(OLD)},
                  "new_ranks": "concurrently, from a barrier; figure = the slower rank",
                  "threads_per_rank": 1, "repeat": args.repeat,
                  "first_round": f"the processes' first restore, after {args.idle} s idle; "
                                 "elasticd's window opens at the membership change the "
                                 "daemons are told; the floor's receives into fresh memory",
                  "world3_save_seconds": round(save_seconds, 1)},
        "results": results,
        "elasticd_fetch": fetch,
        "cpu_per_restore_paired_by_round": paired,
        "elasticd_over_verified_floor": over,
        "targets": {"timed rounds <= 1.5x the verified floor": over["timed_rounds_seconds"] <= 1.5,
                    "first round <= 1.5x the verified floor's first round":
                        over["first_round_seconds"] <= 1.5,
                    "CPU per restore, every process, <= 1.5x the floor's":
                        over["cpu_seconds_per_restore_timed"] <= 1.5},
        **(spike_summary(results, timed, runs) if SPIKE in variants else {}),
        "elasticd_over_dcp_warm": round(el["seconds"] / warm, 3),
        "dcp_cold_over_elasticd": round(cold / el["seconds"], 2),
        "verified_floor_over_dcp_warm": round(floor["seconds"] / warm, 3),
        "wall_seconds": round(wall, 1),
    }


if __name__ == "__main__":
    main()
