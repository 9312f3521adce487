"""N nodes' commit code on one real etcd, no torch, no snapshot bytes: the per-step commit
protocol measured alone.

Each simulated node is elasticd's own :class:`~elasticd.replication.tracker.CommitTracker`
(with its reporter, and its term as coordinator when it wins one) on an etcd client of its own
(:class:`~elasticd.coordination.etcd.EtcdCoordinator`: its own gRPC channel, leases, requests
and watch), fed the events the replicator feeds it: every ``--period`` each node's ranks
snapshot the next step (``latest``), a copy lands, and each placement peer acknowledges it
(:meth:`CommitTracker.on_pushed`; an older elasticd's ``on_landed`` and ``on_ack``), as the
pusher does after a push. Reports travel in-process (:class:`LocalReports`: a direct call into the coordinator
node's tracker, where the daemon uses the replication channel). No decision logic lives here.

Run against whichever elasticd is first on ``sys.path``: this tree's (the commit coordinator)
or an older one's (``--impl base``: the per-node ``ckpt/replicated/<node>`` records and the
read-everything commit, driven through the same calls), so that ``bench_commit_scale.py`` runs
both against the same etcd in one session.

For a scale simulator, one simulated node is :class:`HarnessNode`: build it with the node's
own ``Coordinator``, call :meth:`HarnessNode.join` with the round's placement, then
:meth:`HarnessNode.snapshot` once per snapshot step and :meth:`HarnessNode.tick` every 0.1 s
(the reporter's periodic work: retries, campaigns, the election lease; the daemon runs it on a
thread of its own). Its etcd traffic per step is the one watch event of the committed record
(two when the ahead record changes), plus the coordinator's one or two transactions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from typing import Any

from elasticd.clock import SystemClock
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.replication.background import Background
from elasticd.replication.placement import compute_placement
from elasticd.replication.tracker import CommitTracker

JOB = "job"
NEW = hasattr(CommitTracker, "set_placement")  # the commit coordinator's tracker


class LocalReports:
    """Delivers a report to the named node's tracker (in-process, instead of the replication
    channel)."""

    def __init__(self) -> None:
        self.nodes: dict[str, CommitTracker] = {}
        self.sent = 0

    def __call__(self, node: str, report: Any) -> Any:
        from elasticd.replication.api import ReplicationError
        tracker = self.nodes.get(node)
        if tracker is None:
            raise ReplicationError(f"no node {node}")
        self.sent += 1
        return tracker.reporter.on_report(report)


class HarnessNode:
    """One simulated node's commit code (see the module docstring)."""

    def __init__(self, name: str, coord: Any, keys: Keyspace, reports: LocalReports | None,
                 ttl: float = 2.0, background: Background | None = None) -> None:
        self.name, self.coord, self.keys = name, coord, keys
        self._tick_at = 0.0
        # The tracker's pool (the replicator's, 2 threads, on a real node); a simulator may
        # hand one pool to many nodes: the same tasks through the same code, fewer threads
        # waiting for one interpreter's GIL.
        self.background = background or Background(f"harness-{name}", 2)
        kw: dict[str, Any] = {"commit_wait": 0.0, "withdraw_after": 1.0}
        if NEW:
            kw.update(send=reports, lease_ttl=ttl)
        self.tracker = CommitTracker(name, coord, keys, SystemClock(), self.background,
                                     lambda job: None, **kw)
        if reports is not None:
            reports.nodes[name] = self.tracker

    def join(self, placement: Any) -> None:
        """Adopts the round's placement and starts the commit watch."""
        t = self.tracker
        if NEW:
            _, need_watch = t.set_placement(JOB, placement)
        else:  # the older replicator's set_membership, without publishing
            with t.lock:
                st = t.state(JOB)
                st.previous, st.placement = st.placement, placement
                need_watch = True
        if need_watch:
            t.prefix.watch(JOB)

    def snapshot(self, placement: Any, step: int) -> None:
        """Every local rank snapshots ``step``; its copy lands at each placement peer."""
        t, v = self.tracker, (0, step)
        ranks = placement.ranks.get(self.name, ())
        with t.lock:
            st = t.state(JOB)
            for rank in ranks:
                st.latest[rank] = v
                st.gen_base.setdefault(0, step - 1)
        peers = placement.peers_of(self.name)
        if hasattr(t, "on_pushed"):  # one call per peer for all the node's ranks
            for peer in peers:
                t.on_pushed(JOB, v, ranks, peer)
            return
        for rank in ranks:  # an older elasticd: the per-rank calls
            t.on_landed(JOB, rank, v)
            for peer in peers:
                t.on_ack(JOB, rank, v, peer)

    def tick(self) -> None:
        """Called every 0.1 s: runs the reporter's tick when it is due, as the daemon's
        ticker thread does (when the tick said, or when woken; every call for an elasticd
        whose tick says nothing)."""
        if not NEW:
            return
        reporter, now = self.tracker.reporter, time.monotonic()
        wake = getattr(reporter, "wake", None)
        if wake is None or wake.is_set() or now >= self._tick_at:
            if wake is not None:
                wake.clear()
            self._tick_at = now + (reporter.tick() or 0.0)

    def lag(self) -> int:
        with self.tracker.lock:
            st = self.tracker.jobs.get(JOB)
            return st.sync_lag() if st is not None else 0

    def committed(self) -> tuple[int, int] | None:
        with self.tracker.lock:
            st = self.tracker.jobs.get(JOB)
            return st.committed.version if st is not None and st.committed else None

    def close(self) -> None:
        self.tracker.close()
        self.background.close()
        self.coord.close()


