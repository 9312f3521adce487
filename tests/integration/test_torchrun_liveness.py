"""Lease liveness with plain torchrun: three agents on a real etcd, one killed, or etcd paused.

Three torchrun processes stand for three nodes (``--nnodes 2:3``, one worker each, the worker
in ``workers/train_steps.py`` printing a line per step). ``--rdzv-conf`` keeps the backend's
defaults, so torch's own keep-alive window is the long one (40 s): a survivor that trains again
within seconds of a kill -9 owes it to lease liveness. torch's ``last_call_timeout`` is set to
1 s, as everywhere in these tests, or the two survivors would wait 30 s for a third node.

Every process carries an environment marker (``ELASTICD_TEST_RUN``, ``ELASTICD_TEST_NODE``): a
node is killed as a whole (the agent's process group, and the group of each of its workers,
which torchrun starts in sessions of their own), and at the end every marked process is killed,
orphans included.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.rendezvous_backend import decode_state
from elasticd.coordination.rendezvous_liveness import DEFAULT_LIVENESS_TTL

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "train_steps.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEP = re.compile(r"STEP node=(\S+) rank=(\d+) world=(\d+) step=(\d+) restart=(\S+) "
                  r"pid=(\d+) t=([\d.]+)")
DROPPED = "dropping it from the rendezvous"
NODES = 3


def connect(server, timeout: float = 1.0) -> EtcdCoordinator:
    # Not imported from conftest: whether tests/ is a package decides how that would import.
    return EtcdCoordinator(EtcdSettings(parse_endpoints(server.endpoints), timeout=timeout))


class Cluster:
    """Three torchrun agents on one rendezvous, and what their workers print."""

    def __init__(self, server, prefix: str, tmp_path: Path, conf: str = "") -> None:
        self.server = server
        self.prefix = prefix
        self.tmp = tmp_path
        self.run = f"live-{uuid.uuid4().hex[:8]}"
        self.conf = f"key_prefix={prefix},join_timeout=60,last_call_timeout=1" + (
            f",{conf}" if conf else "")
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        for i in range(NODES):
            node = f"node{i}"
            env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1", ELASTICD_TEST_RUN=self.run, ELASTICD_TEST_NODE=node)
            with open(self.tmp / f"{node}.out", "w") as out:
                self.procs[node] = subprocess.Popen(
                    TORCHRUN + [
                        "--nnodes", f"2:{NODES}", "--nproc-per-node", "1",
                        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", self.server.endpoints,
                        "--rdzv-id", self.run, "--rdzv-conf", self.conf,
                        "--local-addr", "127.0.0.1", "--max-restarts", "3",
                        "--log-dir", str(self.tmp / f"logs-{node}"), WORKER,
                    ],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, env=env)

    def text(self, node: str) -> str:
        return (self.tmp / f"{node}.out").read_text(errors="replace")

    def logs(self) -> str:
        """What the agents logged, without the workers' step lines."""
        return "\n".join(f"{n}: {line}" for n in self.procs
                         for line in self.text(n).splitlines() if not STEP.search(line))

    def texts(self) -> str:
        """For failure messages: the logs and each node's last steps."""
        tails = ("\n".join(self.text(n).splitlines()[-5:]) for n in self.procs)
        return self.logs()[-20000:] + "\n\n" + "\n".join(tails)

    def steps(self, node: str) -> list[dict]:
        keys = ("node", "rank", "world", "step", "restart", "pid", "t")
        out = []
        for m in STEP.finditer(self.text(node)):
            row = dict(zip(keys, m.groups()))
            for k in ("rank", "world", "step", "pid"):
                row[k] = int(row[k])
            row["t"] = float(row["t"])
            out.append(row)
        return out

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}\n"
                                     + self.texts())
            for node, proc in self.procs.items():
                if proc.poll() is not None and node not in getattr(self, "killed", ()):
                    raise AssertionError(f"{node}'s torchrun exited ({proc.returncode}) while "
                                         f"waiting for {what}\n" + self.texts())
            time.sleep(0.2)

    def training_at(self, world: int, nodes, after: float = 0.0, steps: int = 3) -> bool:
        """Whether each of ``nodes`` printed ``steps`` steps at ``world`` after time ``after``."""
        return all(
            sum(1 for s in self.steps(n) if s["world"] == world and s["t"] > after) >= steps
            for n in nodes)

    def rank_of(self, node: str) -> int:
        return [s for s in self.steps(node) if s["world"] == NODES][-1]["rank"]

    def kill_node(self, node: str) -> float:
        """kill -9 of a whole node: its agent's group and its workers' groups, at once."""
        agent = self.procs[node]
        groups = {agent.pid}
        for child in psutil.Process(agent.pid).children(recursive=True):
            try:
                groups.add(os.getpgid(child.pid))
            except ProcessLookupError:
                pass
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed_at = time.time()
        self.killed = {node}
        agent.wait()
        return killed_at

    def stop(self) -> None:
        """Kills every process of this run, orphans too, and reaps the agents."""
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get("ELASTICD_TEST_RUN") == self.run:
                    os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
                    proc.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def state(self):
        coordinator = connect(self.server)
        try:
            kv = coordinator.get(Keyspace(self.prefix).job_rdzv(self.run) + b"state")
            return pickle.loads(decode_state(kv.value))
        finally:
            coordinator.close()

    def alive_keys(self) -> list[bytes]:
        coordinator = connect(self.server)
        try:
            prefix = Keyspace(self.prefix).job_rdzv(self.run) + b"alive/"
            return [kv.key[len(prefix):] for kv in coordinator.get_prefix(prefix)[0]]
        finally:
            coordinator.close()


