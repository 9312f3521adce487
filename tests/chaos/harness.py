"""The chaos harness: a real cluster, a real training job, a fault plan, and what to check.

:class:`ChaosCluster` owns a 3-member etcd on loopback and N ``elasticd`` daemons as separate
processes (through :class:`~elasticd.launcher.LocalCluster`: each its own node id, ports, log and
``/dev/shm`` directory, deleted when the node is killed, with peer replication on, m = 2). It
submits ``examples/train.py`` as a real torchrun job on CPU (gloo; with ``--zero`` the optimizer
state is sharded across ranks by ``ZeroRedundancyOptimizer``, so a dead rank's shard exists
nowhere but in its replicas), starts the standby nodes once the job trains, and then plays a
:class:`~tests.chaos.faults.FaultPlan` against it while watching the workers' logs.

:meth:`ChaosCluster.run` returns an :class:`Outcome`, reconstructed from what the processes
wrote and etcd recorded — never from what the harness expected:

* attempts: every worker group (all ranks of one process group share an attempt id in their
  ``--sample-log`` records), with what each rank restored (its ``restored step S from SRC``
  line) and the steps it ran;
* recoveries: each attempt after the first, with the truth beside the report: the newest step
  any earlier attempt reached, and the committed / persisted step in force at the restore;
* the committed-step history (replayed from etcd's revisions), the final weights, and whatever
  process or ``/dev/shm`` file the run left behind.

Scenarios then call the ``assert_*`` methods of the outcome. A scenario is a few lines::

    out = ChaosCluster(tmp_path, Shape()).run(FaultPlan().kill_node("n2", at_step=20))
    out.assert_all(sources={"peer"}, reference=reference_weights)
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable

from elasticd.agent.supervisor import children
from elasticd.launcher import JOB_USER, LocalCluster, NodeProcess, job_writable
from tests.chaos.faults import FaultPlan, FaultRecord, Injector, sleep_until

#: A finished job's processes must stay gone for this many of the daemons' loop cycles
#: (``LocalCluster.loop_interval``, 0.25 s): a finished job started again (2ca8361's bug) starts
#: on the next one. (3 s before, 12 cycles: 2 s more in each of the suite's ~30 scenarios.)
STAY_GONE_CYCLES = 4

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")

STEP_RE = re.compile(r"\bstep (\d+) world (\d+) rank (\d+) restart (\d+) loss")
START_RE = re.compile(r"\bstart rank (\d+) world (\d+) restart (\d+) pid (\d+) restored step "
                      r"(\d+) from (\w+) in ([\d.]+) s, steps lost (\d+)")
DONE_RE = re.compile(r"\bdone rank (\d+) world (\d+) steps (\d+)")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The cluster and job of a scenario.

    Attributes:
        nodes: daemons started first; the job's first round is made of them.
        standby: daemons started once the job trains (with ``nnodes`` MIN = MAX they wait as
            standbys and replace a node that goes).
        nnodes: the job's ``--nnodes``.
        steps, step_time, batch_size: the training job (``examples/train.py``).
        zero: shard the optimizer state across ranks (``ZeroRedundancyOptimizer``).
        persist_every: flush every this many steps to a persistent tier (0: no tier).
        lease_ttl: the daemons' lease TTL (seconds).
        etcd_members: members of the etcd cluster the harness owns.
        daemon_args: more ``elasticd`` flags for every node.
    """

    nodes: tuple[str, ...] = ("n1", "n2", "n3")
    standby: tuple[str, ...] = ("n4",)
    nnodes: str = "3:3"
    steps: int = 50
    step_time: float = 0.05
    zero: bool = True
    persist_every: int = 0
    lease_ttl: int = 2
    etcd_members: int = 3
    daemon_args: tuple[str, ...] = ()

    @property
    def max_world(self) -> int:
        return int(self.nnodes.split(":")[-1])

    def reference(self) -> "Shape":
        """The failure-free run whose final weights a scenario at constant world size must
        match bit for bit: the same job on exactly ``max_world`` nodes."""
        nodes = tuple(f"n{i + 1}" for i in range(self.max_world))
        return dataclasses.replace(self, nodes=nodes, standby=(), persist_every=0,
                                   etcd_members=1, nnodes=f"{self.max_world}:{self.max_world}",
                                   step_time=0.05)  # the weights do not depend on it


# -- what the workers print ---------------------------------------------------------------

@dataclasses.dataclass
class LogEvent:
    node: str
    kind: str  # "step" | "start" | "done"
    fields: tuple
    seen: float  # wall time the harness read the line


