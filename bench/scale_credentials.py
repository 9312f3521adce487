"""A job's start at N nodes with etcd auth on: every daemon issues its agent's etcd user.

With etcd auth on (docs/security.md asks for it), each node's daemon gives its job's agent an
etcd user of its own before the agent starts (:mod:`elasticd.coordination.agent_credentials`):
a user (bcrypt of a fresh password), two roles and their grants, about seven changes of etcd's
auth store per node. Every change moves the auth store's revision, and etcd refuses, unapplied,
any request whose token predates a change committed between its arrival and its apply
("revision of auth store is old"); etcd's own log-in repeats itself for as long as the store
keeps moving. This measures what that costs when N daemons do it at once, with the product's
own code: :class:`AgentCredentials.issue` for N simulated nodes (``--threads`` at a time, each
on its own root client), each agent logging in with what it was given as soon as its daemon
has issued it (an :class:`EtcdCoordinator` reading its job's rendezvous prefix, as the agent's
first call does), while one daemon-like client writes its node record every 0.1 s.

Figures: the wall time from the first issue to the last agent logged in; per-node issue and
log-in times (median, max); the heartbeat writer's write latency (median, max) and how many of
its writes etcd refused as stale (and the client repeated); etcd's CPU seconds. Baselines in the
same run, on the same etcd: the N agents logging in with users made beforehand (no auth change
meanwhile), and the heartbeat writer alone.

    python bench/scale_credentials.py --sizes 100,300 --out bench/results/scale_credentials.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from elasticd.coordination import etcd as etcd_adapter  # noqa: E402
from elasticd.coordination.agent_credentials import PASSWORD_ENV, AgentCredentials  # noqa: E402
from elasticd.coordination.embedded import EmbeddedEtcd  # noqa: E402
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints  # noqa: E402
from elasticd.coordination.etcd_connection import EtcdConnection  # noqa: E402
from elasticd.coordination.keys import Keyspace  # noqa: E402

JOB = "job"
PREFIX = "/elasticd"


def _etcdctl(endpoint: str, *args: str) -> None:
    subprocess.run(["etcdctl", "--endpoints", endpoint, *args], check=True,
                   capture_output=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=60)


class StaleCount:
    """Counts the requests etcd refused as stale that the adapter repeated (its own rule)."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()
        self._orig = EtcdConnection._repeat_stale

    def __enter__(self) -> "StaleCount":
        counter = self

        def counted(connection, client, since):
            with counter._lock:
                counter.n += 1
            return counter._orig(connection, client, since)

        EtcdConnection._repeat_stale = counted
        return self

    def __exit__(self, *exc) -> None:
        EtcdConnection._repeat_stale = self._orig


