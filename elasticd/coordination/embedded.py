"""A private etcd server started from the ``etcd`` binary on PATH.

Used three ways: by a lone ``elasticd`` started with no ``--etcd`` (it owns its etcd and stops
it on exit), by the demo launcher, and by the tests. Where several daemons share one etcd (the
demo, the tests), the launcher owns it, never one of the daemons, so that killing any daemon
leaves coordination up.

The server binds to 127.0.0.1 only, on free ports, with a temporary data directory and
auto-compaction so that a long run does not grow etcd's database without bound: by default
revision-based, keeping 10,000 revisions (:data:`COMPACTION`). A production etcd at scale is
better run by time (docs/operations.md, "Compaction and quota"); ``compaction`` sets it here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from typing import Sequence

from elasticd.clock import Clock, SystemClock
from elasticd.errors import NodeError

ETCD_INSTALL_HINT = (
    "no etcd binary on PATH: install one (Debian/Ubuntu: `apt-get install etcd-server`), "
    "or point elasticd at a running cluster with --etcd HOST:PORT"
)


class EtcdNotFound(NodeError, RuntimeError):
    """The ``etcd`` binary is not installed."""


class EtcdStartError(NodeError, RuntimeError):
    """etcd was started but did not become healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: etcd's ``--auto-compaction-mode`` and ``--auto-compaction-retention`` by default. etcd 3.4's
#: revision mode compacts every 5 minutes to the revision 10,000 back, so it keeps 10,000
#: revisions and up to 5 minutes of writes besides. The demo's and one host's clusters write a
#: few revisions a second (hours of history in a few MB), and the chaos harness replays a
#: scenario's committed records from revision 1 (tests/chaos/harness.py, ``commit_history``).
COMPACTION = ("revision", "10000")


class EtcdMember:
    """One etcd process (a single-node cluster, or one member of a loopback cluster)."""

    def __init__(self, name: str, data_dir: str, client_port: int, peer_port: int,
                 initial_cluster: str, binary: str, log_path: str,
                 tls: tuple[str, str, str] | None, cluster_token: str,
                 compaction: tuple[str, str]) -> None:
        self.name = name
        self.data_dir = data_dir
        self.client_port = client_port
        self.peer_port = peer_port
        self.initial_cluster = initial_cluster
        self.binary = binary
        self.log_path = log_path
        self.tls = tls  # (ca, cert, key): clients must present a certificate signed by ca
        self.cluster_token = cluster_token
        self.compaction = compaction
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        """Starts (or restarts, keeping the data directory) the member."""
        scheme = "https" if self.tls else "http"
        cmd = [
            self.binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.cluster_token,
            # Keep etcd's history bounded however long the run (COMPACTION).
            "--auto-compaction-mode", self.compaction[0],
            "--auto-compaction-retention", self.compaction[1],
            "--quota-backend-bytes", str(2 * 1024**3),
            "--heartbeat-interval", "100",
            "--election-timeout", "1000",
            "--log-level", "warn",
            "--logger", "zap",
        ]
        if self.tls:
            ca, cert, key = self.tls
            cmd += ["--trusted-ca-file", ca, "--cert-file", cert, "--key-file", key,
                    "--client-cert-auth"]
        # etcd takes ETCD_* variables as flags: only the command line above configures it.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.log_path, "ab") as log:
            # A session of its own: a Ctrl-C aimed at the launcher's terminal must not reach
            # etcd before the daemons have left cleanly.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # A stopped (SIGSTOP) etcd ignores SIGTERM until continued.
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class EmbeddedEtcd:
    """A loopback etcd cluster of one or more members, owned by whoever created it.

    Args:
        members: number of members (1, or 3 for tests that kill the leader).
        data_dir: parent directory for member data; a temporary one by default, removed on stop.
        compaction: etcd's auto-compaction (mode, retention), e.g. ``("periodic", "1m")``.
    """

    def __init__(self, members: int = 1, data_dir: str | None = None, binary: str = "etcd",
                 tls: tuple[str, str, str] | None = None,
                 client_tls: tuple[str, str, str] | None = None,
                 clock: Clock | None = None,
                 compaction: tuple[str, str] = COMPACTION) -> None:
        self.binary = shutil.which(binary)
        if self.binary is None:
            raise EtcdNotFound(ETCD_INSTALL_HINT)
        self._own_dir = data_dir is None
        self.dir = data_dir or tempfile.mkdtemp(prefix="elasticd-etcd-")
        os.makedirs(self.dir, exist_ok=True)
        names = [f"etcd{i}" for i in range(members)]
        ports = [(free_port(), free_port()) for _ in names]
        initial = ",".join(f"{n}=http://127.0.0.1:{pp}" for n, (_, pp) in zip(names, ports))
        # Every member of one cluster must share the token (it seeds the cluster ID): with a
        # token per member, three members formed three clusters that refused each other.
        token = f"elasticd-{os.getpid()}-{id(self)}"
        self.members = [
            EtcdMember(n, os.path.join(self.dir, n), cp, pp, initial, self.binary,
                       os.path.join(self.dir, f"{n}.log"), tls, token, compaction)
            for n, (cp, pp) in zip(names, ports)
        ]
        self.client_tls = client_tls  # (ca, cert, key) the launcher's own health checks use
        self.clock = clock or SystemClock()

    @property
    def endpoints(self) -> str:
        """The ``--etcd`` value that reaches this cluster."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 20.0) -> "EmbeddedEtcd":
        for m in self.members:
            m.start()
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 20.0, members: Sequence[EtcdMember] | None = None) -> None:
        """Waits until a write through every given member succeeds."""
        from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints

        deadline = self.clock.monotonic() + timeout
        ca, cert, key = self.client_tls or (None, None, None)
        for m in members or self.members:
            coord = EtcdCoordinator(EtcdSettings(parse_endpoints(m.endpoint), timeout=1.0,
                                                 ca_cert=ca, cert=cert, key=key))
            try:
                while True:
                    if m.proc is not None and m.proc.poll() is not None:
                        raise EtcdStartError(
                            f"etcd {m.name} exited with {m.proc.returncode}; see {m.log_path}"
                        )
                    try:
                        coord.put(b"/elasticd-health", b"ok")
                        break
                    except Exception:
                        if self.clock.monotonic() > deadline:
                            raise EtcdStartError(
                                f"etcd {m.name} not healthy after {timeout}s; see {m.log_path}"
                            ) from None
                        self.clock.sleep(0.1)
            finally:
                coord.close()

    def leader(self) -> EtcdMember:
        """The member that currently leads (asked through the members' status API)."""
        import pyetcd

        for m in self.members:
            if m.proc is None:
                continue
            c = pyetcd.MultiEndpointEtcd3Client(
                [pyetcd.Endpoint("127.0.0.1", m.client_port, secure=False, time_retry=0.5)],
                timeout=1.0, failover=True)
            try:
                st = c.status()
                if st.leader is not None:
                    for cand in self.members:
                        if cand.name == st.leader.name:
                            return cand
            except Exception:
                continue
            finally:
                c.close()
        raise EtcdStartError("no etcd member reports a leader")

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
