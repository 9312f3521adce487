"""Scale study by simulation: etcd load, rendezvous time and failure detection against node count.

No training runs. For each node count N (``--sizes``), against one real etcd started here:

1. **Node sessions**, as the daemons hold them: N leases (``--ttl``), each kept alive every
   TTL/3 (the :class:`~elasticd.coordination.lease.LeaseKeeper` cadence) and carrying a node
   record under ``<prefix>/nodes/`` rewritten every TTL (the daemon's heartbeat), all
   multiplexed over ``--clients`` etcd connections. One watcher follows the nodes prefix, as
   every daemon does.
2. **Rendezvous**: N simulated torch agents join one round (``min = max = N``) through torch's
   own dynamic-rendezvous state machine (``_BackendRendezvousStateHolder`` and
   ``_DistributedRendezvousOpExecutor`` with ``_RendezvousJoinOp``, the code torchrun runs) on
   the real etcd-v3 backend (:class:`EtcdV3RendezvousBackend`: one key, compare-and-set on its
   mod_revision). Measured: time until every agent is in the complete round, state reads and
   writes, compare-and-set conflicts, and the size of the state blob.
3. **Steady state** for ``--window`` seconds: the sessions go on, and every agent does what a
   torch agent does while its workers train: a keep-alive heartbeat every
   ``--keep-alive-interval`` (which rewrites the whole state) and a state read at most once a
   second (``num_nodes_waiting`` each monitor interval, behind torch's 1 s cache). Measured from
   etcd's own /metrics: requests/s by method, database size and growth, plus heartbeat latency
   and conflicts from the agents. Meanwhile ``--victims`` sessions stop their keep-alives (a
   node dying) at random moments: the failure-detection latency is the time from that moment to
   the watcher seeing the node record deleted (baseline: the lease TTL).

elasticd's own handler (``etcd-v3``) is measured by ``bench/scale_native.py``, which runs it
unchanged; this file keeps torch's dynamic rendezvous as the baseline.

Figures go to ``--out`` (bench/results/scale.json); docs/scale.md discusses them. The simulator
is one Python process on this machine's cores: where it cannot issue the intended rates (it
reports intended and achieved), the etcd figures are lower bounds. Run under the CPU lock::

    flock /tmp/elasticd-cpu.lock python bench/scale_sim.py --sizes 10,50,100,250,500
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import random
import re
import signal
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

import psutil
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousJoinOp,
    _RendezvousKeepAliveOp,
)

from elasticd.coordination.api import EventType, LeaseLost
from elasticd.coordination.embedded import EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from torch_etcd_backend import EtcdV3RendezvousBackend  # noqa: E402 — bench/, beside this file

METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


# -- etcd's own counters -----------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, str], float]:
    """etcd's Prometheus /metrics as {(name, labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = METRIC_RE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def requests_by_method(m: dict[tuple[str, str], float]) -> dict[str, float]:
    """gRPC messages etcd received, by method (a keep-alive stream counts each message)."""
    out: dict[str, float] = {}
    for (name, labels), v in m.items():
        if name == "grpc_server_msg_received_total":
            method = re.search(r'grpc_method="([^"]+)"', labels).group(1)
            out[method] = out.get(method, 0.0) + v
    return out


def db(m: dict[tuple[str, str], float]) -> dict[str, float]:
    def get(name: str) -> float:
        return m.get((name, ""), float("nan"))

    return {"db_bytes": get("etcd_mvcc_db_total_size_in_bytes"),
            "db_in_use_bytes": get("etcd_mvcc_db_total_size_in_use_in_bytes"),
            "keys": get("etcd_debugging_mvcc_keys_total"),
            "revision": get("etcd_debugging_mvcc_current_revision")}