def scrape(url: str) -> dict[str, float]:
    import urllib.request
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def total(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def run(endpoints: str, metrics_url: str, prefix: str, n: int, ranks_per_node: int,
        period: float, window: float, warmup: float, ttl: float) -> dict[str, Any]:
    keys = Keyspace(prefix)
    settings = EtcdSettings(parse_endpoints(endpoints), timeout=5.0)
    reports = LocalReports() if NEW else None
    names = [f"n{i:04d}" for i in range(n)]
    nodes = [HarnessNode(name, EtcdCoordinator(settings), keys, reports, ttl) for name in names]
    placement = compute_placement(
        names, {name: range(i * ranks_per_node, (i + 1) * ranks_per_node)
                for i, name in enumerate(names)}, 2, round=1)
    observer = EtcdCoordinator(settings)
    events: list[tuple[float, bytes, int, int]] = []
    lock = threading.Lock()

    def on_events(batch: Any) -> None:
        if isinstance(batch, Exception):
            return
        now = time.monotonic()
        with lock:
            events.extend((now, e.kv.key, len(e.kv.value), e.kv.mod_revision) for e in batch)

    for node in nodes:
        node.join(placement)
    stop = threading.Event()

    def ticker() -> None:
        while not stop.wait(0.1):
            for node in nodes:
                node.tick()

    threading.Thread(target=ticker, daemon=True).start()
    pool_lock = threading.Lock()
    step = [0]
    lags: list[int] = []

    def drive(deadline: float, sample: bool) -> None:
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            if sample:  # each node's sync lag just before its next snapshot, and halfway
                with pool_lock:
                    lags.extend(node.lag() for node in nodes)
            step[0] += 1
            order = nodes[:]
            random.shuffle(order)
            threads = [threading.Thread(target=lambda part=order[i::8]: [
                node.snapshot(placement, step[0]) for node in part]) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic() - period / 2))
            if sample:
                with pool_lock:
                    lags.extend(node.lag() for node in nodes)
            time.sleep(max(0.0, next_at - time.monotonic()))

    drive(time.monotonic() + warmup, sample=False)
    _, rev0 = observer.get_prefix(keys.replication(JOB).ckpt)
    watch = observer.watch_prefix(keys.job(JOB), on_events, rev0 + 1)
    m0 = scrape(metrics_url)
    sent0 = reports.sent if reports is not None else 0
    c0 = max((node.committed() or (0, 0))[1] for node in nodes)
    t0 = time.monotonic()
    drive(t0 + window, sample=True)
    elapsed = time.monotonic() - t0
    m1 = scrape(metrics_url)
    c1 = max((node.committed() or (0, 0))[1] for node in nodes)
    rev1 = observer.revision()
    watch.cancel()
    stop.set()
    with lock:
        evs = list(events)
    ckpt = keys.replication(JOB).ckpt
    mine = [e for e in evs if e[1].startswith(ckpt)]
    revisions = len({e[3] for e in mine})
    commits = c1 - c0
    sizes = [e[2] for e in mine]
    out = {
        "impl": "coordinator" if NEW else "base", "n": n, "ranks_per_node": ranks_per_node,
        "period_s": period, "window_s": round(elapsed, 2), "steps": step[0],
        "commits": commits,
        "etcd_revisions_total": rev1 - rev0,
        "ckpt_write_revisions": revisions,
        "ckpt_keys_written": len(mine),
        "writes_per_committed_step": round(revisions / commits, 3) if commits else None,
        "keys_per_committed_step": round(len(mine) / commits, 3) if commits else None,
        "bytes_per_write_max": max(sizes, default=0),
        "bytes_per_write_median": statistics.median(sizes) if sizes else 0,
        "written_bytes_per_committed_step": round(sum(sizes) / commits) if commits else None,
        "range_requests_per_committed_step": round(
            (total(m1, 'grpc_server_handled_total{grpc_code="OK",grpc_method="Range"')
             - total(m0, 'grpc_server_handled_total{grpc_code="OK",grpc_method="Range"'))
            / commits, 2) if commits else None,
        "txn_requests_per_committed_step": round(
            (total(m1, 'grpc_server_handled_total{grpc_code="OK",grpc_method="Txn"')
             - total(m0, 'grpc_server_handled_total{grpc_code="OK",grpc_method="Txn"'))
            / commits, 2) if commits else None,
        "etcd_sent_bytes_per_committed_step": round(
            (total(m1, "etcd_network_client_grpc_sent_bytes_total")
             - total(m0, "etcd_network_client_grpc_sent_bytes_total")) / commits)
        if commits else None,
        "etcd_cpu_seconds": round(total(m1, "process_cpu_seconds_total")
                                  - total(m0, "process_cpu_seconds_total"), 3),
        "etcd_cpu_pct": round(100 * (total(m1, "process_cpu_seconds_total")
                                     - total(m0, "process_cpu_seconds_total")) / elapsed, 1),
        "lag_steps_median": statistics.median(lags) if lags else None,
        "lag_steps_p90": sorted(lags)[int(0.9 * (len(lags) - 1))] if lags else None,
        "lag_samples": len(lags),
        "db_size_bytes": [total(m0, "etcd_mvcc_db_total_size_in_bytes"),
                          total(m1, "etcd_mvcc_db_total_size_in_bytes")],
        "db_in_use_bytes": [total(m0, "etcd_mvcc_db_total_size_in_use_in_bytes"),
                            total(m1, "etcd_mvcc_db_total_size_in_use_in_bytes")],
    }
    if reports is not None and commits:  # over the replication channel, not etcd
        out["reports_per_committed_step"] = round((reports.sent - sent0) / commits, 2)
    for node in nodes:
        node.close()
    observer.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoints", required=True)
    p.add_argument("--metrics", required=True, help="etcd's /metrics URL")
    p.add_argument("--prefix", required=True)
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--period", type=float, default=1.0)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--ttl", type=float, default=2.0)
    a = p.parse_args()
    print(json.dumps(run(a.endpoints, a.metrics, a.prefix, a.nodes, a.ranks_per_node,
                         a.period, a.window, a.warmup, a.ttl)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