class LogWatcher:
    """Tails every node's agent log (workers print there) and parses the lines it needs."""

    def __init__(self, path_of: Callable[[str], str]) -> None:
        self.path_of = path_of
        self.offsets: dict[str, int] = collections.defaultdict(int)
        self.partial: dict[str, str] = collections.defaultdict(str)
        self.events: list[LogEvent] = []
        self.max_step = 0

    def poll(self, nodes: Iterable[str]) -> None:
        now = time.time()
        for node in nodes:
            path = self.path_of(node)
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[node])
                    data = fh.read()
            except FileNotFoundError:
                continue
            self.offsets[node] += len(data)
            text = self.partial[node] + data.decode(errors="replace")
            lines = text.split("\n")
            self.partial[node] = lines.pop()
            for line in lines:
                self._parse(node, line, now)

    def _parse(self, node: str, line: str, now: float) -> None:
        for kind, regex in (("step", STEP_RE), ("start", START_RE), ("done", DONE_RE)):
            m = regex.search(line)
            if m:
                fields = tuple(float(g) if "." in g else int(g) if g.isdigit() else g
                               for g in m.groups())
                self.events.append(LogEvent(node, kind, fields, now))
                if kind == "step":
                    self.max_step = max(self.max_step, fields[0])
                return

    def of(self, kind: str) -> list[LogEvent]:
        return [e for e in self.events if e.kind == kind]


# -- what the run left behind ---------------------------------------------------------------

def _proc_shm_paths(pid: int) -> set[str]:
    """/dev/shm files a process maps or holds open."""
    found: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                i = line.find("/dev/shm/")
                if i >= 0 and not line.rstrip().endswith("(deleted)"):
                    found.add(line[i:].rstrip())
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/") and not target.endswith("(deleted)"):
                found.add(target)
    except OSError:
        pass
    return found


def _real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- the cluster ----------------------------------------------------------------------------