def _recovery_after_kill(cluster: Cluster, victim_rank: int | None) -> float:
    """Starts the cluster, kills one node, returns seconds until both survivors train at 2."""
    nodes = [f"node{i}" for i in range(NODES)]
    cluster.start()
    cluster.wait_until(lambda: cluster.training_at(NODES, nodes), 90, "three nodes training")
    if victim_rank is None:  # not rank 0
        victim = next(n for n in nodes if cluster.rank_of(n) != 0)
    else:
        victim = next(n for n in nodes if cluster.rank_of(n) == victim_rank)
    survivors = [n for n in nodes if n != victim]
    killed_at = cluster.kill_node(victim)
    cluster.wait_until(lambda: cluster.training_at(2, survivors, after=killed_at, steps=1), 90,
                       "the survivors training at world size 2")
    firsts = [next(s for s in cluster.steps(n) if s["world"] == 2 and s["t"] > killed_at)
              for n in survivors]
    recovery = max(s["t"] for s in firsts) - killed_at
    print(f"killed {victim} (rank {cluster.rank_of(victim)}; node0 started first): survivors "
          f"trained at world size 2 after {recovery:.1f}s")
    return recovery


@pytest.mark.etcd
@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim_rank", [None, 0], ids=["not-rank-0", "rank-0"])
def test_survivors_train_again_seconds_after_a_node_is_killed(etcd, prefix, tmp_path,
                                                               victim_rank):
    cluster = Cluster(etcd, prefix, tmp_path)
    try:
        recovery = _recovery_after_kill(cluster, victim_rank)
        texts = cluster.texts()
        # Lease liveness dropped the dead node (torch's own window is 40 s).
        assert DROPPED in cluster.logs(), texts
        assert recovery < 20, texts
        assert len(cluster.alive_keys()) == 2
    finally:
        cluster.stop()


@pytest.mark.etcd
@pytest.mark.timeout(120)
def test_an_agent_stopped_by_sigterm_revokes_its_alive_key(etcd, prefix, tmp_path):
    # torchrun does not shut the handler down after a signal; atexit revokes the lease, so the
    # key is gone when the process is, not a TTL later.
    cluster = Cluster(etcd, prefix, tmp_path)
    nodes = [f"node{i}" for i in range(NODES)]
    try:
        cluster.start()
        cluster.wait_until(lambda: cluster.training_at(NODES, nodes), 90, "three nodes training")
        assert len(cluster.alive_keys()) == NODES
        agent = cluster.procs["node2"]
        cluster.killed = {"node2"}
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        keys = cluster.alive_keys()
        assert len(keys) == NODES - 1, cluster.texts()
        assert str(agent.pid).encode() not in b" ".join(keys)
    finally:
        cluster.stop()


@pytest.mark.etcd
@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.environ.get("ELASTICD_MEASURE_BASELINE"),
                    reason="a measurement (~1 min), not a test: set ELASTICD_MEASURE_BASELINE=1")
def test_measure_recovery_without_lease_liveness(etcd, prefix, tmp_path):
    cluster = Cluster(etcd, prefix, tmp_path, conf="lease_liveness=false")
    try:
        recovery = _recovery_after_kill(cluster, None)
        assert DROPPED not in cluster.logs()
        assert recovery > 20  # torch's 40 s window, less what had passed of it at the kill
    finally:
        cluster.stop()


@pytest.mark.etcd
@pytest.mark.timeout(180)
def test_an_etcd_pause_longer_than_the_ttl_drops_nobody(private_etcd, prefix, tmp_path):
    # SIGSTOP etcd for 2 x TTL + 2 s: every lease expires when it resumes. Nobody may be
    # dropped; the three workers keep training, unrestarted, at world size 3.
    pause = 2 * DEFAULT_LIVENESS_TTL + 2
    member = private_etcd.members[0]
    cluster = Cluster(private_etcd, prefix, tmp_path)
    nodes = [f"node{i}" for i in range(NODES)]
    try:
        cluster.start()
        cluster.wait_until(lambda: cluster.training_at(NODES, nodes), 90, "three nodes training")
        time.sleep(1)  # a keep-alive period or two with everything healthy
        before = cluster.state()
        workers = {n: cluster.steps(n)[-1]["pid"] for n in nodes}
        member.signal(signal.SIGSTOP)
        try:
            time.sleep(pause)
        finally:
            member.signal(signal.SIGCONT)
        resumed = time.time()
        # Doubt lasts 2 x TTL after the outage, confirmation 1 s more: wait past both.
        time.sleep(2 * DEFAULT_LIVENESS_TTL + 5)
        after = cluster.state()
        texts, logs = cluster.texts(), cluster.logs()
        assert DROPPED not in logs, texts
        assert "dropping nobody" in logs, texts  # the guard was what held
        assert (after.round, after.complete) == (before.round, True), texts
        assert set(after.participants) == set(before.participants), texts
        assert len(cluster.alive_keys()) == NODES
        for n in nodes:
            late = [s for s in cluster.steps(n) if s["t"] > resumed]
            assert len(late) >= 20, texts  # ~10 steps a second, still going
            assert {(s["pid"], s["restart"], s["world"]) for s in late} == {
                (workers[n], "0", NODES)}, texts
    finally:
        member.signal(signal.SIGCONT)
        cluster.stop()
