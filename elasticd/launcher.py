"""A local multi-node cluster on one host: one etcd (owned here) and N daemon processes.

The demo, the tests and the benchmarks all start clusters through this module, so that they
exercise the same code an operator runs: every daemon is a separate ``elasticd`` process with
its own node id, HTTP port (port 0: picked by the kernel, read back from its node record in
etcd), log file and process group. etcd belongs to the launcher, never to one of the daemons,
so that killing any node leaves coordination up.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence

from elasticd.agent.supervisor import signal_all, tagged_pids
from elasticd.clock import SYSTEM_CLOCK
from elasticd.cluster.membership import joined_sentence
from elasticd.coordination import records
from elasticd.coordination.embedded import EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace

#: The account the demo, the tests and the benchmarks run their jobs as, as an operator would
#: (``elasticctl submit --user``): as root, ``nobody``, an existing unprivileged account on every
#: Linux system, so nothing is added to a newcomer's machine; otherwise the launcher's own user
#: (a daemon that is not root can run jobs as its own user only).
JOB_USER = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


def job_writable(path: str, user: str = JOB_USER) -> str:
    """Creates ``path`` (a directory a job writes: its output, its sample log) for ``user``."""
    os.makedirs(path, exist_ok=True)
    entry = pwd.getpwnam(user)
    if os.geteuid() == 0:
        os.chown(path, entry.pw_uid, entry.pw_gid)
    reachable(os.path.dirname(os.path.abspath(path)))
    return path


def reachable(path: str) -> None:
    """Lets other users traverse (not list) ``path`` and its ancestors that are ours.

    A job runs as another user than the launcher: it must reach the daemon's socket, its slot
    files and its output under a private temporary directory (``mkdtemp`` and pytest make them
    0700).
    """
    path = os.path.abspath(path)
    me = os.geteuid()
    while True:
        st = os.stat(path)
        if st.st_uid == me and not st.st_mode & 0o001:
            os.chmod(path, (st.st_mode & 0o7777) | 0o011)
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


class NodeProcess:
    """One ``elasticd`` child process."""

    def __init__(self, node_id: str, argv: list[str], log_path: str, env: dict[str, str],
                 prefix: str = "/elasticd") -> None:
        self.node_id = node_id
        self.prefix = prefix
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.shm_dir = ""
        self.log_offset = 0
        self._joined = False

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()  # this start's lines begin here (see joined)
            self._joined = False
            # Own session: the node's whole process tree can be signalled as one group, the way
            # a machine failure takes everything on it.
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        self.address = ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def joined(self) -> bool:
        """Whether this start of the daemon has finished joining (its log says so).

        Its record in etcd appears before that: a test that broke etcd the moment it saw the
        record once caught the daemon still inside its join, where etcd unreachable is fatal.
        """
        if not self._joined:  # true until the next start: read the log only until then
            with contextlib.suppress(OSError), open(self.log_path, "rb") as fh:
                fh.seek(self.log_offset)
                self._joined = joined_sentence(self.node_id).encode() in fh.read()
        return self._joined

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int, group: bool = False) -> None:
        if self.running:
            if group:
                os.killpg(self.pid, sig)
            else:
                self.proc.send_signal(sig)

    def tagged(self) -> list[int]:
        """Processes started for this node's jobs (agents, workers), found by their tag."""
        return tagged_pids(prefix=f"{self.prefix}:{self.node_id}:")

    def kill(self) -> float | None:
        """What a machine failure does: SIGKILL to the daemon's process group and to every
        process of its jobs (agents and workers live in sessions of their own), all at once.
        Returns the wall time of the first SIGKILL (None: not started): the fault's moment, taken
        after the scan for the node's processes (75-160 ms on a loaded machine), which a
        benchmark's clock must not count as recovery."""
        if self.proc is None:
            return None
        victims = self.tagged()
        killed_at = SYSTEM_CLOCK.wall()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        signal_all(victims, signal.SIGKILL)  # not after another scan: the processes die together
        # Again until none is left: a live node may be forking (an agent restarting its
        # workers, the warm-start zygote) while it is killed, and a child forked after a
        # listing would survive it (seen in the partition benchmark).
        deadline = SYSTEM_CLOCK.monotonic() + 5.0
        pids = self.tagged()
        while pids and SYSTEM_CLOCK.monotonic() < deadline:
            signal_all(pids, signal.SIGKILL)
            SYSTEM_CLOCK.sleep(0.02)
            pids = self.tagged()
        self.proc.wait()
        if self.shm_dir:  # the machine's RAM is gone: its snapshots and its peers' replicas
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            shutil.rmtree(self.shm_dir + "+replicas", ignore_errors=True)
        return killed_at

    def sigterm(self, timeout: float) -> int | None:
        """Stops the daemon as an operator does (SIGCONT, SIGTERM) and waits up to ``timeout``;
        returns its exit status, or None if it is still running (then it has been sent
        SIGUSR1: every thread's stack is in its log, a record of where it is stuck)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.terminate()
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGUSR1)
                SYSTEM_CLOCK.sleep(1.0)
        return self.proc.poll()

    def terminate(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the group; returns the exit status."""
        if self.proc is None:
            return None
        code = self.sigterm(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        signal_all(self.tagged(), signal.SIGKILL)  # whatever the daemon failed to stop
        self.proc.wait()
        return code

    def http(self, path: str, timeout: float = 2.0, attempts: int = 3) -> Any:
        """GETs ``path`` from the node's HTTP endpoint (JSON for /status, else text)."""
        for attempt in range(attempts):
            try:
                with urllib.request.urlopen(f"http://{self.address}{path}", timeout=timeout) as resp:
                    body = resp.read()
                break
            except urllib.error.URLError as exc:
                # One refused connect was seen once on a loaded machine; a second try tells a
                # blip from a dead endpoint.
                if not self.running:
                    # Say why: a refused connect alone left a CI failure unexplained.
                    code = self.proc.returncode if self.proc is not None else None
                    try:
                        tail = self.log_text().splitlines()[-15:]
                    except OSError:
                        tail = []
                    raise urllib.error.URLError(
                        f"{exc.reason}: daemon {self.node_id} is not running (exit code "
                        f"{code}); its log ends: {tail}") from exc
                if attempt == attempts - 1:
                    raise
                SYSTEM_CLOCK.sleep(0.2)
        return json.loads(body) if path.startswith("/status") else body.decode()

    def healthz(self, timeout: float = 2.0) -> tuple[int | str, float]:
        """One ``/healthz`` poll: its HTTP status (or the error, in words) and its seconds."""
        started = SYSTEM_CLOCK.monotonic()
        try:
            with urllib.request.urlopen(f"http://{self.address}/healthz", timeout=timeout) as r:
                code: int | str = r.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        except OSError as exc:
            code = f"{exc.__class__.__name__}: {exc}"
        return code, SYSTEM_CLOCK.monotonic() - started

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


class LocalCluster:
    """An etcd and N daemons on this host.

    Args:
        nodes: node ids to start (e.g. ["n1", "n2", "n3"]).
        workdir: where logs and etcd data go (a temporary directory by default).
        etcd_members: size of the etcd cluster the launcher owns.
        etcd: endpoints of an existing etcd to use instead of starting one.
        extra_args: more ``elasticd`` flags for every node.
        etcd_client: credentials of the launcher's own etcd client (``EtcdSettings`` fields:
            user, password, ca_cert, cert, key), for a secured etcd.
        node_env: more environment for one node's daemon (and so its jobs), by node id: e.g.
            its own ``CUDA_VISIBLE_DEVICES``.
        shm_prefix: the name prefix of the cluster's directory in /dev/shm.
    """

    def __init__(self, nodes: Sequence[str], workdir: str | None = None, lease_ttl: int = 2,
                 etcd_members: int = 1, etcd: str | None = None, prefix: str = "/elasticd",
                 extra_args: Sequence[str] = (), loop_interval: float = 0.25,
                 env: dict[str, str] | None = None, replication: bool = False,
                 etcd_client: dict[str, str] | None = None,
                 node_env: dict[str, dict[str, str]] | None = None,
                 shm_prefix: str = "elasticd-test-") -> None:
        self.workdir = workdir or tempfile.mkdtemp(prefix="elasticd-cluster-")
        os.makedirs(self.workdir, exist_ok=True)
        self.prefix = prefix
        self.keys = Keyspace(prefix)
        self.lease_ttl = lease_ttl
        self.etcd_server = (EmbeddedEtcd(members=etcd_members,
                                         data_dir=os.path.join(self.workdir, "etcd"))
                            if etcd is None else None)
        self._etcd = etcd
        self.etcd_client = dict(etcd_client or {})
        self.extra_args = list(extra_args)
        self.loop_interval = loop_interval
        self.env = {**os.environ, **(env or {})}
        self.node_env = dict(node_env or {})
        # The jobs' temporary files (TMPDIR, which the daemons' agents and workers inherit): a
        # directory of the cluster's own, removed at stop, so that what a killed worker leaves
        # behind (multiprocessing's pymp-* listener directories, for one) goes with it. Not
        # under the workdir: AF_UNIX socket paths under it must stay short.
        self.tmp_dir = None
        if "TMPDIR" not in (env or {}):
            self.tmp_dir = tempfile.mkdtemp(prefix="elasticd-tmp-")
            os.chmod(self.tmp_dir, 0o1777)  # as /tmp: the jobs' user writes there
            self.env["TMPDIR"] = self.tmp_dir
        if replication:
            # Peer replicas over loopback, authenticated with a per-cluster secret.
            self.env["ELASTICD_CLUSTER_SECRET"] = os.urandom(16).hex()
            self.extra_args += ["--replication-listen", "127.0.0.1:0"]
        # Each simulated node's checkpoint RAM: its own tmpfs directory, deleted when the node
        # is killed (a dead machine's RAM is gone) and when the cluster stops.
        self.shm_root = tempfile.mkdtemp(prefix=shm_prefix, dir="/dev/shm")
        # The job runs as JOB_USER: it reaches the daemons' sockets under the workdir and
        # (until slots are handed over as descriptors) its slot files under the shm root.
        reachable(self.workdir)
        reachable(self.shm_root)
        self.nodes: dict[str, NodeProcess] = {n: self._make(n) for n in nodes}
        self._coord: EtcdCoordinator | None = None

    @property
    def etcd(self) -> str:
        return self._etcd or (self.etcd_server.endpoints if self.etcd_server else "")

    def _make(self, node_id: str) -> NodeProcess:
        argv = [sys.executable, "-m", "elasticd.daemon.main", "--node-id", node_id,
                "--etcd", "{etcd}", "--prefix", self.prefix, "--listen", "127.0.0.1:0",
                "--lease-ttl", str(self.lease_ttl), "--loop-interval", str(self.loop_interval),
                "--state-dir", os.path.join(self.workdir, node_id),
                "--shm-dir", os.path.join(self.shm_root, node_id), *self.extra_args]
        n = NodeProcess(node_id, argv, os.path.join(self.workdir, f"{node_id}.log"),
                        {**self.env, **self.node_env.get(node_id, {})}, self.prefix)
        n.shm_dir = os.path.join(self.shm_root, node_id)
        return n

    def start(self, wait: bool = True, timeout: float = 30.0) -> "LocalCluster":
        if self.etcd_server is not None and not any(m.proc for m in self.etcd_server.members):
            self.etcd_server.start()
        for n in self.nodes.values():
            self.start_node(n.node_id, wait=False)
        if wait:
            self.wait_for(lambda: all(self.registered(n) for n in self.nodes), timeout,
                          "every node registered")
        return self

    def start_node(self, node_id: str, wait: bool = True, timeout: float = 30.0) -> NodeProcess:
        n = self.nodes.get(node_id) or self._make(node_id)
        self.nodes[node_id] = n
        n.argv = [a.replace("{etcd}", self.etcd) for a in n.argv]
        n.start()
        if wait:
            self.wait_for(lambda: self.registered(node_id), timeout, f"{node_id} registered")
        return n

    # -- etcd views -----------------------------------------------------------------------

    def coordinator(self) -> EtcdCoordinator:
        if self._coord is None:
            self._coord = EtcdCoordinator(EtcdSettings(parse_endpoints(self.etcd), timeout=1.0,
                                                       **self.etcd_client))
        return self._coord

    def node_records(self) -> dict[str, dict[str, Any]]:
        kvs, _ = self.coordinator().get_prefix(self.keys.nodes)
        out = {}
        for kv in kvs:  # a test may plant bad records: skip them
            with contextlib.suppress(ValueError, records.RecordError):
                out[self.keys.node_of(kv.key)] = records.decode(kv.value, "node", kv.key)
        return out

    def registered(self, node_id: str) -> bool:
        """True when the node's current process has its record in etcd (address learnt) and
        has finished joining."""
        n = self.nodes[node_id]
        try:
            rec = self.node_records().get(node_id)
        except Exception:
            return False
        if rec is None or not n.running or rec["pid"] != n.pid or not n.joined():
            return False
        n.address = rec["address"]
        return True

    def events(self) -> list[dict[str, Any]]:
        from elasticd.cluster.events import EventLog

        return [e.__dict__ for e in EventLog(self.coordinator(), self.keys).list()]

    @staticmethod
    def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
        deadline = SYSTEM_CLOCK.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            if SYSTEM_CLOCK.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for: {what}")
            SYSTEM_CLOCK.sleep(interval)

    def stop(self) -> None:
        """Stops every node (SIGTERM, then SIGKILL of its group) and the owned etcd; removes the
        nodes' shared memory and the jobs' temporary directory."""
        for n in self.nodes.values():
            n.terminate()
        if self._coord is not None:
            self._coord.close()
            self._coord = None
        if self.etcd_server is not None:
            self.etcd_server.stop()
        shutil.rmtree(self.shm_root, ignore_errors=True)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