class ChaosCluster:
    """A real etcd cluster, real daemons, a real job, and the faults of a plan.

    Args:
        workdir: a directory of the test's own (logs, etcd data, the persistent tier, the
            sample logs, the final weights).
        shape: the cluster and the job.
        job: the job's name.
        train, train_args: the job's script and its own arguments (examples/train.py).
    """

    def __init__(self, workdir: str, shape: Shape, job: str = "chaos",
                 partitions: bool = False, train: str = TRAIN,
                 train_args: tuple[str, ...] = ()) -> None:
        self.partitions = partitions
        # Another script prints the same lines and writes the same sample logs (it is given
        # --steps, --step-time, --sample-log and --out).
        self.train, self.train_args = train, tuple(train_args)
        self.workdir = str(workdir)
        self.shape = shape
        self.job = job
        self.persist_dir = os.path.join(self.workdir, "persist") if shape.persist_every else ""
        # The job runs as JOB_USER: what its workers write must be that user's.
        self.samples_dir = job_writable(os.path.join(self.workdir, "samples"))
        self.out_dir = job_writable(os.path.join(self.workdir, "out"))
        args = list(shape.daemon_args)
        if self.persist_dir:
            os.makedirs(self.persist_dir)  # the shared filesystem every node mounts
            args += ["--persist-dir", self.persist_dir, "--persist-every-steps",
                     str(shape.persist_every), "--persist-keep", "1000"]
        self.cluster = LocalCluster(list(shape.nodes), workdir=self.workdir,
                                    lease_ttl=shape.lease_ttl, etcd_members=shape.etcd_members,
                                    extra_args=args, replication=True)
        self.logs = LogWatcher(self.agent_log)
        self.shm_seen: set[str] = set()
        self.pids_seen: dict[int, str] = {}  # pid -> node (daemons, agents, workers)
        self.job_uids: set[int] = set()  # real uids the job's processes ran as
        self._last_scan = 0.0
        self._stopped = False
        self.injector: Injector | None = None
        self._partitions: dict[str, Any] = {}  # node -> its cgroup (with partitions=True)

    # -- views used by the faults ---------------------------------------------------------

    @property
    def etcd(self) -> str:
        return self.cluster.etcd

    @property
    def prefix(self) -> str:
        return self.cluster.prefix

    @property
    def etcd_server(self):
        return self.cluster.etcd_server

    @property
    def nodes(self) -> dict[str, NodeProcess]:
        return self.cluster.nodes

    def node(self, node_id: str) -> NodeProcess:
        return self.cluster.nodes[node_id]

    def agent_log(self, node: str) -> str:
        return os.path.join(self.workdir, node, "jobs", self.job, "agent.log")

    def job_statuses(self) -> dict[str, dict[str, Any]]:
        """Every node's published view of the job (``jobs/<job>/nodes/<node>``)."""
        from elasticd.cluster.jobspec import NodeJobStatus

        kvs, _ = self.cluster.coordinator().get_prefix(self.cluster.keys.job_keys(self.job).nodes)
        out = {}
        for kv in kvs:
            st = NodeJobStatus.decode(kv.value, kv.key)
            out[st.node] = st.as_dict()
        return out

    def ranks_of(self, node: str) -> list[int]:
        return list(self.job_statuses().get(node, {}).get("ranks", []))

    def worker_pids(self, node: str) -> list[int]:
        st = self.job_statuses().get(node, {})
        return children(st["agent_pid"]) if st.get("agent_pid") else []

    def placement(self):
        from elasticd.replication.placement import decode_placement

        kv = self.cluster.coordinator().get(self.cluster.keys.replication(self.job).placement)
        if kv is None:
            raise RuntimeError(f"no placement recorded for {self.job}")
        return decode_placement(kv.value, kv.key)

    def committed_now(self) -> tuple[int, int] | None:
        from elasticd.replication.commit import read_committed

        try:
            c = read_committed(self.cluster.coordinator(), self.cluster.keys, self.job)
        except Exception:  # noqa: BLE001 — etcd may be the fault
            return None
        return c.version if c is not None else None

    def kill_node(self, node: str) -> None:
        self._scan()  # what it holds, before it goes
        self.cluster.nodes[node].kill()

    def restart_node(self, node: str) -> None:
        self.cluster.start_node(node, wait=False)
        self._enclose(node)

    def partition(self, node: str) -> Callable[[], None]:
        """Drops every packet of the node's processes (daemon, agent, workers: see
        :mod:`tests.chaos.partition`); returns what heals it."""
        if node not in self._partitions:
            raise RuntimeError("partition: build the cluster with partitions=True (each node "
                               "must live in its own cgroup from its start)")
        self._partitions[node].cut()
        return self._partitions[node].heal

    def replication_port(self, node: str) -> int:
        """The port of the node's replica server (from its node record)."""
        address = self.cluster.node_records().get(node, {}).get("replication", "")
        if not address:
            raise RuntimeError(f"{node} publishes no replication address")
        return int(address.rpartition(":")[2])

    def blackhole_port(self, node: str, after_bytes: int = 0) -> tuple[int, Callable[[], None]]:
        """Drops every packet of the node's replication port, both ways, once ``after_bytes``
        went out of it (see :mod:`tests.chaos.partition`); returns the port and what heals it."""
        return self._cut_port(node, after_bytes)

    def port_cut(self, node: str):
        """The node's cgroup (:class:`~tests.chaos.partition.Partition`), for its count."""
        return self._partitions[node]

    def _cut_port(self, node: str, after_bytes: int, count_only: bool = False
                  ) -> tuple[int, Callable[[], None]]:
        if node not in self._partitions:
            raise RuntimeError("a port cut needs the cluster built with partitions=True (each "
                               "node in its own cgroup from its start)")
        port = self.replication_port(node)
        self._partitions[node].cut(port=port, after_bytes=after_bytes, count_only=count_only)
        return port, self._partitions[node].heal

    def _enclose(self, node: str) -> None:
        """Puts a just-started daemon into its node's cgroup (before it opens any socket)."""
        if self.partitions:
            from tests.chaos.partition import Partition

            if node not in self._partitions:
                self._partitions[node] = Partition(node)
            self._partitions[node].add(self.cluster.nodes[node].pid)

    # -- running a scenario ---------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> None:
        """Starts etcd and the first nodes, submits the job, waits until it trains at full
        size, then starts the standby nodes."""
        self.cluster.start(wait=False)
        for node in self.cluster.nodes:
            self._enclose(node)
        self.cluster.wait_for(lambda: all(self.cluster.registered(n) for n in self.cluster.nodes),
                              30, "every node registered")
        argv = [self.train, *self.train_args, "--steps", str(self.shape.steps), "--step-time",
                str(self.shape.step_time), "--sample-log", self.samples_dir, "--out",
                self.out_dir]
        if self.shape.zero:
            argv.append("--zero")
        out = subprocess.run(
            [sys.executable, "-m", "elasticd.cli.main", "submit", self.job, "--nnodes",
             self.shape.nnodes, "--nproc-per-node", "1", "--user", JOB_USER, "--max-restarts",
             "100", "--", *argv],
            env={**os.environ, "ELASTICD_ETCD": self.etcd, "ELASTICD_PREFIX": self.prefix},
            capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"elasticctl submit failed: {out.stderr}")
        world = min(len(self.shape.nodes), self.shape.max_world)
        self._wait(lambda: any(e.fields[1] == world for e in self.logs.of("step")), timeout,
                   f"the job training at world size {world}")
        for node in self.shape.standby:
            self.cluster.start_node(node, wait=False)
            self._enclose(node)

    def _wait(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            value = cond()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}\n"
                                   + self.diagnostics())
            time.sleep(0.05)

    def poll(self) -> None:
        self.logs.poll(self.cluster.nodes)
        if time.monotonic() - self._last_scan > 0.5:
            self._scan()

    def _scan(self) -> None:
        """Remembers every process of every node and every /dev/shm file they use."""
        self._last_scan = time.monotonic()
        for node_id, n in self.cluster.nodes.items():
            tagged = n.tagged()
            self.job_uids |= {uid for uid in map(_real_uid, tagged) if uid is not None}
            pids = ([n.pid] if n.running else []) + tagged
            for pid in pids:
                self.pids_seen.setdefault(pid, node_id)
                self.shm_seen |= _proc_shm_paths(pid)
            if n.shm_dir:
                for root in (n.shm_dir, n.shm_dir + "+replicas"):
                    for path in glob.glob(os.path.join(root, "**", "*"), recursive=True):
                        self.shm_seen.add(path)

    def scrape(self, path: str) -> dict[str, Any]:
        """``path`` from every running node's HTTP endpoint (nodes that fail to answer are
        left out)."""
        out = {}
        for node_id, n in self.cluster.nodes.items():
            if n.running and (n.address or self.cluster.registered(node_id)):
                try:
                    out[node_id] = n.http(path)
                except OSError:
                    pass
        return out

    def finished(self) -> bool:
        """Every rank of one world printed ``done`` with the job's last step."""
        done = collections.defaultdict(set)
        for e in self.logs.of("done"):
            rank, world, steps = e.fields
            if steps == self.shape.steps:
                done[world].add(rank)
        return any(ranks == set(range(world)) for world, ranks in done.items())

    def run(self, plan: FaultPlan, timeout: float = 150.0) -> "Outcome":
        """Runs the job to its end under ``plan``; stops everything; returns the outcome."""
        started = time.time()
        try:
            self.start()
            self.injector = Injector(self, plan)
            self._wait(lambda: self._tick() and self.finished(), timeout, "the job to finish")
            if self.injector.unfired:
                raise AssertionError(f"the job ended before these faults took effect: "
                                     f"{self.injector.unfired}")
            self.injector.undo_all()
            finished_at = time.time()
            lingering = self._wait_agents_gone(30.0)
            gone_at = time.time()
            history = self.commit_history()
            metrics = self.scrape("/metrics")
            statuses = self.scrape("/status")
            self.events = self.cluster.events()
            read_at = time.time()
            left = self.stop()
            # Where a scenario's time goes after the job's end (the suite's time is watched).
            print(f"chaos run: {finished_at - started:.1f} s to the job's end, then "
                  f"{gone_at - finished_at:.1f} s until its processes were gone, "
                  f"{read_at - gone_at:.1f} s reading etcd and the nodes, "
                  f"{time.time() - read_at:.1f} s stopping", flush=True)
            return Outcome(self, plan, self.injector.records, history, lingering, left,
                           started, finished_at, metrics, statuses)
        except BaseException:
            print(self.diagnostics(), flush=True)
            raise
        finally:
            if self.injector is not None:
                self.injector.undo_all()
            if not self._stopped:
                self.stop()

    def _tick(self) -> bool:
        assert self.injector is not None
        self.injector.tick(self.logs.max_step)
        return True

    def _wait_agents_gone(self, timeout: float) -> dict[str, list[int]]:
        """After the job's end, every node's agent and workers must exit on their own:
        returns what was still running after ``timeout`` (by node)."""
        def remaining() -> dict[str, list[int]]:
            return {n: pids for n, node in self.cluster.nodes.items()
                    if (pids := node.tagged())}

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sleep_until(lambda: not remaining(), deadline - time.monotonic(), 0.2)
            # ... and stay gone: a daemon that starts the finished job again is a failure too.
            if not sleep_until(remaining, STAY_GONE_CYCLES * self.cluster.loop_interval, 0.1):
                return {}
        return remaining()

    def commit_history(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Every commit etcd stored for the job, oldest first, replayed from its revisions
        (auto-compaction keeps far more than a scenario writes)."""
        from elasticd.coordination.api import CoordinationError, EventType
        from elasticd.replication.commit import decode_committed

        coord = self.cluster.coordinator()
        key = self.cluster.keys.replication(self.job).committed
        try:
            last = coord.get(key)
        except CoordinationError:
            sleep_until(lambda: self.committed_now() is not None, timeout)
            last = coord.get(key)
        if last is None:
            return []
        got: list[dict[str, Any]] = []
        seen = threading.Event()

        def on_events(events: Any) -> None:
            if isinstance(events, Exception):
                return
            for ev in events:
                if ev.type is EventType.PUT and ev.kv.key == key:
                    c = decode_committed(ev.kv.value, ev.kv.key)
                    got.append({"generation": c.generation, "step": c.step, "at": c.at,
                                "revision": ev.kv.mod_revision})
                    if ev.kv.mod_revision >= last.mod_revision:
                        seen.set()

        watch = coord.watch_prefix(key, on_events, start_revision=1)
        try:
            if not seen.wait(timeout):
                raise TimeoutError("replaying the committed history from etcd timed out")
        finally:
            watch.cancel()
        got.sort(key=lambda c: c["revision"])
        # A version's first record is its commit: later ones only name new holders (a
        # re-replication or a drain, which rewrites ``at``), of a kept commit even after a
        # restore opened a newer generation.
        first: dict[tuple[int, int], dict[str, Any]] = {}
        for c in got:
            if c["revision"] <= last.mod_revision:
                first.setdefault((c["generation"], c["step"]), c)
        return list(first.values())

    def stop(self) -> dict[str, Any]:
        """Stops every node the way an operator does (SIGTERM), then etcd. Returns what was
        left behind: processes still running after each daemon's exit (before the launcher's
        SIGKILL safety net), daemon exit codes, and /dev/shm files that still exist."""
        self._scan()
        left: dict[str, Any] = {"processes": {}, "exit_codes": {}, "shm": [], "etcd": []}
        for node_id, n in self.cluster.nodes.items():
            if not n.running:
                continue
            left["exit_codes"][node_id] = n.sigterm(30)  # None: stuck (stacks in its log)
            time.sleep(0.1)
            if leftovers := [p for p in n.tagged() if _alive(p)]:
                left["processes"][node_id] = leftovers
        etcd_pids = [m.pid for m in self.cluster.etcd_server.members if m.pid]
        self.cluster.stop()  # SIGKILLs whatever is left, stops etcd, removes the shm root
        for cut in self._partitions.values():
            cut.remove()  # heals, then removes the cgroup now that its processes are gone
        self._stopped = True
        left["processes"].update({
            f"pid {pid} ({node})": [pid] for pid, node in self.pids_seen.items() if _alive(pid)
            and pid not in [p for ps in left["processes"].values() for p in ps]})
        left["etcd"] = [p for p in etcd_pids if _alive(p)]
        left["shm"] = sorted(p for p in self.shm_seen if os.path.exists(p))
        return left

    def diagnostics(self, tail: int = 25) -> str:
        out = [f"--- chaos diagnostics ({self.workdir})"]
        for node in self.cluster.nodes:
            for path in (self.agent_log(node), os.path.join(self.workdir, f"{node}.log")):
                try:
                    lines = open(path, errors="replace").read().splitlines()
                except OSError:
                    continue
                out.append(f"--- {path} (last {tail} lines)")
                out += lines[-tail:]
        return "\n".join(out)


def assert_samples_exactly_once(kept: list[dict[str, Any]], total_steps: int) -> None:
    """``kept``: the sample records of the kept timeline (one per rank and step): every step
    1..``total_steps`` kept from one whole worker group, every sample of each epoch trained
    on exactly once (the last epoch may be cut short by the job's end: no sample twice,
    none skipped before the point reached)."""
    steps = sorted({r["step"] for r in kept})
    assert steps == list(range(1, total_steps + 1)), (
        f"kept steps are not 1..{total_steps}: {steps}")
    for step in steps:
        worlds = {r["world"] for r in kept if r["step"] == step}
        ranks = sorted(r["rank"] for r in kept if r["step"] == step)
        assert len(worlds) == 1 and ranks == list(range(worlds.pop())), (
            f"step {step} kept from ranks {ranks}: not one whole worker group")
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for r in kept:
        by_epoch[r["epoch"]] += r["indices"]
    n = 4096  # examples/train.py make_data()
    epochs = sorted(by_epoch)
    assert epochs == list(range(len(epochs))), f"epochs {epochs}"
    for e in epochs:
        seen = collections.Counter(by_epoch[e])
        twice = sorted(i for i, c in seen.items() if c > 1)
        assert not twice, f"epoch {e}: {len(twice)} samples seen more than once: {twice[:10]}"
        if e != epochs[-1]:
            assert len(seen) == n, f"epoch {e}: {n - len(seen)} samples never seen"
    # The cut-short epoch must be a prefix of the epoch's permutation: nothing skipped.
    import torch

    g = torch.Generator()
    g.manual_seed(0 + epochs[-1])
    order = torch.randperm(n, generator=g).tolist()
    last = set(by_epoch[epochs[-1]])
    assert last == set(order[: len(last)]), (
        f"epoch {epochs[-1]}: the samples seen are not the start of its permutation "
        "(some were skipped)")


# -- the outcome --------------------------------------------------------------------------

@dataclasses.dataclass
class RankStart:
    """One worker process's start: what it restored."""

    node: str
    rank: int
    world: int
    pid: int
    step: int
    source: str
    seconds: float
    lost: int
    seen: float