class Window:
    """etcd counters between two scrapes."""

    def __init__(self, url: str, pids: tuple[int, ...]) -> None:
        """``pids``: etcd's, then the simulator's processes."""
        self.url = url
        self.procs = [psutil.Process(p) for p in pids]
        self.c0 = [self._cpu(p) for p in self.procs]
        self.t0, self.m0 = time.monotonic(), scrape(url)

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    def close(self) -> dict[str, Any]:
        m1, t1 = scrape(self.url), time.monotonic()
        seconds = t1 - self.t0
        r0, r1 = requests_by_method(self.m0), requests_by_method(m1)
        by = {k: round((r1.get(k, 0) - r0.get(k, 0)) / seconds, 1) for k in r1}
        by = {k: v for k, v in by.items() if v}
        d0, d1 = db(self.m0), db(m1)
        cpu = [(self._cpu(p) - c) / seconds * 100 for p, c in zip(self.procs, self.c0)]
        return {"seconds": round(seconds, 2),
                "etcd_cpu_percent_of_core": round(cpu[0], 1),
                "agents_cpu_percent_of_core": round(cpu[1], 1),
                "sessions_cpu_percent_of_core": round(sum(cpu[2:]), 1),
                "requests_per_second": round(sum(by.values()), 1),
                "requests_per_second_by_method": by,
                "db_bytes_end": d1["db_bytes"], "db_in_use_bytes_end": d1["db_in_use_bytes"],
                "db_growth_bytes_per_second": round((d1["db_bytes"] - d0["db_bytes"]) / seconds),
                "revisions_per_second": round((d1["revision"] - d0["revision"]) / seconds, 1)}


# -- node sessions -----------------------------------------------------------------------------


class Sessions:
    """N node sessions (lease + node record) over a few clients, at the daemon's cadence."""

    def __init__(self, coords: list[EtcdCoordinator], keys: Keyspace, n: int, ttl: int,
                 record_bytes: int) -> None:
        self.coords, self.keys, self.ttl = coords, keys, ttl
        self.names = [f"node-{i:05d}" for i in range(n)]
        pad = "x" * max(0, record_bytes - 200)
        self.records = {name: json.dumps({"kind": "node", "v": 1, "node": name, "host":
                                          f"{name}.cluster.example", "pid": 4242, "incarnation":
                                          "a1b2c3d4", "api": "127.0.0.1:7777", "replication":
                                          "10.0.0.1:7788", "pad": pad}).encode()
                        for name in self.names}
        self.leases: dict[str, int] = {}
        self.stopped: dict[str, float] = {}  # name -> monotonic time its keep-alives stopped
        self.last_refresh: dict[str, float] = {}
        self.errors = 0
        self.leases_lost = 0  # expired while the "node" was alive: a false failure detection
        self.first_error: str | None = None
        self.refreshes = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> float:
        t0 = time.monotonic()
        for i, name in enumerate(self.names):
            c = self.coords[i % len(self.coords)]
            lease = c.grant_lease(self.ttl)
            if not c.create(self.keys.node(name), self.records[name], lease):
                raise RuntimeError(f"node record {name} exists already: stale prefix?")
            self.leases[name] = lease
            self.last_refresh[name] = time.monotonic()
        took = time.monotonic() - t0
        for k in range(len(self.coords)):
            t = threading.Thread(target=self._keeper, args=(k,), daemon=True)
            t.start()
            self._threads.append(t)
        return took

    def _keeper(self, k: int) -> None:
        """Client ``k`` keeps its share of the leases alive (every TTL/3, spread evenly over the
        interval) and rewrites each record every TTL."""
        coord = self.coords[k]
        mine = self.names[k :: len(self.coords)]
        interval = self.ttl / 3
        tick = 0
        while not self._stop.is_set():
            start = time.monotonic()
            rewrite = tick % 3 == 0
            for j, name in enumerate(mine):
                if self._stop.is_set():
                    return
                due = start + interval * j / len(mine)
                delay = due - time.monotonic()
                if delay > 0:
                    self._stop.wait(delay)
                with self._lock:
                    if name in self.stopped:
                        continue
                try:
                    coord.keep_alive(self.leases[name])
                    self.last_refresh[name] = time.monotonic()
                    if rewrite:
                        coord.put(self.keys.node(name), self.records[name], self.leases[name])
                    self.refreshes += 1
                except LeaseLost:  # as the LeaseKeeper does: a new lease, the record again
                    self.leases_lost += 1
                    try:
                        self.leases[name] = coord.grant_lease(self.ttl)
                        coord.put(self.keys.node(name), self.records[name], self.leases[name])
                    except Exception:  # noqa: BLE001 — retried next round
                        self.errors += 1
                except Exception as exc:  # noqa: BLE001 — counted; the simulation goes on
                    self.errors += 1
                    self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"
            tick += 1
            self._stop.wait(max(0.0, start + interval - time.monotonic()))

    def kill(self, name: str) -> tuple[float, float]:
        """Stops ``name``'s keep-alives (the node died now); returns (now, its last refresh)."""
        with self._lock:
            now = time.monotonic()
            self.stopped[name] = now
        return now, self.last_refresh[name]

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        for i, (name, lease) in enumerate(self.leases.items()):
            try:
                self.coords[i % len(self.coords)].revoke_lease(lease)
            except Exception:  # noqa: BLE001 — expired already
                pass


