"""The steady-training phase of ``bench/scale_native.py``: N simulated nodes committing.

Each simulated node of ``scale_native.py`` gets elasticd's own commit code, as
``bench/commit_harness.py`` builds it (:class:`~commit_harness.HarnessNode`: the node's
:class:`~elasticd.replication.tracker.CommitTracker`, its reporter, its term as coordinator when
it wins the election, its watch on the committed record), on the node's own etcd client share
(its own watch ID; the election lease, when it wins, its own), plus the agent's
:class:`~elasticd.agent.commit_watch.CommitWatch` (the grow gate's watch, also one per node).
No decision lives here: every node snapshots the step of the wall clock once per ``--period``
on its 8 ranks, each copy is acknowledged by the node's placement peer (m = 2), as the pusher
reports it, and elasticd's code elects, reports, decides and commits.

Reports travel between simulated nodes by :class:`Relay`: in-process when the coordinator is
simulated in the same process, else over a local socket to its process (elasticd's own report
encoding, where the daemon uses the authenticated replication channel). They never touch etcd.

The driver (:func:`run_phase`) watches the job's ``ckpt/`` prefix from one observer client and
measures, over ``--commit-seconds`` after a warm-up: etcd writes (revisions) per committed step
and their sizes, etcd requests and watch events per node per step, the nodes' commit lag in
steps (each node's newest snapshot minus the commit it knows, sampled every 0.1 s), etcd's CPU
(keep-alives of every lease included) beside the same cluster's CPU without the commit phase,
etcd's database size after the warm-up, after the first minute and at the end, leases lost.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import statistics
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from commit_harness import JOB, HarnessNode  # noqa: E402 - bench/, beside this file
from elasticd.agent.commit_watch import CommitWatch
from elasticd.coordination.api import CoordinationError
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.replication.api import ReplicationError
from elasticd.replication.background import Background
from elasticd.replication.commit import decode_committed
from elasticd.replication.placement import compute_placement
from elasticd.replication.report import Reply, Report, decode_reply, decode_report, \
    encode_reply, encode_report

#: Seconds between two rounds of each node's periodic work (the reporter's tick, as the
#: daemon's commit ticker does; the snapshot when the step of the wall clock changed).
TICK = 0.1

#: With ``--tick-batch``, each node's commit lag is sampled every this many rounds of the
#: ticker (every 0.5 s) rather than every round: sampling cost ~1,000 locked reads a round at
#: N = 1,000.
LAG_SAMPLE_EVERY = 5


def node_name(index: int) -> str:
    return f"node-{index:05d}"


def thread_cpu() -> dict[str, float]:
    """This process's CPU seconds by thread group (a thread's name, digits and pyetcd's hex
    ids dropped: every simulated node's ``harness-node-#_#`` pool thread is one group), ended
    threads apart."""
    import psutil

    names = {t.native_id: re.sub(r"_[0-9a-f]{6,}$|\d+", "#", t.name)
             for t in threading.enumerate()}
    out: collections.Counter[str] = collections.Counter()
    for t in psutil.Process().threads():
        out[names.get(t.id, "(not a Python thread)")] += t.user_time + t.system_time
    return dict(out)


class Relay:
    """Delivers a report to the node named, in this process or another's (see module doc)."""

    def __init__(self, me: int, procs: int, authkey: bytes) -> None:
        self.me, self.procs, self.authkey = me, procs, authkey
        self.nodes: dict[str, Any] = {}  # name -> CommitTracker (HarnessNode registers)
        self.peers: dict[int, Any] = {}
        self._idle: dict[int, queue.SimpleQueue[Connection]] = collections.defaultdict(
            queue.SimpleQueue)
        self.sent = collections.Counter[str]()
        #: Thread CPU seconds the coordinators simulated here spent taking reports.
        self.taking = 0.0
        self._taking_lock = threading.Lock()
        # No authkey: multiprocessing's handshake runs inside accept(), on this one thread, and
        # a connection that failed it ended the thread (every later Client then waited for
        # its challenge forever: no commit at N = 100). Loopback, a bench, minutes long.
        self.listener = Listener(("127.0.0.1", 0), backlog=1024)
        self.address = self.listener.address
        threading.Thread(target=self._accept, daemon=True).start()

    def __call__(self, node: str, report: Report) -> Reply:
        tracker = self.nodes.get(node)
        if tracker is not None:
            self.sent["local"] += 1
            return self._take(tracker, report)
        k = int(node.rsplit("-", 1)[1]) % self.procs
        if k == self.me or k not in self.peers:
            raise ReplicationError(f"no simulated node {node}")
        try:
            conn = self._idle[k].get_nowait()
        except queue.Empty:
            conn = Client(self.peers[k])
        try:
            conn.send_bytes(node.encode() + b"\n" + encode_report(report))
            raw = conn.recv_bytes()
        except (OSError, EOFError) as exc:
            conn.close()
            raise ReplicationError(f"relay to {node}: {exc}") from exc
        self._idle[k].put(conn)
        self.sent["remote"] += 1
        return decode_reply(raw)

    def _take(self, tracker: Any, report: Report) -> Reply:
        started = time.thread_time()
        try:
            return tracker.reporter.on_report(report)
        finally:
            spent = time.thread_time() - started
            with self._taking_lock:
                self.taking += spent

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            except Exception:  # noqa: BLE001 - one bad connection must not stop the relay
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                raw = conn.recv_bytes()
                dest, _, body = raw.partition(b"\n")
                tracker = self.nodes.get(dest.decode())
                reply = (self._take(tracker, decode_report(body)) if tracker is not None
                         else Reply(False, "term"))
                conn.send_bytes(encode_reply(reply))
        except (OSError, EOFError):
            conn.close()