@dataclasses.dataclass
class Attempt:
    """One worker group (a process group of ``world`` ranks) and the steps it ran."""

    id: int
    world: int
    starts: dict[int, RankStart]  # rank -> its start line
    steps: dict[int, list[int]]  # rank -> steps run, in order
    records: list[dict[str, Any]]

    @property
    def last_step(self) -> int:
        return max((s for ss in self.steps.values() for s in ss), default=-1)

    @property
    def last_complete_step(self) -> int:
        """The newest step every rank of the attempt logged: a step logged by only some of
        them was in flight when the attempt ended (a rank logs a step after its update,
        before its snapshot)."""
        return min((max(ss) for ss in self.steps.values() if ss), default=-1)


@dataclasses.dataclass
class Recovery:
    """An attempt that follows another, beside the truth it must agree with.

    Attributes:
        attempt: the new worker group.
        step: the step its ranks restored.
        sources: each rank's source (local, peer, persistent, none).
        reported_lost: each rank's "steps lost".
        reached: the newest step any earlier attempt ran (from the sample logs).
        reached_by_all: the newest step every rank of that attempt ran: a newer one was in
            flight at the failure, and no snapshot of it need have been taken anywhere.
        committed: the newest committed step recorded in etcd before the restore.
        persisted: the newest complete persisted step (world size of this attempt) before it.
    """

    attempt: Attempt
    step: int
    sources: dict[int, str]
    reported_lost: dict[int, int]
    reached: int
    committed: int | None
    persisted: int | None
    reached_by_all: int = -1

    @property
    def true_lost(self) -> int:
        return max(0, self.reached - self.step)

    @property
    def knowable_lost(self) -> set[int]:
        """What a rank may rightly report: the steps really lost, or, when the newest step
        was in flight at the failure (logged by some ranks only, its snapshot taken by
        none), the steps lost up to the newest step every rank completed (CI: the kill of
        a replica group landed while one rank had logged step 23 and the others 22; every
        rank reported 2 lost from step 20, the truth being 3)."""
        return {self.true_lost, max(0, self.reached_by_all - self.step)}

    def __str__(self) -> str:
        return (f"restored step {self.step} at world {self.attempt.world} from "
                f"{self.sources}, reported lost {self.reported_lost}, reached {self.reached}, "
                f"committed {self.committed}, persisted {self.persisted}")