# -- simulated torch agents --------------------------------------------------------------------


class CountingBackend(EtcdV3RendezvousBackend):
    """The real backend, counting what torch asks of it."""

    def __init__(self, stats: dict[str, float], lock: threading.Lock, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.stats, self.lock = stats, lock

    def get_state(self):  # noqa: ANN201 — see base class
        out = super().get_state()
        with self.lock:
            self.stats["reads"] += 1
            self.stats["read_bytes"] += len(out[0]) if out else 0
        return out

    def set_state(self, state, token=None):  # noqa: ANN001, ANN201 — see base class
        out = super().set_state(state, token)
        with self.lock:
            self.stats["writes"] += 1
            self.stats["write_bytes"] += len(state)
            self.stats["max_state_bytes"] = max(self.stats["max_state_bytes"], len(state))
            if out is not None and not out[2]:
                self.stats["conflicts"] += 1
        return out


class Agent:
    """One simulated torch agent: torch's rendezvous code with its own state holder."""

    def __init__(self, i: int, backend: CountingBackend, settings: RendezvousSettings) -> None:
        self.node = _NodeDesc(f"node-{i:05d}.cluster.example", 100000 + i, 0)
        self.settings = settings
        self.holder = _BackendRendezvousStateHolder(backend, settings)
        self.executor = _DistributedRendezvousOpExecutor(self.node, self.holder, settings)
        self.joined_at: float | None = None
        self.error: str | None = None

    def join(self, start: float, deadline: float) -> None:
        try:
            time.sleep(random.uniform(0, 0.3))  # torch's first-round skew (next_rendezvous)
            self.executor.run(_RendezvousJoinOp(), deadline)
            self.joined_at = time.monotonic() - start
        except Exception as exc:  # noqa: BLE001 — reported per run
            self.error = f"{type(exc).__name__}: {exc}"

    def steady(self, until: float, interval: float, latencies: list[float]) -> None:
        """Heartbeats every ``interval`` (random phase) and a read every second, as the agent
        does while its workers run, until ``until``."""
        next_hb = time.monotonic() + random.uniform(0, interval)
        next_read = time.monotonic() + random.uniform(0, 1)
        while True:
            now = time.monotonic()
            if now >= until:
                return
            if now >= next_hb:
                t0 = time.monotonic()
                try:
                    self.executor.run(_RendezvousKeepAliveOp(), time.monotonic() + 30)
                    latencies.append(time.monotonic() - t0)
                except Exception as exc:  # noqa: BLE001
                    self.error = f"{type(exc).__name__}: {exc}"
                next_hb += interval
            if now >= next_read:
                try:
                    self.holder.sync()  # torch's num_nodes_waiting(); its cache limits it to 1/s
                except Exception as exc:  # noqa: BLE001
                    self.error = f"{type(exc).__name__}: {exc}"
                next_read += 1.0
            time.sleep(max(0.0, min(next_hb, next_read, until) - time.monotonic()))


# -- one node count ----------------------------------------------------------------------------


def sessions_process(conn: Any, endpoints: str, prefix: str, n: int, ttl: int,
                     record_bytes: int, clients: int) -> None:
    """The N node sessions and the watcher, in a process of their own, so that the simulated
    agents' CPU use cannot starve the keep-alives (real daemons and agents are separate
    processes on separate machines). Commands arrive on ``conn``."""
    settings = EtcdSettings(parse_endpoints(endpoints), timeout=10.0)
    coords = [EtcdCoordinator(settings) for _ in range(clients)]
    keys = Keyspace(prefix)
    deleted: dict[str, list[float]] = {}

    def on_event(events: Any) -> None:
        if isinstance(events, Exception):
            return
        now = time.monotonic()
        for ev in events:
            if ev.type == EventType.DELETE:
                deleted.setdefault(keys.node_of(ev.kv.key), []).append(now)

    watch = coords[0].watch_prefix(keys.nodes, on_event, coords[0].revision() + 1)
    sessions = Sessions(coords, keys, n, ttl, record_bytes)
    conn.send(sessions.start())
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "lost":
                conn.send(sessions.leases_lost)
            elif cmd == "kill":  # arg: (victims, seconds to spread the kills over)
                count, spread = arg
                victims = random.sample(sessions.names, min(count, n))
                kills = {}
                for v in victims:
                    time.sleep(random.uniform(0.2, max(0.3, spread / len(victims))))
                    kills[v] = sessions.kill(v)

                def seen(v: str) -> float | None:  # the first delete after the kill
                    return next((t for t in deleted.get(v, []) if t >= kills[v][0]), None)

                deadline = time.monotonic() + ttl + 10
                while any(seen(v) is None for v in victims) and time.monotonic() < deadline:
                    time.sleep(0.05)
                found = [v for v in victims if seen(v) is not None]
                from_kill = [seen(v) - kills[v][0] for v in found]
                from_refresh = [seen(v) - kills[v][1] for v in found]
                conn.send({
                    "victims": len(victims), "detected": len(found), "lease_ttl_seconds": ttl,
                    "median_seconds_from_kill": _med(from_kill),
                    "max_seconds_from_kill": round(max(from_kill), 3) if from_kill else None,
                    "median_seconds_from_last_keepalive": _med(from_refresh),
                    "max_seconds_from_last_keepalive": round(max(from_refresh), 3)
                    if from_refresh else None})
            elif cmd == "stop":
                break
    finally:
        sessions.stop()
        watch.cancel()
        try:
            coords[0].delete_prefix(keys.prefix.encode() + b"/")
        except Exception:  # noqa: BLE001
            pass
        for c in coords:
            c.close()
        conn.send({"leases_lost": sessions.leases_lost, "errors": sessions.errors,
                   "first_error": sessions.first_error})


def run_size(n: int, etcd: EmbeddedEtcd, a: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    url = f"http://{etcd.members[0].endpoint.split('://')[-1]}/metrics"
    settings = EtcdSettings(parse_endpoints(etcd.endpoints), timeout=10.0)
    coords = [EtcdCoordinator(settings) for _ in range(a.clients)]
    keys = Keyspace(f"/scale{n}")
    result: dict[str, Any] = {"nodes": n}
    conn, child = mp.Pipe()
    proc = mp.get_context("fork").Process(
        target=sessions_process, args=(child, etcd.endpoints, keys.prefix, n, a.ttl,
                                       a.record_bytes, a.clients), daemon=True)
    pids = (etcd.members[0].proc.pid, os.getpid())
    agents: list[Agent] = []
    try:
        # 1. sessions alone
        w = Window(url, pids)
        proc.start()
        pids = (*pids, proc.pid)
        result["sessions_start_seconds"] = round(conn.recv(), 3)
        result["sessions_start"] = w.close()
        time.sleep(min(2.0, a.ttl))  # keep-alive threads in their rhythm
        w = Window(url, pids)
        time.sleep(a.idle_window)
        result["sessions_only"] = w.close()
        result["sessions_only"]["intended_requests_per_second"] = round(n * (3 + 1) / a.ttl, 1)

        # 2. rendezvous of N torch agents
        stats = {k: 0 for k in ("reads", "read_bytes", "writes", "write_bytes", "conflicts",
                                "max_state_bytes")}
        lock = threading.Lock()
        rs = RendezvousSettings(
            run_id=f"scale{n}", min_nodes=n, max_nodes=n,
            timeout=RendezvousTimeout(join=datetime.timedelta(seconds=a.join_timeout),
                                      last_call=datetime.timedelta(seconds=1)),
            keep_alive_interval=datetime.timedelta(seconds=a.keep_alive_interval),
            keep_alive_max_attempt=3)
        for i in range(n):
            backend = CountingBackend(stats, lock, coords[i % len(coords)], f"scale{n}", keys)
            agents.append(Agent(i, backend, rs))
        lost_before_rdzv = _ask(conn, "lost")
        w = Window(url, pids)
        start = time.monotonic()
        threads = [threading.Thread(target=ag.join, args=(start, start + a.join_timeout),
                                    daemon=True) for ag in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join(a.join_timeout + 30)
        rdzv_seconds = time.monotonic() - start
        joined = [ag.joined_at for ag in agents if ag.joined_at is not None]
        lost_in_rdzv = _ask(conn, "lost")
        errors = sorted({ag.error for ag in agents if ag.error})
        state_key = keys.rendezvous(f"scale{n}").prefix + b"state"
        kv = coords[0].get(state_key)
        result["rendezvous"] = {
            "seconds_all_joined": round(max(joined), 3) if len(joined) == n else None,
            "seconds_median_agent": round(statistics.median(joined), 3) if joined else None,
            "wall_seconds": round(rdzv_seconds, 3), "joined": len(joined), "errors": errors[:3],
            "state_reads": stats["reads"], "state_writes": stats["writes"],
            "cas_conflicts": stats["conflicts"],
            "successful_writes_per_second": round(
                (stats["writes"] - stats["conflicts"]) / rdzv_seconds, 1),
            "conflicts_per_successful_write": round(
                stats["conflicts"] / max(1, stats["writes"] - stats["conflicts"]), 2),
            "bytes_written": stats["write_bytes"], "bytes_read": stats["read_bytes"],
            "state_bytes_stored": len(kv.value) if kv else None,
            "state_bytes_per_node": round(len(kv.value) / n, 1) if kv else None,
            "max_participants_seen": max(len(ag.holder.state.participants) for ag in agents),
            "session_leases_lost_meanwhile": lost_in_rdzv - lost_before_rdzv,
            "etcd": w.close()}
        # One uncontended write of the complete round's state, on a key of its own.
        result["write_cost"] = _write_cost(coords[0], keys, f"scale{n}-cost",
                                           _complete_round(agents))
        if len(joined) < n:
            # The simulator could not finish the join storm in time: write the complete round
            # the agents would have reached, so that the steady state is still measured at N.
            _seed_complete_round(agents, coords[0], keys, f"scale{n}")
            result["rendezvous"]["steady_state_seeded"] = True

        # 3. steady state: heartbeats, reads, sessions; victims die meanwhile
        for k in stats:
            stats[k] = 0
        latencies: list[float] = []
        lost_before_steady = _ask(conn, "lost")
        w = Window(url, pids)
        until = time.monotonic() + a.window
        threads = [threading.Thread(target=ag.steady, args=(until, a.keep_alive_interval,
                                                           latencies), daemon=True)
                   for ag in agents]
        for t in threads:
            t.start()
        conn.send(("kill", (a.victims, a.window - a.ttl - 2)))
        for t in threads:
            t.join(a.window + 60)
        steady = w.close()
        # 4. detection: the sessions process reports once the victims' records are gone
        result["detection"] = conn.recv()
        lost_after_steady = _ask(conn, "lost")
        kv = coords[0].get(state_key)
        state = kv.value if kv else b""
        st = _decode(state)
        now = datetime.datetime.now(datetime.timezone.utc)
        ages = [(now - t).total_seconds() for t in st.last_heartbeats.values()] if st else []
        intended = n / a.keep_alive_interval
        steady.update({
            "heartbeats_intended_per_second": round(intended, 1),
            "heartbeats_per_second": round(len(latencies) / steady["seconds"], 1),
            "state_reads_per_second": round(stats["reads"] / steady["seconds"], 1),
            "state_writes_per_second": round(stats["writes"] / steady["seconds"], 1),
            "cas_conflicts_per_second": round(stats["conflicts"] / steady["seconds"], 1),
            "state_bytes_written_per_second": round(stats["write_bytes"] / steady["seconds"]),
            "state_bytes_read_per_second": round(stats["read_bytes"] / steady["seconds"]),
            "heartbeat_latency_p50_seconds": _pct(latencies, 50),
            "heartbeat_latency_p99_seconds": _pct(latencies, 99),
            "oldest_heartbeat_age_seconds_at_end": round(max(ages), 2) if ages else None,
            "participants_at_end": len(st.participants) if st else 0,
            "state_bytes": len(state),
            "state_bytes_per_node": round(len(state) / n, 1),
            "session_leases_lost_meanwhile": lost_after_steady - lost_before_steady,
            "agent_errors": sorted({ag.error for ag in agents if ag.error})[:3],
        })
        result["steady"] = steady
        return result
    finally:
        if proc.pid is not None:
            conn.send(("stop", None))
            if conn.poll(60):
                result["sessions"] = conn.recv()
            proc.join(30)
        for c in coords:
            c.close()


def _write_cost(coord: EtcdCoordinator, keys: Keyspace, run_id: str, st: Any,
                repeat: int = 20) -> dict[str, Any]:
    """What one uncontended state write costs at this N: torch's pickle.dumps plus the
    compare-and-set, and the pickle.loads every reader pays. With agents on separate machines,
    one successful write per (pickle + CAS + unpickle) is the most the round can make, since
    each success invalidates every other writer's token."""
    backend = EtcdV3RendezvousBackend(coord, run_id, keys)
    dumps, loads, cas = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        blob = pickle.dumps(st)
        t1 = time.perf_counter()
        pickle.loads(blob)
        t2 = time.perf_counter()
        current = backend.get_state()
        token = current[1] if current else None
        t3 = time.perf_counter()
        backend.set_state(blob, token)
        t4 = time.perf_counter()
        dumps.append(t1 - t0)
        loads.append(t2 - t1)
        cas.append(t4 - t3)
    per_write = statistics.median(dumps) + statistics.median(loads) + statistics.median(cas)
    return {"state_bytes": len(blob), "pickle_dumps_ms": round(statistics.median(dumps) * 1e3, 3),
            "pickle_loads_ms": round(statistics.median(loads) * 1e3, 3),
            "cas_write_ms": round(statistics.median(cas) * 1e3, 3),
            "max_successful_writes_per_second": round(1 / per_write, 1)}


def _ask(conn: Any, cmd: str) -> Any:
    """Asks the sessions process a question and returns its answer."""
    conn.send((cmd, None))
    return conn.recv()


def _complete_round(agents: list[Agent]) -> Any:
    """torch's state of a complete round 1 with every agent a participant, heartbeats now."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    st = _RendezvousState()
    st.round, st.complete = 1, True
    now = datetime.datetime.now(datetime.timezone.utc)
    st.participants = {ag.node: i for i, ag in enumerate(agents)}
    # Distinct timestamps, as real heartbeats are (pickle would store one shared object once).
    st.last_heartbeats = {ag.node: now - datetime.timedelta(microseconds=i)
                          for i, ag in enumerate(agents)}
    return st


def _seed_complete_round(agents: list[Agent], coord: EtcdCoordinator, keys: Keyspace,
                         run_id: str) -> None:
    """Stores round 1, complete, with every agent a participant and a fresh heartbeat."""
    st = _complete_round(agents)
    backend = EtcdV3RendezvousBackend(coord, run_id, keys)
    token = None
    for _ in range(100):
        current = backend.get_state()
        token = current[1] if current else None
        out = backend.set_state(pickle.dumps(st), token)
        if out is not None and out[2]:
            break
    for ag in agents:
        ag.holder._last_sync_time = -1  # noqa: SLF001 — re-read at once, past torch's cache
        ag.holder.sync()


def _decode(state_with_envelope: bytes) -> Any:
    """torch's rendezvous state from the stored envelope (our own etcd and our own writes: the
    pickle is trusted here)."""
    from torch_etcd_backend import decode_state

    if not state_with_envelope:
        return None
    return pickle.loads(decode_state(state_with_envelope))


def _pct(xs: list[float], p: int) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(len(s) * p / 100))], 4)


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--sizes", default="10,50,100,250,500", help="node counts, comma-separated")
    p.add_argument("--clients", type=int, default=8, help="etcd connections shared by the nodes")
    p.add_argument("--ttl", type=int, default=5, help="lease TTL (elasticd's default: 5 s)")
    p.add_argument("--keep-alive-interval", type=int, default=5,
                   help="torch's rendezvous heartbeat interval (its default: 5 s)")
    p.add_argument("--record-bytes", type=int, default=400, help="size of a node record")
    p.add_argument("--idle-window", type=float, default=6.0,
                   help="seconds measured with sessions only")
    p.add_argument("--window", type=float, default=12.0,
                   help="seconds of steady state (heartbeats, reads, failures)")
    p.add_argument("--victims", type=int, default=3, help="sessions killed per node count")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="seconds the simulated agents get to complete the rendezvous; past it "
                        "the complete round is written directly and the steady state measured")
    p.add_argument("--out", default="bench/results/scale.json", help="results file")
    a = p.parse_args()
    try:
        sizes = [int(x) for x in a.sizes.split(",") if x]
    except ValueError:
        p.error(f"--sizes takes node counts separated by commas, e.g. 10,50; got {a.sizes!r}")
    if not sizes or min(sizes) < 2 or a.clients < 1 or a.ttl < 1:
        p.error("need node counts >= 2, --clients >= 1 and --ttl >= 1")
    if a.window < a.ttl + 3:
        p.error("--window must exceed --ttl + 3 s so that killed sessions expire inside it")

    random.seed(0)
    # A SIGTERM (timeout(1), a CI limit) unwinds through the finally blocks: etcd and the
    # agent processes are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    etcd = EmbeddedEtcd(1).start()
    runs: list[dict[str, Any]] = []
    started = time.monotonic()

    def write(unfinished: str = "") -> None:
        # After every size, so that a size that never finishes (the simulator saturating its
        # cores, then a timeout) does not take the figures of the smaller ones with it.
        result = {
            "benchmark": "scale_sim",
            "command": "python bench/scale_sim.py " + " ".join(sys.argv[1:]),
            "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "etcd": ("single member on loopback, started as elasticd embeds it (EmbeddedEtcd: "
                     "revision auto-compaction keeping 10000 revisions, 2 GiB quota, no "
                     "defrag)"),
            "parameters": {k: v for k, v in vars(a).items() if k != "out"},
            "seconds": round(time.monotonic() - started, 1),
            "runs": runs,
        }
        if unfinished:
            result["unfinished"] = unfinished
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")

    n = 0
    try:
        for n in sizes:
            t0 = time.monotonic()
            r = run_size(n, etcd, a)
            r["simulation_seconds"] = round(time.monotonic() - t0, 1)
            runs.append(r)
            rd, st = r["rendezvous"], r.get("steady", {})
            print(f"N={n:5d}: rendezvous {rd['seconds_all_joined']} s "
                  f"({rd['state_writes']} writes, {rd['cas_conflicts']} conflicts, state "
                  f"{st.get('state_bytes')} B); steady {st.get('requests_per_second')} req/s, "
                  f"db +{st.get('db_growth_bytes_per_second')} B/s; detection "
                  f"{r.get('detection', {}).get('median_seconds_from_kill')} s "
                  f"[{r['simulation_seconds']} s]", flush=True)
            write()
    except BaseException as exc:
        write(f"N={n}: {exc!r} after {time.monotonic() - started:.0f} s")
        raise
    finally:
        etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