class Heartbeat:
    """One daemon-like client writing its record every 0.1 s; each write's latency."""

    def __init__(self, settings: EtcdSettings, keys: Keyspace) -> None:
        self.coord = EtcdCoordinator(settings)
        self.key = keys.node("heartbeat")
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.coord.put(self.key, str(i).encode())
                self.latencies.append(time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - a bench: record, go on
                self.failures.append(str(exc)[:200])
            i += 1
            self._stop.wait(0.1)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.coord.close()

    def summary(self) -> dict:
        lat = self.latencies or [float("nan")]
        return {"writes": len(self.latencies), "failed": len(self.failures),
                "failures_sample": self.failures[:3],
                "latency_ms_median": round(1e3 * statistics.median(lat), 2),
                "latency_ms_max": round(1e3 * max(lat), 2)}


def _login(ep, user: str, password: str, keys: Keyspace) -> float:
    """An agent's first call with its credentials; seconds it took (log-in included)."""
    t0 = time.perf_counter()
    coord = EtcdCoordinator(EtcdSettings(ep, timeout=30, user=user, password=password))
    try:
        coord.get_prefix(keys.rendezvous(JOB).prefix)
    finally:
        coord.close()
    return time.perf_counter() - t0


def _stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs else {}


def run(n: int, threads: int) -> dict:
    server = EmbeddedEtcd().start()
    try:
        ep0 = server.members[0].endpoint
        _etcdctl(ep0, "user", "add", "root", "--new-user-password", "rootpw")
        _etcdctl(ep0, "auth", "enable")
        ep = parse_endpoints(server.endpoints)
        root = EtcdSettings(ep, timeout=30, user="root", password="rootpw")
        keys = Keyspace(PREFIX)
        etcd_proc = psutil.Process(server.members[0].pid)
        files = tempfile.mkdtemp(prefix="elasticd-bench-cred-")
        clients = [EtcdCoordinator(root) for _ in range(threads)]
        spec = SimpleNamespace(name=JOB, user="nobody")

        # Baseline: the heartbeat writer alone.
        with Heartbeat(root, keys) as alone:
            time.sleep(3.0)

        # The job start: every node issues, then its agent logs in.
        issue_s: list[float] = []
        login_s: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()

        def node(i: int) -> None:
            coord = clients[i % threads]
            creds = AgentCredentials(coord, keys, f"node-{i:05d}", files)
            t0 = time.perf_counter()
            try:
                conf, env = creds.issue(spec)
                t1 = time.perf_counter()
                took = _login(ep, conf["user"], env[PASSWORD_ENV], keys)
            except Exception as exc:  # noqa: BLE001 - a bench: record, go on
                with lock:
                    errors.append(f"node-{i:05d}: {str(exc)[:200]}")
                return
            with lock:
                issue_s.append(t1 - t0)
                login_s.append(took)

        cpu0 = sum(etcd_proc.cpu_times()[:2])
        with StaleCount() as stale, Heartbeat(root, keys) as during:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(node, range(n)))
            wall = time.perf_counter() - t0
        cpu_start = sum(etcd_proc.cpu_times()[:2]) - cpu0

        # Baseline: the same N agents logging in again, the users made (no auth change now).
        users = [(AgentCredentials(clients[0], keys, f"node-{i:05d}", files).user_name(JOB))
                 for i in range(n)]
        # Their passwords never leave the daemon: give each a known one for the baseline.
        from pyetcd import etcdrpc

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda u: clients[0].auth_call(
                "UserChangePassword",
                etcdrpc.AuthUserChangePasswordRequest(name=u, password="pw")), users))
        cpu0 = sum(etcd_proc.cpu_times()[:2])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            quiet = list(pool.map(lambda u: _login(ep, u, "pw", keys), users))
        quiet_wall = time.perf_counter() - t0
        cpu_quiet = sum(etcd_proc.cpu_times()[:2]) - cpu0
        for c in clients:
            c.close()
        shutil.rmtree(files, ignore_errors=True)
        return {
            "n": n, "threads": threads,
            "job_start": {"wall_seconds": round(wall, 2), "etcd_cpu_seconds": round(cpu_start, 2),
                          "issue_seconds": _stats(issue_s), "login_seconds": _stats(login_s),
                          "nodes_failed": len(errors), "errors_sample": errors[:3],
                          "stale_refusals_repeated": stale.n,
                          "heartbeat": during.summary()},
            "baseline_logins_alone": {"wall_seconds": round(quiet_wall, 2),
                                      "etcd_cpu_seconds": round(cpu_quiet, 2),
                                      "login_seconds": _stats(quiet)},
            "baseline_heartbeat_alone": alone.summary(),
        }
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100")
    ap.add_argument("--threads", type=int, default=16,
                    help="daemons issuing at once (each on its own root client)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = {"benchmark": "scale_credentials", "command": " ".join(sys.argv),
           "machine": f"{platform.node()} {os.cpu_count()} cores",
           "etcd": subprocess.run(["etcd", "--version"], capture_output=True,
                                  text=True).stdout.splitlines()[0],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "stale_patience_seconds": etcd_adapter._STALE_TOKEN_PATIENCE,
           "results": []}
    for n in [int(x) for x in args.sizes.split(",")]:
        res = run(n, args.threads)
        print(json.dumps(res), flush=True)
        out["results"].append(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