class Outcome:
    """What a scenario did, reconstructed from logs, sample records and etcd."""

    def __init__(self, cc: ChaosCluster, plan: FaultPlan, faults: list[FaultRecord],
                 commits: list[dict[str, Any]], lingering: dict[str, list[int]],
                 left: dict[str, Any], started: float, finished: float,
                 metrics: dict[str, str] | None = None,
                 statuses: dict[str, Any] | None = None) -> None:
        self.cc, self.plan, self.faults, self.commits = cc, plan, faults, commits
        self.metrics = metrics or {}  # node -> its /metrics text when the job had ended
        self.statuses = statuses or {}  # node -> its /status document then
        self.events = getattr(cc, "events", [])  # the cluster's event log (failed, left, ...)
        self.lingering, self.left = lingering, left
        self.seconds = finished - started
        self.starts = [RankStart(e.node, e.fields[0], e.fields[1], e.fields[3], e.fields[4],
                                 e.fields[5], e.fields[6], e.fields[7], e.seen)
                       for e in cc.logs.of("start")]
        self.attempts = self._attempts()
        self.recoveries = self._recoveries()
        self.final_weights = os.path.join(cc.out_dir, "final.pt")
        print(self.summary(), flush=True)

    def _attempts(self) -> list[Attempt]:
        by_pid = {s.pid: s for s in self.starts}
        groups: dict[int, Attempt] = {}
        for path in sorted(glob.glob(os.path.join(self.cc.samples_dir, "samples-*.jsonl"))):
            m = re.search(r"samples-(\d+)-rank(\d+)-(\d+)\.jsonl$", path)
            attempt, rank, pid = (int(g) for g in m.groups())
            with open(path) as fh:
                records = [json.loads(line) for line in fh if line.endswith("\n")]
            start = by_pid.get(pid)
            if start is None:
                raise AssertionError(f"worker pid {pid} (rank {rank}) wrote samples but its "
                                     "start line was not seen in any agent log")
            a = groups.setdefault(attempt, Attempt(attempt, start.world, {}, {}, []))
            a.starts[rank] = start
            a.steps[rank] = [r["step"] for r in records]
            a.records += records
        return [groups[k] for k in sorted(groups)]

    def _recoveries(self) -> list[Recovery]:
        out = []
        for i, a in enumerate(self.attempts[1:], 1):
            steps = {s.step for s in a.starts.values()}
            if len(steps) != 1:
                raise AssertionError(f"attempt {a.id}: ranks restored different steps: "
                                     f"{ {r: s.step for r, s in a.starts.items()} }")
            step = steps.pop()
            restored_at = min(s.seen for s in a.starts.values())
            reached = max(b.last_step for b in self.attempts[:i])
            newest = max(self.attempts[:i], key=lambda b: b.last_step)
            # The restoring attempt's own commits carry a newer generation; with warm worker
            # starts its first one can land before this harness sees the restore line, so the
            # commits in force are those before it of a generation older than the first one
            # made after it (the restoring attempt's).
            later = [c["generation"] for c in self.commits if c["at"] >= restored_at]
            limit = later[0] - 1 if later else None
            committed = [c["step"] for c in self.commits if c["at"] < restored_at
                         and (limit is None or c["generation"] <= limit)]
            out.append(Recovery(a, step, {r: s.source for r, s in a.starts.items()},
                                {r: s.lost for r, s in a.starts.items()}, reached,
                                committed[-1] if committed else None,
                                self._persisted_before(restored_at, a.world),
                                newest.last_complete_step))
        return out

    def _persisted_before(self, t: float, world: int) -> int | None:
        if not self.cc.persist_dir:
            return None
        from elasticd.persistence.tier import Tier

        steps = []
        for m in Tier(self.cc.persist_dir).complete_steps(self.cc.job, repair=False):
            path = os.path.join(Tier(self.cc.persist_dir).step_dir(self.cc.job, m.version()),
                                "manifest.json")
            if m.world_size == world and os.path.exists(path) and os.path.getmtime(path) < t:
                steps.append(m.version()[1])
        return max(steps, default=None)

    def summary(self) -> str:
        lines = [f"chaos outcome: {self.plan!r}, {self.seconds:.1f} s from start to the job's "
                 f"end, {len(self.attempts)} attempts"]
        for f in self.faults:
            lag = f.step - f.committed[1] if f.committed else None
            lines.append(f"  fault {f.fault.describe()}: fired at step {f.step}, committed "
                         f"{f.committed} (sync lag {lag}), {f.detail}")
        for a in self.attempts:
            lines.append(f"  attempt {a.id}: world {a.world}, ranks on "
                         f"{ {r: s.node for r, s in sorted(a.starts.items())} }, steps "
                         f"{min((s for ss in a.steps.values() for s in ss), default=None)}.."
                         f"{a.last_step}")
        for r in self.recoveries:
            lines.append(f"  recovery: {r}")
        return "\n".join(lines)

    # -- checks -----------------------------------------------------------------------------

    def log_text(self, node: str) -> str:
        """Everything the node's agent and workers printed."""
        try:
            with open(self.cc.agent_log(node), errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    def assert_finished(self) -> None:
        final = self.attempts[-1]
        reached = final.last_step
        if reached < 0 and final.starts and len(final.starts) == final.world:
            # A group that re-formed at the very last step (a node rejoining as the others
            # finished) restores it on every rank and has no step left to run.
            restored = {st.step for st in final.starts.values()}
            reached = restored.pop() if len(restored) == 1 else -1
        assert reached == self.cc.shape.steps, (
            f"the last attempt ended at step {final.last_step}, not {self.cc.shape.steps}")
        assert os.path.exists(self.final_weights), "rank 0 wrote no final weights"

    def assert_sources(self, *allowed: set[str], must: Iterable[str] = ()) -> None:
        """One set per recovery (as many as there were recoveries): the sources its ranks may
        report; ``must``: sources every recovery used on some rank. (Which rank lands on which
        node is torch's choice: a survivor may get another rank and fetch it from a peer.)"""
        got = [set(r.sources.values()) for r in self.recoveries]
        ok = len(got) == len(allowed) and all(g <= set(a) and set(must) <= g
                                              for g, a in zip(got, allowed))
        assert ok, (f"recovery sources {got}, allowed {list(allowed)}, required {set(must)}"
                    f"\n{self.summary()}")

    def assert_steps_lost(self) -> None:
        """Steps lost equal the sync lag at the failure, for every recovery: each rank reports
        the steps really lost (the newest step reached minus the one restored), and the step
        restored is the newest one the failure left recoverable — never older:

        * from a peer: the committed step in force (etcd's record before the restore);
        * from the persistent tier: the newest complete persisted step;
        * from local RAM: at least the committed step (a local snapshot may be newer).
        """
        for r in self.recoveries:
            reported = set(r.reported_lost.values())
            assert len(reported) == 1 and reported <= r.knowable_lost, (
                f"reported steps lost {r.reported_lost}, but the job had reached step "
                f"{r.reached} (every rank {r.reached_by_all}) and restored {r.step}: "
                f"{r.true_lost} lost")
            sources = set(r.sources.values())
            if "persistent" in sources:
                assert r.step == r.persisted, (
                    f"restored step {r.step} from the persistent tier, whose newest complete "
                    f"step was {r.persisted}")
            elif "peer" in sources:
                assert r.step == r.committed, (
                    f"restored step {r.step} from peers, but the committed step was "
                    f"{r.committed}: lost {r.true_lost}, sync lag {r.reached - (r.committed or 0)}")
            elif "local" in sources:
                assert r.committed is None or r.step >= r.committed, (
                    f"restored step {r.step} from local RAM, older than the committed step "
                    f"{r.committed}")
            else:
                assert r.step == 0 and r.reached <= 0, f"nothing restored after step {r.reached}"

    def kept_records(self) -> list[dict[str, Any]]:
        """For each step, the records of the last attempt that ran it: the timeline kept."""
        last: dict[int, int] = {}
        for a in self.attempts:
            for ss in a.steps.values():
                for s in ss:
                    last[s] = a.id
        return [rec for a in self.attempts for rec in a.records if last[rec["step"]] == a.id]

    def assert_samples_exactly_once(self) -> None:
        """Every sample of each epoch trained on exactly once along the kept timeline (the
        last epoch may be cut short by the job's end: no sample twice, none skipped before
        the point reached)."""
        assert_samples_exactly_once(self.kept_records(), self.cc.shape.steps)

    def assert_ran_as_job_user(self) -> None:
        want = pwd.getpwnam(JOB_USER).pw_uid
        assert self.cc.job_uids == {want}, (
            f"the job's processes ran as uids {sorted(self.cc.job_uids)}, not only as "
            f"{JOB_USER} ({want})")

    def assert_nothing_left(self) -> None:
        assert not self.lingering, (
            f"processes still running after the job ended: {self.lingering}")
        assert not self.left["processes"], (
            f"processes left behind after the daemons stopped: {self.left['processes']}")
        assert not self.left["etcd"], f"etcd members left running: {self.left['etcd']}"
        assert not self.left["shm"], f"/dev/shm files left behind: {self.left['shm'][:10]}"
        bad = {n: c for n, c in self.left["exit_codes"].items() if c != 0}
        assert not bad, f"daemons that did not exit cleanly on SIGTERM: {bad}"

    def assert_bitwise_equal(self, reference: str) -> None:
        import torch

        mine = torch.load(self.final_weights, weights_only=True)
        ref = torch.load(reference, weights_only=True)
        assert mine.keys() == ref.keys()
        diff = {k: float((mine[k] - ref[k]).abs().max()) for k in mine
                if not torch.equal(mine[k], ref[k])}
        assert not diff, f"final weights differ from the failure-free run: max abs diff {diff}"

    def assert_all(self, sources: Iterable[set[str]], reference: str | None = None,
                   must: Iterable[str] = ()) -> None:
        """The checks every scenario makes (``reference``: the failure-free run's weights,
        where the world size never dropped; ``sources``, ``must``: see assert_sources)."""
        checks = [self.assert_finished, lambda: self.assert_sources(*sources, must=must),
                  self.assert_steps_lost, self.assert_samples_exactly_once,
                  self.assert_nothing_left, self.assert_ran_as_job_user]
        if reference is not None:
            checks.append(lambda: self.assert_bitwise_equal(reference))
        failed = []
        for check in checks:  # all of them: one run shows every way it went wrong
            try:
                check()
            except AssertionError as exc:
                failed.append(str(exc).split("\nchaos outcome")[0])
        assert not failed, "\n".join(["chaos checks failed:", *failed, self.summary()])


# -- the failure-free reference -------------------------------------------------------------

_REFERENCES: dict[Shape, str] = {}


def reference_weights(shape: Shape, workdir: str) -> str:
    """The final weights of a failure-free run of ``shape.reference()``, computed once per
    test session (cached by shape).

    The run is the job's own script as plain gloo ranks (:func:`plain_reference`), not a
    failure-free :class:`ChaosCluster`: the weights are the same bit for bit (measured for
    every reference shape the suite uses: bench/results/chaos_reference.json, made by
    bench/chaos_reference.py), at a fifth of the cost. What the cluster run checked beside
    its weights stays checked on real clusters: samples exactly once by every scenario, no
    recovery in a run without a failure by test_etcd_faults (``sources=[]``), whose weights
    are compared with this reference.
    """
    ref = shape.reference()
    if ref not in _REFERENCES:
        _REFERENCES[ref] = plain_reference(ref, workdir)
    return _REFERENCES[ref]


def cluster_reference(shape: Shape, workdir: str) -> str:
    """The final weights of a failure-free :class:`ChaosCluster` run of ``shape.reference()``
    (what :func:`reference_weights` computed before; bench/chaos_reference.py compares the
    two)."""
    out = ChaosCluster(workdir, shape.reference()).run(FaultPlan())
    out.assert_finished()
    out.assert_samples_exactly_once()
    assert not out.recoveries, f"the failure-free run restarted: {out.summary()}"
    return out.final_weights


def plain_reference(shape: Shape, workdir: str) -> str:
    """``shape``'s job (examples/train.py) run to its end as
    ``shape.max_world`` plain gloo ranks without elasticd (:func:`gloo_job`: no daemon, so
    every save is a no-op and nothing is restored). Checks each rank started from nothing and
    finished, and every sample was trained on exactly once. Returns the final weights' path.
    """
    samples = os.path.join(workdir, "samples")
    out_dir = os.path.join(workdir, "out")
    # The weights do not depend on the step time (a sleep after each step).
    argv = [sys.executable, TRAIN, "--steps", str(shape.steps), "--step-time", "0",
            "--sample-log", samples, "--out", out_dir] + (["--zero"] if shape.zero else [])
    outputs = gloo_job(argv, shape.max_world, timeout=120.0)
    for rank, text in enumerate(outputs):
        start, done = START_RE.search(text), DONE_RE.search(text)
        assert start and int(start.group(1)) == rank and start.group(6) == "none", text[-2000:]
        assert done and int(done.group(3)) == shape.steps, text[-2000:]
    kept = []
    for path in sorted(glob.glob(os.path.join(samples, "samples-*.jsonl"))):
        with open(path) as fh:
            kept += [json.loads(line) for line in fh if line.endswith("\n")]
    assert len({r["attempt"] for r in kept}) == 1, "the plain run had more than one attempt"
    assert_samples_exactly_once(kept, shape.steps)
    final = os.path.join(out_dir, "final.pt")
    assert os.path.exists(final), "rank 0 wrote no final weights"
    return final


def gloo_job(argv: list[str], world: int, timeout: float = 90.0) -> list[str]:
    """Runs ``argv`` as a job of ``world`` gloo ranks on 127.0.0.1 without elasticd (plain
    ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables, no ``ELASTICD_*``), each rank in its own
    process group, all stopped before this returns. Returns each rank's output.

    Raises:
        AssertionError: a rank failed (its exit status and the end of its output).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    bad = [(r, p.returncode, o[-2000:]) for r, (p, o) in enumerate(zip(procs, outputs))
           if p.returncode != 0]
    assert not bad, f"{argv[1:]} at world {world} failed: {bad}"
    return outputs
