"""Faults as data, and the injector that applies them to a running chaos cluster.

A scenario writes its faults as a plan::

    FaultPlan().kill_node("n2", at_step=20).restart_node("n2", after=3.0)

Each :class:`Fault` says what happens, to which node, and when: once the job has reached a
training step (``at_step``, the newest step any worker printed) or some seconds after the
previous fault fired (``after``). Faults fire in plan order. A fault that lasts (a pause, a
partition) is undone by the injector after ``seconds``. A fault with ``after_bytes`` is armed
at its time and *lands* later, once that many bytes went out of the node's replication port
(a fetch served by it, well under way): so it hits in the middle of a transfer however fast
the transfer runs; its ``seconds`` count from the landing. The :class:`Injector` knows how to do
each kind to the processes of a :class:`~tests.chaos.harness.ChaosCluster` and records what it
did (:class:`FaultRecord`): when, at which step, what etcd had committed at that moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import mmap
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tests.chaos.harness import ChaosCluster

KINDS = ("kill_worker", "kill_node", "kill_group", "restart_node", "kill_etcd_leader",
         "pause_etcd", "pause_daemon", "partition", "corrupt_replicas", "sigterm_node", "drain",
         "wipe_etcd", "blackhole_port", "freeze_node")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of a plan.

    Attributes:
        kind: one of :data:`KINDS`.
        node: the target node id ("" when the fault finds its own target: the etcd leader,
            a replica group, every etcd member).
        at_step: fire once the job reached this step; None: ``after`` seconds after the
            previous fault fired (or after training started, for the first fault).
        after: see ``at_step``.
        seconds: how long a pause or a partition lasts.
        after_bytes: 0: the fault lands when it fires; else it is armed then and lands once
            this many bytes went out of the node's replication port (see the module).
    """

    kind: str
    node: str = ""
    at_step: int | None = None
    after: float = 0.0
    seconds: float = 0.0
    after_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.at_step is not None and self.at_step < 1:
            raise ValueError(f"at_step must be >= 1, got {self.at_step}")
        if self.after < 0 or self.seconds < 0:
            raise ValueError(f"after and seconds must be >= 0, got {self.after}, {self.seconds}")
        if self.after_bytes < 0 or (self.after_bytes and self.kind not in ARMED_KINDS):
            raise ValueError(f"after_bytes must be >= 0 and only given to "
                             f"{', '.join(ARMED_KINDS)}; got {self.after_bytes} for {self.kind}")

    def describe(self) -> str:
        when = f"at step {self.at_step}" if self.at_step is not None else f"after {self.after} s"
        target = f" {self.node}" if self.node else ""
        lasting = f" for {self.seconds} s" if self.seconds else ""
        landing = (f", landing after {self.after_bytes} bytes out of its replication port"
                   if self.after_bytes else "")
        return f"{self.kind}{target}{lasting} {when}{landing}"


#: Kinds that take ``after_bytes``.
ARMED_KINDS = ("blackhole_port", "freeze_node")


