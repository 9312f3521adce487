"""Simulated nodes for replication tests: each has its own shared-memory directories (local
slots and peer replicas), its own replica server on 127.0.0.1, and its own Replicator, all on
one in-memory (or real) etcd. Killing a node stops its server and replicator and deletes its
directories, so a shard "restored from a peer" can only be bytes that came over the transport.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import uuid

import numpy as np

from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout
from elasticd.store.api import SlotBusy
from elasticd.store.shm import CommitPending, SlotStore
from elasticd.coordination.api import Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.recovery.replicator import Replicator
from elasticd.replication.seal import BlockTagger
from elasticd.replication.shm_sink import ShmSink, replica_root
from elasticd.replication.transport import ReplicaServer

SECRET = b"cluster-secret-0123456789abcdef"
JOB = "job-1"
BLOCK = 64 << 10


def arrays_for(rank: int, step: int, generation: int = 0, n: int = 40_000) -> dict[str, np.ndarray]:
    """A rank's state at a step: a few tensors, deterministic, different for every argument."""
    rng = np.random.default_rng([rank, step, generation])
    return {"w": rng.standard_normal(n).astype(np.float32),
            "b": rng.standard_normal(257).astype(np.float64),
            "opt.exp_avg": rng.standard_normal(n // 2).astype(np.float32),
            "step": np.array(step, np.int64)}


def write_snapshot(store: SlotStore, rank: int, step: int, generation: int = 0,
                   world: int = 6, job: str = JOB, n: int = 40_000) -> bytes:
    """Writes and seals a snapshot into the local store; returns its bytes (a copy)."""
    arrays = arrays_for(rank, step, generation, n)
    specs = [TensorSpec(k, str(v.dtype), v.shape) for k, v in arrays.items()]
    lay = layout(specs, job=job, meta={"step": step}, block_size=BLOCK)
    header = SnapshotHeader(job, step, generation, rank, world, lay, {"step": step})
    slot = store.reserve(job, rank, lay.total_size)
    for e in lay.entries:
        slot.buffer[e.offset : e.offset + e.nbytes] = arrays[e.name].tobytes()
    store.complete(slot, header)
    return bytes(slot.buffer[: lay.total_size])


@dataclasses.dataclass
class Node:
    name: str
    root: str
    local: SlotStore
    sink: ShmSink
    server: ReplicaServer
    replicator: Replicator
    alive: bool = True

    def snapshot(self, rank: int, step: int, generation: int = 0, world: int = 6,
                 notify: bool = True) -> bytes:
        data = write_snapshot(self.local, rank, step, generation, world)
        if notify:
            self.replicator.on_local_snapshot(JOB, rank, (generation, step))
        return data

    def kill(self) -> None:
        """Power off: nothing of this node survives, its memory included (its election lease,
        if it coordinates, expires on its own)."""
        if not self.alive:
            return
        self.alive = False
        self.server.stop()
        self.replicator.close(resign=False)
        self.local.close()
        self.sink.store.close()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(replica_root(self.root), ignore_errors=True)


class Cluster:
    """``n`` nodes n1..nN; ``addresses`` maps live nodes to their replica servers."""

    def __init__(self, coord_factory, n: int, m: int = 2, sink_cls: type = ShmSink,
                 prefix: str = "/elasticd", tagged: bool = True, **replicator_kw) -> None:
        """``tagged``: local snapshots get their block tags at the seal, as node.py does."""
        self.base = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
        self.keys = Keyspace(prefix)
        self.addresses: dict[str, tuple[str, int]] = {}
        self.nodes: dict[str, Node] = {}
        self.coords: list[Coordinator] = []
        replicator_kw.setdefault("commit_wait", 0.5)
        replicator_kw.setdefault("withdraw_after", 0.5)
        replicator_kw.setdefault("timeout", 10.0)
        replicator_kw.setdefault("lease_ttl", 1.0)
        for i in range(1, n + 1):
            name = f"n{i}"
            root = os.path.join(self.base, name)
            local = SlotStore(root)
            if tagged:
                local.tagger = BlockTagger(SECRET).tag
            sink = sink_cls(SlotStore(replica_root(root)), local=local)
            server = ReplicaServer("127.0.0.1", 0, SECRET, name, sink, idle_timeout=10.0).start()
            self.addresses[name] = server.address
            coord = coord_factory()
            self.coords.append(coord)
            rep = Replicator(name, coord, self.keys, local, SECRET, m,
                             peers_address=self.address_of, sink=sink, **replicator_kw)
            server.on_report = rep.tracker.reporter.on_report
            self.nodes[name] = Node(name, root, local, sink, server, rep)

    def address_of(self, node: str) -> tuple[str, int] | None:
        return self.addresses.get(node)

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def live(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive]

    def set_membership(self, names: list[str], ranks: dict[str, list[int]], round: int) -> None:
        for name in names:
            self.nodes[name].replicator.set_membership(JOB, names, ranks, round)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until every live node is idle in one pass (a report one node sent may have made
        another's coordinator busy after that one was found idle)."""
        for _ in range(20):
            for node in self.live():
                assert node.replicator.wait_idle(timeout), f"{node.name} still busy"
            if all(node.replicator.wait_idle(0.05) for node in self.live()):
                return

    def kill(self, name: str) -> None:
        self.addresses.pop(name, None)
        self.nodes[name].kill()

    def close(self) -> None:
        for node in self.nodes.values():
            self.addresses.pop(node.name, None)
            node.kill()
        for coord in self.coords:
            coord.close()
        shutil.rmtree(self.base, ignore_errors=True)


class Stepper:
    """Snapshots every rank of the round each ``period``, as the checkpoint service does: only
    on the job's snapshot grid, and a snapshot refused by a pending commit is skipped and
    reported."""

    def __init__(self, cluster: Cluster, ranks: dict[str, list[int]], period: float = 0.1):
        self.cluster, self.ranks, self.period = cluster, ranks, period
        self.step, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        world = sum(len(r) for r in self.ranks.values())
        while not self.stop.wait(self.period):
            self.step += 1
            for name, ranks in self.ranks.items():
                node = self.cluster[name]
                if self.step % node.replicator.snapshot_grid(JOB):
                    continue
                for rank in ranks:
                    try:
                        node.snapshot(rank, self.step, world=world)
                    except CommitPending as exc:
                        node.replicator.on_commit_pending(JOB, exc.version, (0, self.step))
                    except SlotBusy:  # both slots held (a reader's pin): skipped, as a worker does
                        pass

    def __enter__(self) -> "Stepper":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