class WorkerCommit:
    """One simulator process's share of the commit phase (driven by :func:`handle`)."""

    def __init__(self, nodes: dict[int, Any], ticker: Any, me: int, procs: int,
                 a: Any) -> None:
        self.nodes, self.ticker, self.a = nodes, ticker, a
        self.relay = Relay(me, procs, a.commit_authkey)
        self.parts: dict[int, HarnessNode] = {}
        self.gates: dict[int, CommitWatch] = {}
        self.lags: collections.Counter[int] = collections.Counter()
        self.snapshots = 0
        self.t0 = 0.0
        self.placement: Any = None
        self.last_step: dict[int, int] = {}
        self.tick_seconds = 0.0
        self.behind = 0  # the most steps a node's simulation fell behind the wall clock
        #: Reads of the committed prefix after the nodes' first listing (every cause: a
        #: lagging watch, a stale election record, a watch error, unresolved holders), by
        #: 10-s slice of the wall clock (its start, in whole seconds).
        self.rereads: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._sampling = False
        self._passes = 0

    def start(self, peers: dict[int, Any], alive: list[int], t0: float) -> int:
        a = self.a
        self.relay.peers = dict(peers)
        names = [node_name(i) for i in alive]
        self.placement = compute_placement(
            names, {nm: range(k * a.ranks_per_node, (k + 1) * a.ranks_per_node)
                    for k, nm in enumerate(names)}, a.replicas, round=1)
        self.t0 = t0
        threads = getattr(a, "commit_pool_threads", 0)
        shared = Background("harness-pool", threads) if threads else None
        for i, node in self.nodes.items():
            self.parts[i] = HarnessNode(node.name, node.coord, node.keys, self.relay, a.ttl,
                                        shared)
        for i, part in self.parts.items():
            part.join(self.placement)
            self._count_rereads(part.tracker.prefix)
            # The agent's grow gate, as the agent builds it: it watches etcd only while its
            # handler asks it (a newcomer waiting: none here); an older elasticd's agent
            # started its watch at once and kept it (it has start(); one with lazy=True, or
            # none, starts at the first ask).
            gate = CommitWatch(self.nodes[i].coord, self.nodes[i].keys, JOB)
            if hasattr(gate, "start") and not getattr(gate, "lazy", False):
                gate.start()
            self.gates[i] = gate
        if getattr(a, "tick_batch", 0):
            self.ticker.every_pass(TICK, self._tick_pass)
        else:
            self.ticker.every(TICK, self._tick)
        return len(self.parts)

    def _count_rereads(self, prefix: Any) -> None:
        """Counts the node's rereads (its reporter and its watch call ``prefix.reread``)."""
        read = prefix.reread

        def counted(job: str) -> None:
            with self._lock:
                self.rereads[int(time.time()) // 10 * 10] += 1
            read(job)
        prefix.reread = counted

    def _tick_pass(self, nodes: list[Any]) -> None:
        """One round of every node's periodic work (:meth:`_tick`'s, node by node, in the same
        order and through the same calls), with the simulator's own bookkeeping once per round
        rather than once per node: the wall clock's step, the CPU clock, and the lag sample,
        taken every :data:`LAG_SAMPLE_EVERY` rounds (each node's lag, as its tracker counts it;
        a step lasts 10 rounds, so the distribution keeps its shape)."""
        started = time.thread_time()
        now = time.time()
        due = int((now - self.t0) / self.a.period) + 1 if now >= self.t0 else 0
        self._passes += 1
        sample = self._sampling and self._passes % LAG_SAMPLE_EVERY == 0
        parts, last_step, lags = self.parts, self.last_step, self.lags
        behind = self.behind
        for node in nodes:
            part = parts.get(node.index)
            if part is None:
                continue
            last = last_step.get(node.index, 0)
            if due > last:  # training steps in order, never skipped: see _tick
                step = last_step[node.index] = last + 1
                if step % part.tracker.prefix.grid(JOB) == 0:
                    part.snapshot(self.placement, step)
                    self.snapshots += 1
                if due - step > behind:
                    behind = due - step
            part.tick()
            if sample:
                lags[part.lag()] += 1
        self.behind = behind
        self.tick_seconds += time.thread_time() - started

    def _tick(self, node: Any) -> None:
        part = self.parts.get(node.index)
        if part is None:
            return
        started = time.thread_time()
        now = time.time()
        if now >= self.t0:
            # Training steps in order, as DDP runs them: a node whose simulation falls behind
            # the wall clock snapshots its next step late (lag), never skips one; steps off
            # the job's snapshot grid are not snapshotted, as the checkpoint service does.
            due = int((now - self.t0) / self.a.period) + 1
            last = self.last_step.get(node.index, 0)
            if due > last:
                step = self.last_step[node.index] = last + 1
                if step % part.tracker.prefix.grid(JOB) == 0:
                    part.snapshot(self.placement, step)
                    self.snapshots += 1
                self.behind = max(self.behind, due - step)
        part.tick()
        if self._sampling:
            self.lags[part.lag()] += 1
        self.tick_seconds += time.thread_time() - started

    def sample(self, on: bool) -> None:
        self._sampling = on

    def stats(self) -> dict[str, Any]:
        leading = []
        for part in self.parts.values():
            term = part.tracker.reporter.leading(JOB)
            if term is not None:
                leading.append({"node": part.name, **term.status()})
        withdrawals = sum(p.tracker.counters.get("withdrawals", 0) for p in self.parts.values())
        return {"lags": dict(self.lags), "snapshots": self.snapshots,
                "relayed": dict(self.relay.sent), "leading": leading,
                "taking_cpu": self.relay.taking, "behind_max": self.behind,
                "grid_max": max((p.tracker.prefix.grid(JOB) for p in self.parts.values()),
                                default=1),
                "withdrawals": withdrawals, "tick_cpu": self.tick_seconds,
                "rereads": dict(self.rereads),
                "watch_lagging_rereads": sum(p.tracker.counters.get("watch_lagging_rereads", 0)
                                             for p in self.parts.values()),
                "gates_lazy": sum(1 for g in self.gates.values()
                                  if getattr(g, "lazy", not hasattr(g, "start"))),
                "thread_cpu": thread_cpu()}

    def stop(self) -> None:
        self.parts, parts = {}, self.parts
        for gate in self.gates.values():
            gate.stop()
        for part in parts.values():
            part.tracker.close()
            part.background.close()


def handle(state: dict[str, Any], cmd: tuple, nodes: dict[int, Any], ticker: Any, me: int,
           procs: int, a: Any) -> Any:
    """A ``commit_*`` command from the driver, in a simulator process."""
    if cmd[0] == "commit_setup":
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR1)  # stacks on demand: kill -USR1 <pid>
        state["commit"] = WorkerCommit(nodes, ticker, me, procs, a)
        return (me, state["commit"].relay.address)
    w: WorkerCommit = state["commit"]
    if cmd[0] == "commit_start":
        return w.start(*cmd[1:])
    if cmd[0] == "commit_go":  # the first training step's wall-clock time, on every node
        w.t0 = cmd[1]
        return "ok"
    if cmd[0] == "commit_sample":
        w.sample(cmd[1])
        return "ok"
    if cmd[0] == "commit_stats":
        import scale_profile
        if scale_profile.directory():  # the window's first call, then its last
            which = "end" if state.get("profiled") else "start"
            state["profiled"] = True
            scale_profile.dump(os.path.join(scale_profile.directory(),
                                            f"worker-{me}-{which}.json"))
        return w.stats()
    if cmd[0] == "commit_stop":
        w.stop()
        return "ok"
    raise ValueError(cmd[0])