class FaultPlan:
    """An ordered list of faults, built fluently; every method returns the plan."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []

    def _add(self, kind: str, node: str = "", at_step: int | None = None, after: float = 0.0,
             seconds: float = 0.0, after_bytes: int = 0) -> "FaultPlan":
        self.faults.append(Fault(kind, node, at_step, after, seconds, after_bytes))
        return self

    def kill_worker(self, node: str, at_step: int | None = None, after: float = 0.0):
        """kill -9 of the node's (first) worker process; the agent and daemon stay."""
        return self._add("kill_worker", node, at_step, after)

    def kill_node(self, node: str, at_step: int | None = None, after: float = 0.0):
        """kill -9 of the daemon, its agent and workers; the node's RAM directory is deleted."""
        return self._add("kill_node", node, at_step, after)

    def kill_group(self, at_step: int | None = None, after: float = 0.0):
        """kill -9 of both nodes of the first replica group of the current placement: every
        copy of their shards is gone."""
        return self._add("kill_group", "", at_step, after)

    def restart_node(self, node: str = "", at_step: int | None = None, after: float = 0.0):
        """Starts the node's daemon again (a replacement with empty RAM after a kill); with no
        node, every node the previous fault hit."""
        return self._add("restart_node", node, at_step, after)

    def kill_etcd_leader(self, at_step: int | None = None, after: float = 0.0):
        """kill -9 of the etcd member that leads."""
        return self._add("kill_etcd_leader", "", at_step, after)

    def pause_etcd(self, seconds: float, at_step: int | None = None, after: float = 0.0):
        """SIGSTOP of every etcd member for ``seconds``, then SIGCONT."""
        return self._add("pause_etcd", "", at_step, after, seconds)

    def wipe_etcd(self, at_step: int | None = None, after: float = 0.0):
        """Stops every etcd member, deletes its data directory and starts it again on the same
        ports and cluster token: etcd comes back empty (revisions restart near 1), as after an
        operator's restore-from-nothing."""
        return self._add("wipe_etcd", "", at_step, after)

    def pause_daemon(self, node: str, seconds: float, at_step: int | None = None,
                     after: float = 0.0):
        """SIGSTOP of the node's daemon alone (its agent and workers keep running)."""
        return self._add("pause_daemon", node, at_step, after, seconds)

    def partition(self, node: str, seconds: float, at_step: int | None = None,
                  after: float = 0.0):
        """Cuts every packet between the node and the others for ``seconds``."""
        return self._add("partition", node, at_step, after, seconds)

    def blackhole_port(self, node: str, seconds: float, at_step: int | None = None,
                       after: float = 0.0, after_bytes: int = 0):
        """Drops every packet to and from the node's replication port (its replica server:
        fetches from it, pushes to it) for ``seconds``, both ways, without a reset: its
        connections hang. The rest of the node works (its lease, etcd, rendezvous, its own
        pushes to others), so no peer sees it fail. Needs ``partitions=True``."""
        return self._add("blackhole_port", node, at_step, after, seconds, after_bytes)

    def freeze_node(self, node: str, seconds: float, at_step: int | None = None,
                    after: float = 0.0, after_bytes: int = 0):
        """SIGSTOP of every process of the node (daemon, agent, workers) for ``seconds``, then
        SIGCONT. With ``after_bytes`` (needs ``partitions=True``: the node's cgroup counts
        them), once that many bytes went out of its replication port."""
        return self._add("freeze_node", node, at_step, after, seconds, after_bytes)

    def corrupt_replicas(self, node: str, at_step: int | None = None, after: float = 0.0):
        """Flips payload bytes of every replica that peers hold of ``node``'s ranks."""
        return self._add("corrupt_replicas", node, at_step, after)

    def sigterm_node(self, node: str, at_step: int | None = None, after: float = 0.0):
        """SIGTERM to the node's daemon: a clean departure."""
        return self._add("sigterm_node", node, at_step, after)

    def drain(self, node: str, at_step: int | None = None, after: float = 0.0):
        """``elasticctl drain NODE``."""
        return self._add("drain", node, at_step, after)

    def __iter__(self):
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)

    def __repr__(self) -> str:
        return "FaultPlan(" + "; ".join(f.describe() for f in self.faults) + ")"


@dataclasses.dataclass
class FaultRecord:
    """What the injector did.

    Attributes:
        fault: the planned fault.
        at: wall time it fired.
        step: the newest step any worker had printed then.
        committed: the committed (generation, step) in etcd right after it fired (None when
            there was none, or etcd could not say).
        targets: the nodes (or etcd members) it hit.
        detail: what exactly was done.
        undone_at: wall time a lasting fault was undone.
        landed: wall time the fault took effect (``at`` unless it was armed: ``after_bytes``).
    """

    fault: Fault
    at: float
    step: int
    committed: tuple[int, int] | None
    targets: list[str]
    detail: str = ""
    undone_at: float | None = None
    landed: float | None = None