class _Observer:
    """Every write under the job's ``ckpt/`` prefix, from one watch of the driver's own."""

    def __init__(self, endpoints: str, keys: Any) -> None:
        self.coord = EtcdCoordinator(EtcdSettings(parse_endpoints(endpoints), timeout=10.0))
        self.keys = keys
        self.events: list[tuple[float, bytes, int, int, Any]] = []
        self.lock = threading.Lock()
        _, rev = self.coord.get_prefix(keys.replication(JOB).ckpt)
        self.watch = self.coord.watch_prefix(keys.replication(JOB).ckpt, self._on, rev + 1)

    def _on(self, batch: Any) -> None:
        if isinstance(batch, CoordinationError):
            return
        now = time.monotonic()
        committed = self.keys.replication(JOB).committed
        with self.lock:
            for e in batch:
                step = None
                if e.kv.key == committed and e.kv.value:
                    try:
                        step = decode_committed(e.kv.value, e.kv.key).version
                    except Exception:  # noqa: BLE001 - counted as a write all the same
                        pass
                self.events.append((now, e.kv.key, len(e.kv.value), e.kv.mod_revision, step))

    def between(self, t0: float, t1: float) -> list[tuple[float, bytes, int, int, Any]]:
        with self.lock:
            return [e for e in self.events if t0 <= e[0] < t1]

    def close(self) -> None:
        self.watch.cancel()
        self.coord.close()


def _db(etcd: Any) -> float:
    from scale_sim import scrape
    return sum(scrape(u).get(("etcd_mvcc_db_total_size_in_bytes", ""), 0.0) for u in etcd.urls)


def _mvcc(etcd: Any) -> dict[str, float]:
    """etcd's revision, compacted revision, keys and database bytes in use (one member)."""
    from scale_sim import scrape
    m = scrape(etcd.urls[0])
    return {k: m.get((name, ""), -1.0) for k, name in (
        ("revision", "etcd_debugging_mvcc_current_revision"),
        ("compact_revision", "etcd_debugging_mvcc_compact_revision"),
        ("keys", "etcd_debugging_mvcc_keys_total"),
        ("db_bytes", "etcd_mvcc_db_total_size_in_bytes"),
        ("db_bytes_in_use", "etcd_mvcc_db_total_size_in_use_in_bytes"))}


def _events(etcd: Any) -> float:
    from scale_sim import scrape
    return sum(scrape(u).get(("etcd_debugging_mvcc_events_total", ""), 0.0) for u in etcd.urls)


def say(line: str) -> None:
    print(time.strftime("%H:%M:%S ", time.gmtime()) + line, flush=True)


def run_phase(cluster: Any, etcd: Any, server: Any, keys: Any, n: int, a: Any,
              progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """The commit phase for one N (see the module doc); returns the ``commit`` entry.
    ``progress`` is filled as it goes (what a SIGTERM leaves in it is written: see
    ``scale_native.write_partial``)."""
    import faulthandler
    import signal

    done = threading.Event()
    expected = a.commit_baseline + a.commit_warmup + a.commit_seconds + 120

    def watchdog() -> None:  # a phase that overruns shows where every process is
        if not done.wait(expected):
            say("commit phase overran: stacks to stderr")
            faulthandler.dump_traceback(all_threads=True)
            for proc in cluster.procs:
                os.kill(proc.pid, signal.SIGUSR1)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        return _run_phase(cluster, etcd, server, keys, n, a,
                          progress if progress is not None else {})
    finally:
        done.set()


def so_far(s0: dict[str, Any], s1: dict[str, Any], e0: float, e1: float, secs: float,
           nodes: int, commits: int, last: Any) -> dict[str, Any]:
    """The window's figures up to now, for an entry a SIGTERM cuts short."""
    secs = max(secs, 1e-9)
    return {"window_s": round(secs, 1), "committed_steps": commits,
            "committed_step_last": last,
            "etcd_cpu_pct": round((e1 - e0) / secs * 100, 1),
            "simulator_cpu_pct": round((s1["cpu"] - s0["cpu"]) / secs * 100, 1),
            "simulator_cpu_ms_per_node_second": round((s1["cpu"] - s0["cpu"]) / secs / nodes
                                                      * 1000, 3),
            "leases_lost": s1["leases_lost"] - s0["leases_lost"]}


def _run_phase(cluster: Any, etcd: Any, server: Any, keys: Any, n: int,
               a: Any, progress: dict[str, Any]) -> dict[str, Any]:
    alive = sorted(i for part in cluster.ask(("members",)) for i, _ in part)
    # The same cluster's etcd CPU without commits (keep-alives and idle watches), just before.
    s0, e0, t0 = cluster.stats(), etcd.cpu(), time.monotonic()
    time.sleep(a.commit_baseline)
    base_cpu = (etcd.cpu() - e0) / (time.monotonic() - t0) * 100
    base_lost = cluster.stats()["leases_lost"] - s0["leases_lost"]
    say(f"commit phase: {len(alive)} nodes, baseline {base_cpu:.1f} % etcd CPU")
    progress.update(nodes=len(alive), etcd_cpu_pct_without_commits=round(base_cpu, 1),
                    leases_lost_without_commits=base_lost)
    peers = dict(cluster.ask(("commit_setup",)))
    observer = _Observer(server.endpoints, keys)
    built = time.monotonic()
    # Training starts once every node's commit code is built, on every node at once, as a
    # job's first step does: nodes built early and snapshotting while the others are still
    # being built waited on reports that could not come, asked again and withdrew (at N =
    # 1,000 the build took 113 s of one process's thread per 250 nodes).
    cluster.ask(("commit_start", peers, alive, float("inf")))
    built = time.monotonic() - built
    wall0 = time.time() + 2.0
    cluster.ask(("commit_go", wall0))
    say(f"commit code built on every node in {built:.1f} s")
    progress["build_seconds"] = round(built, 2)
    time.sleep(max(0.0, wall0 - time.time()) + a.commit_warmup)
    cluster.ask(("commit_sample", True))
    s0, m0, e0, ev0, db0 = cluster.stats(), etcd.requests(), etcd.cpu(), _events(etcd), _db(etcd)
    c0 = [cluster_commit for cluster_commit in cluster.ask(("commit_stats",))]
    t0, wall_start = time.monotonic(), time.time()
    mvcc = {"after_warmup": _mvcc(etcd)}
    say(f"window of {a.commit_seconds:.0f} s starts")
    db_minute = None
    timeline: list[list[Any]] = []  # [s into the window, newest committed step, leases lost]
    history: list[list[Any]] = []  # etcd's compaction as it happens (docs/operations.md)
    while time.monotonic() - t0 < a.commit_seconds:
        time.sleep(min(10.0, a.commit_seconds - (time.monotonic() - t0)))
        if db_minute is None and time.monotonic() - t0 >= 60:
            db_minute = _db(etcd)
            mvcc["after_first_minute"] = _mvcc(etcd)
        with observer.lock:
            last = [e[4] for e in observer.events if e[4] is not None][-1:]
        now_mvcc = _mvcc(etcd)
        history.append([round(time.monotonic() - t0)] + [int(now_mvcc[k]) for k in (
            "revision", "compact_revision", "db_bytes", "db_bytes_in_use")])
        stats = cluster.stats()
        timeline.append([round(time.monotonic() - t0), last[0][1] if last else None,
                         stats["leases_lost"] - s0["leases_lost"]])
        say(f"  {time.monotonic() - t0:.0f} s: committed {last}, leases lost {timeline[-1][2]}")
        if time.monotonic() - t0 < a.commit_seconds:  # a SIGTERM may come before the end
            now = time.monotonic()
            commits = len({e[3] for e in observer.between(t0, now)
                           if e[1] == keys.replication(JOB).committed})
            progress.update(so_far(s0, stats, e0, etcd.cpu(), now - t0, len(alive),
                                   commits, last[0] if last else None))
    s1, m1, e1, ev1, db1 = cluster.stats(), etcd.requests(), etcd.cpu(), _events(etcd), _db(etcd)
    mvcc["end"] = _mvcc(etcd)
    wall_end = time.time()
    t1 = time.monotonic()
    c1 = cluster.ask(("commit_stats",))
    cluster.ask(("commit_sample", False))
    secs = t1 - t0
    evs = observer.between(t0, t1)
    before: dict[str, int] = {}  # the warm-up's writes: the election, the round's placement
    for e in observer.between(0.0, t0):
        name = e[1].decode().rsplit("/ckpt/", 1)[-1]
        before[name] = max(before.get(name, 0), e[2])
    observer.close()
    cluster.ask(("commit_stop",))
    committed_key, fence = keys.replication(JOB).committed, keys.replication(JOB).fences
    commits = [e for e in evs if e[1] == committed_key]
    steps = [e[4][1] for e in commits if e[4] is not None]
    fence_revs = {e[3] for e in evs if e[1].startswith(fence)}
    step_revs = {e[3] for e in evs} - fence_revs
    sizes = [e[2] for e in evs if e[3] in step_revs]
    lags: collections.Counter[int] = collections.Counter()
    for part in c1:
        lags.update({int(k): v for k, v in part["lags"].items()})
    for part in c0:
        lags.subtract({int(k): v for k, v in part["lags"].items()})
    lag_list = sorted(lags.elements())
    rereads: collections.Counter[int] = collections.Counter()
    for part in c1:
        rereads.update({int(k): v for k, v in part["rereads"].items()
                        if wall_start - 10 < int(k) < wall_end})
    requests = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1 if m1.get(k, 0) - m0.get(k, 0)}
    per_step_requests = sum(v for k, v in requests.items() if k != "LeaseKeepAlive")
    snapshot_steps = secs / a.period
    ncommits = len({e[3] for e in commits})
    leading = [x for part in c1 for x in part["leading"]]
    relayed = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    for p1, p0 in zip(c1, c0):
        relayed.update({k: v - p0["relayed"].get(k, 0) for k, v in p1["relayed"].items()})
        # threads that ended in the window are missing from the second count: by group,
        # the difference is what the live threads of each group spent in the window
        threads.update({k: v - p0["thread_cpu"].get(k, 0.0)
                        for k, v in p1["thread_cpu"].items()})
    return {
        "nodes": len(alive), "ranks_per_node": a.ranks_per_node, "m": a.replicas,
        "snapshot_period_s": a.period, "window_s": round(secs, 1),
        "warmup_s": a.commit_warmup, "build_seconds": round(built, 2),
        "committed_steps": ncommits,
        "committed_step_first_last": [steps[0], steps[-1]] if steps else None,
        "snapshot_steps_in_window": round(snapshot_steps, 1),
        "writes_per_step": round(len(step_revs) / ncommits, 3) if ncommits else None,
        "keys_written_per_step": round(sum(1 for e in evs if e[3] in step_revs) / ncommits, 3)
        if ncommits else None,
        "write_bytes_max": max(sizes, default=0),
        "write_bytes_median": statistics.median(sizes) if sizes else 0,
        "fence_writes": len(fence_revs),
        "warmup_write_bytes_max_by_key": before,
        "withdrawals": sum(p["withdrawals"] for p in c1) - sum(p["withdrawals"] for p in c0),
        "requests_per_node_per_step": round(per_step_requests / len(alive) / snapshot_steps, 4),
        "requests_by_method": requests,
        "watch_events_per_node_per_step": round((ev1 - ev0) / len(alive) / snapshot_steps, 3),
        "watchers_per_node": 2 - sum(p["gates_lazy"] for p in c1) / len(alive),
        "lag_steps_median": statistics.median(lag_list) if lag_list else None,
        "lag_steps_p90": lag_list[int(0.9 * (len(lag_list) - 1))] if lag_list else None,
        "lag_steps_max": lag_list[-1] if lag_list else None,
        "lag_samples": len(lag_list),
        "etcd_cpu_pct": round((e1 - e0) / secs * 100, 1),
        "etcd_cpu_pct_without_commits": round(base_cpu, 1),
        "simulator_cpu_pct": round((s1["cpu"] - s0["cpu"]) / secs * 100, 1),
        # of which the keep-alive processes' (--keepalive-process 1; 0 otherwise: then the
        # keep-alives are in simulator_thread_cpu_pct's run_forever thread)
        "keepalive_process_cpu_pct": round((s1.get("keepalive_cpu", 0.0)
                                            - s0.get("keepalive_cpu", 0.0)) / secs * 100, 1),
        "keepalive_process": getattr(a, "keepalive_process", 0),
        "keepalive_client": getattr(a, "keepalive_client", "aio"),
        "keepalive_by_node": getattr(a, "keepalive_by_node", 0),
        "keepalive_read": getattr(a, "keepalive_read", "task"),
        "tick_batch": getattr(a, "tick_batch", 0),
        "commit_ticker_cpu_pct": round((sum(p["tick_cpu"] for p in c1)
                                        - sum(p["tick_cpu"] for p in c0)) / secs * 100, 1),
        "db_bytes": {"after_warmup": db0, "after_first_minute": db_minute, "end": db1},
        "db_growth_after_first_minute_pct": round((db1 - db_minute) / db_minute * 100, 2)
        if db_minute else None,
        "leases_lost": s1["leases_lost"] - s0["leases_lost"],
        "re_grants": s1.get("re_grants", 0) - s0.get("re_grants", 0),
        "keepalive_handed_back": {k: v - s0.get("handed_back", {}).get(k, 0)
                                  for k, v in sorted(s1.get("handed_back", {}).items())},
        "leases_lost_without_commits": base_lost,
        "progress_by_10s": {"what": "[s into the window, newest committed step seen by the "
                                    "observer, leases lost since the window's start]",
                            "points": timeline},
        "rereads": sum(rereads.values()),
        "watch_lagging_rereads": (sum(p["watch_lagging_rereads"] for p in c1)
                                  - sum(p["watch_lagging_rereads"] for p in c0)),
        "rereads_by_10s": {"what": "[s into the window of the 10-s slice's start (wall clock, "
                                   "so the first may start before it), reads of the committed "
                                   "prefix by every node, every cause]",
                           "points": [[round(k - wall_start), v]
                                      for k, v in sorted(rereads.items())]},
        "etcd_mvcc": mvcc,
        "etcd_mvcc_by_10s": {"what": "[s into the window, revision, compacted revision, "
                                     "database bytes, bytes in use] (one member)",
                             "points": history},
        "reports_relayed": dict(relayed),
        "simulation_behind_steps_max": max(p["behind_max"] for p in c1),
        "snapshot_grid_max": max(p["grid_max"] for p in c1),
        "coordinator_report_cpu_pct": round((sum(p["taking_cpu"] for p in c1)
                                             - sum(p["taking_cpu"] for p in c0)) / secs * 100, 2),
        "coordinator": leading[0] if len(leading) == 1 else leading,
        "simulator_cpu_ms_per_node_second": round((s1["cpu"] - s0["cpu"]) / secs / len(alive)
                                                  * 1000, 3),
        "simulator_thread_cpu_pct": {k: round(v / secs * 100, 1) for k, v in sorted(
            threads.items(), key=lambda kv: -kv[1]) if v / secs >= 0.002},
        "note": "reports between simulated nodes go in-process or over a local socket "
                "(bench/scale_commit.py Relay), not over the authenticated replication "
                "channel; etcd sees exactly what a daemon's commit code does",
    }