class Injector:
    """Applies a plan's faults to a chaos cluster as the job reaches them."""

    def __init__(self, cluster: "ChaosCluster", plan: FaultPlan) -> None:
        self.cluster = cluster
        self.pending = list(plan)
        self.records: list[FaultRecord] = []
        self._undo: list[tuple[float, FaultRecord, Callable[[], None]]] = []
        # Armed faults that have not landed yet: (record, undo); their watcher sets landed.
        self._armed: list[tuple[FaultRecord, Callable[[], None]]] = []
        self._last_fired = time.time()
        self._landings: dict[int, Callable[[], str]] = {}  # id(fault) -> what lands it
        #: The ranks each killed node ran, read before the kill: its job status goes with its
        #: lease, which a survivor's peer probe revokes ~0.2 s after a kill -9 (CI: a corrupt
        #: fault after a kill found the dead node's ranks gone, and so no replica to corrupt).
        self._ranks_before_kill: dict[str, list[int]] = {}
        self._disarmed = threading.Event()

    @property
    def done(self) -> bool:
        return not self.pending and not self._undo and not self._armed

    @property
    def unfired(self) -> list[str]:
        """Faults of the plan that have not taken effect (not fired, or armed and not landed)."""
        return ([f.describe() for f in self.pending]
                + [r.fault.describe() + " (armed, never landed)" for r, _ in self._armed])

    def tick(self, step: int) -> None:
        """Fires the next faults that are due at ``step`` and undoes expired lasting ones."""
        now = time.time()
        for item in list(self._armed):
            record, undo = item
            if record.landed is not None:
                self._armed.remove(item)
                self._undo.append((record.landed + record.fault.seconds, record, undo))
                print(f"chaos: {record.fault.describe()}: landed {record.landed - record.at:.2f} s "
                      f"after it was armed: {record.detail}", flush=True)
        for item in list(self._undo):
            due, record, undo = item
            if now >= due:
                undo()
                record.undone_at = time.time()
                self._undo.remove(item)
        while self.pending:
            f = self.pending[0]
            due = step >= f.at_step if f.at_step is not None else now >= self._last_fired + f.after
            if not due:
                return
            self.pending.pop(0)
            self._fire(f, step)
            now = self._last_fired

    def undo_all(self) -> None:
        """Undoes every lasting fault still in force, and disarms those that never landed (the
        harness calls it before teardown)."""
        self._disarmed.set()
        for record, undo in self._armed:
            undo()
        self._armed.clear()
        for _, record, undo in self._undo:
            try:
                undo()
            finally:
                record.undone_at = time.time()
        self._undo.clear()

    def _fire(self, f: Fault, step: int) -> None:
        action = getattr(self, "_" + f.kind)
        at = time.time()
        targets, detail, undo = action(f)
        self._last_fired = time.time()
        self.cluster.poll()  # the step reached by the time it hit (the log is read every 50 ms)
        step = max(step, self.cluster.logs.max_step)
        record = FaultRecord(f, at, step, self.cluster.committed_now(), targets, detail)
        self.records.append(record)
        print(f"chaos: {f.describe()}: fired at step {step} on {targets}: {detail}; "
              f"committed {record.committed}", flush=True)
        if f.after_bytes:
            # ``action`` armed a watcher that sets record.landed; tick() schedules the undo.
            self._watch(record, undo)
        else:
            record.landed = at
            if undo is not None:
                self._undo.append((at + f.seconds, record, undo))

    # -- the faults ---------------------------------------------------------------------
    # Each returns (targets, detail, undo or None).

    def _kill_worker(self, f: Fault):
        pids = self.cluster.worker_pids(f.node)
        if not pids:
            raise RuntimeError(f"kill_worker: {f.node} runs no worker")
        os.kill(pids[0], signal.SIGKILL)
        return [f.node], f"SIGKILL to worker pid {pids[0]}", None

    def _kill_node(self, f: Fault):
        self._ranks_before_kill[f.node] = self.cluster.ranks_of(f.node)
        self.cluster.kill_node(f.node)
        return [f.node], "SIGKILL to daemon, agent and workers; RAM directory deleted", None

    def _kill_group(self, f: Fault):
        placement = self.cluster.placement()
        group = next(g for g in placement.groups if len(g) == placement.m)
        for node in group:
            self._ranks_before_kill[node] = self.cluster.ranks_of(node)
            self.cluster.kill_node(node)
        return list(group), f"killed replica group {list(group)} of {placement.groups}", None

    def _restart_node(self, f: Fault):
        nodes = [f.node] if f.node else list(self.records[-1].targets)
        for node in nodes:
            self.cluster.restart_node(node)
        return nodes, "daemon started again", None

    def _kill_etcd_leader(self, f: Fault):
        leader = self.cluster.etcd_server.leader()
        pid = leader.pid
        leader.kill()
        return [leader.name], f"SIGKILL to etcd leader {leader.name} (pid {pid})", None

    def _pause_etcd(self, f: Fault):
        members = [m for m in self.cluster.etcd_server.members if m.proc is not None]
        for m in members:
            m.signal(signal.SIGSTOP)

        def undo() -> None:
            for m in members:
                m.signal(signal.SIGCONT)

        return [m.name for m in members], "SIGSTOP to every etcd member", undo

    def _wipe_etcd(self, f: Fault):
        server = self.cluster.etcd_server
        for m in server.members:
            m.kill()
            shutil.rmtree(m.data_dir, ignore_errors=True)
        for m in server.members:
            m.start()
        server.wait_healthy(30)
        return [m.name for m in server.members], "etcd killed, data deleted, started empty", None

    def _pause_daemon(self, f: Fault):
        node = self.cluster.node(f.node)
        node.signal(signal.SIGSTOP)
        return [f.node], f"SIGSTOP to daemon pid {node.pid}", lambda: node.signal(signal.SIGCONT)

    def _partition(self, f: Fault):
        undo = self.cluster.partition(f.node)
        return [f.node], "every packet to and from the node dropped", undo

    def _watch(self, record: FaultRecord, undo: Callable[[], None] | None) -> None:
        """Lands an armed fault once its bytes went out of the node's replication port,
        from a thread of its own polling the count every millisecond (the harness's loop polls
        every 50 ms: a fetch moves tens of MB meanwhile)."""
        f = record.fault
        cut = self.cluster.port_cut(f.node)
        land = self._landings.pop(id(f))

        def watch() -> None:
            from tests.chaos.partition import PartitionError

            while not self._disarmed.is_set():
                try:
                    seen = cut.port_bytes()
                except PartitionError:
                    return  # healed meanwhile: the harness is tearing down
                if seen >= f.after_bytes:
                    detail = land()
                    record.landed = time.time()
                    record.detail += f"; landed with {seen} bytes counted: {detail}"
                    return
                time.sleep(0.001)

        self._armed.append((record, undo or (lambda: None)))
        threading.Thread(target=watch, daemon=True, name=f"chaos-{f.kind}-{f.node}").start()

    def _blackhole_port(self, f: Fault):
        # The kernel opens the hole itself at ``after_bytes`` (partition.py): nothing to do
        # when the watcher sees the count but to note it.
        port, undo = self.cluster.blackhole_port(f.node, f.after_bytes)
        self._landings[id(f)] = lambda: "packets of the port dropped"
        when = f"after {f.after_bytes} bytes out of it" if f.after_bytes else "now"
        return [f.node], f"every packet of replication port {port} dropped {when}", undo

    def _freeze_node(self, f: Fault):
        node = self.cluster.node(f.node)
        stopped: list[int] = []

        def freeze() -> str:
            # The daemon first (it serves the fetch), then its agent and workers: found by
            # their tag, twice, in case the agent started a worker between the scan and its
            # stop.
            node.signal(signal.SIGSTOP, group=True)
            stopped.append(node.pid)
            for _ in range(2):
                for pid in node.tagged():
                    if pid not in stopped:
                        try:
                            os.kill(pid, signal.SIGSTOP)
                            stopped.append(pid)
                        except ProcessLookupError:
                            pass
            return f"SIGSTOP to daemon pid {node.pid} and pids {stopped[1:]}"

        def thaw() -> None:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            with contextlib.suppress(ProcessLookupError):
                node.signal(signal.SIGCONT, group=True)
            heal()

        heal: Callable[[], None] = lambda: None  # noqa: E731
        if f.after_bytes:
            # The port is cut in the kernel at that byte, then the processes stopped: a
            # stopped process's kernel still sends what its sockets hold (8 MiB of send
            # buffer), which let a ~11 MiB piece finish after the stop in CI (no fetch was
            # left to abandon); a frozen machine sends nothing.
            _, heal = self.cluster.blackhole_port(f.node, f.after_bytes)
            self._landings[id(f)] = freeze
            return [f.node], ("every process SIGSTOPped once the bytes went out (the port cut "
                              "in the kernel at that byte)"), thaw
        return [f.node], freeze(), thaw

    def _corrupt_replicas(self, f: Fault):
        ranks = self.cluster.ranks_of(f.node) or self._ranks_before_kill.get(f.node, [])
        flipped = []
        for holder in self.cluster.nodes:
            if holder == f.node:
                continue
            root = self.cluster.node(holder).shm_dir + "+replicas"
            for rank in ranks:
                for path in glob.glob(os.path.join(root, self.cluster.job, str(rank), "*.slot")):
                    if flip_payload_byte(path):
                        flipped.append(f"{holder}:{os.path.relpath(path, root)}")
        if not flipped:
            raise RuntimeError(f"corrupt_replicas: no replica of {f.node}'s ranks {ranks} found")
        return [f.node], f"flipped a payload byte in {len(flipped)} replicas: {flipped}", None

    def _sigterm_node(self, f: Fault):
        node = self.cluster.node(f.node)
        node.signal(signal.SIGTERM)
        return [f.node], f"SIGTERM to daemon pid {node.pid}", None

    def _drain(self, f: Fault):
        out = subprocess.run([sys.executable, "-m", "elasticd.cli.main", "drain", f.node,
                              "--force", "--etcd", self.cluster.etcd, "--prefix",
                              self.cluster.prefix],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"elasticctl drain {f.node} exited {out.returncode}: "
                               f"{out.stderr.strip() or out.stdout.strip()}")
        return [f.node], out.stdout.strip(), None


def flip_payload_byte(path: str) -> bool:
    """Inverts one byte in the middle of a sealed snapshot's payload, in place (through a
    shared mapping, as a bad DIMM or a stray write would); False if the file holds no sealed
    snapshot."""
    from elasticd.snapshot.format import SnapshotError
    from elasticd.snapshot.reader import parse_header

    with open(path, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return False
        try:
            header = parse_header(fh.read(min(size, 1 << 20)), where=path)
        except SnapshotError:
            return False
        with mmap.mmap(fh.fileno(), size) as mm:
            lay = header.layout
            if lay.total_size <= lay.data_offset:
                return False
            at = (lay.data_offset + lay.total_size) // 2
            mm[at] = mm[at] ^ 0xFF
            mm.flush()
    return True


def sleep_until(cond: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Polls ``cond`` until it is truthy (returns it) or ``timeout`` passes (returns None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    return None
