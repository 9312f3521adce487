"""Scale simulator that runs elasticd's own code: N simulated nodes against one real etcd.

No training runs and no decision logic lives here. Each simulated node holds what a real node
holds in etcd, through elasticd's own classes and the :class:`Coordinator` interface:

* **its daemon**: a lease kept alive by :class:`~elasticd.coordination.lease.LeaseKeeper`, a
  ~400-byte node record ``<prefix>/nodes/<node>`` bound to it, its listing of ``nodes/`` and
  its own watch on it from the revision after (no ``prev_kv``, as the daemon's), whose events
  it counts (:class:`NodeWatchPool`: on a few streams, not decoded);
* **its torchrun agent**: :class:`~elasticd.rendezvous.handler.EtcdNativeRendezvousHandler`,
  unchanged (its own lease, its join record, its control-key watch, and when elected, the
  closer's node watch, election key and writes).

Nodes are spread over ``--procs`` processes. A process's leases are refreshed every TTL/3 on one
asyncio loop rather than by a thread per lease, in a keep-alive process of its own
(:class:`KeeperProcess`, ``--keepalive-process 1``, the default: hundreds of simulated nodes'
threads busy in one interpreter kept a loop sharing their GIL from refreshing in time; a real
node's daemon and agent have a machine each), or on the simulator process's own loop
(:class:`KeeperPool`, ``--keepalive-process 0``); whenever a refresh is not a plain renewal,
elasticd's own :meth:`LeaseKeeper.step` runs in the simulator process (``--keepalive-by-node``, the
default: a node's daemon and agent leases on one stream, refreshed in one frame,
:mod:`refresh_plan`). Within a process the nodes share ``--clients`` etcd
connections (:class:`~elasticd.coordination.etcd.EtcdCoordinator`, one gRPC channel each, which
carries one watch stream and one keep-alive stream): every node still owns its leases, its
requests and its own watch IDs, since etcd pays per watcher, not per stream. Fewer streams
batch more and understate etcd's CPU per event (docs/facts.md): the stream count is printed
and written beside the figures.

Phases per N (``--sizes``): all N join one round (min ``N - 2 * kills - 2``, max N); a steady
window; ``--kills`` times a member other than the closer is killed (kill -9: keep-alives and
watches stop, nothing revoked) and the survivors call ``next_rendezvous`` at once, as their
agents do when the workers' collectives fail; then ``--kills`` times the closer itself. Between
rounds each agent asks ``num_nodes_waiting`` as torchrun's agent does and joins again when it
says a node waits (:mod:`scale_agents`): a round is re-formed once every live agent returned
into the same round (given up after 60 s: ``seconds`` None). Per N:
join seconds, kill -> re-formed seconds, etcd requests (from etcd's own counters, keep-alives
apart) and watch events per agent per round, etcd CPU, leases lost, the closer's own CPU per
round beside the per-agent average. Results: ``--out`` (bench/results/scale_native.json), one
entry per N, written after each N.

Per-node periodic work (the commit engineer's "steady training" phase) goes through
:class:`Ticker`: ``ticker.every(seconds, fn)`` runs ``fn(node)`` for every live node of the
process at that period, on one thread per process, through each node's own Coordinator
(``node.coord``) and keys (``node.keys``, ``node.name``).

Where etcd and the simulator run (:mod:`scale_placement`): ``--etcd-nice`` (etcd's priority),
``--etcd-cpus``/``--sim-cpus`` (a core each), ``--etcd-tmpfs`` (etcd's data in memory); each
entry writes them as ``cpu_placement``, and each round its simulator CPU by thread group.

Run under the CPU lock, one N at a time for the large ones (each < 20 minutes)::

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/scale_native.py --sizes 100,300
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import psutil

from elasticd.coordination.api import CoordinationError
from elasticd.coordination.embedded import COMPACTION, EmbeddedEtcd
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.lease import LeaseKeeper
from refresh_plan import RefreshPlan  # noqa: E402 - bench/, beside this file
from scale_agents import AgentRuns  # noqa: E402 - bench/, beside this file
from scale_placement import (  # noqa: E402 - bench/, beside this file
    compact_timeline, own_thread_cpu, parse_cpus, place, prestart)
from scale_etcd_probe import EtcdProbe  # noqa: E402 - bench/, beside this file
from scale_sim import requests_by_method, scrape  # noqa: E402 - bench/, beside this file

PREFIX = "/sim"


#: The simulated nodes' etcd client timeout (their :class:`EtcdSettings`), seconds: how long
#: elasticd's keeper waits for a refresh's answer before it calls etcd unreachable.
CLIENT_TIMEOUT = 10.0


def keeper_main(endpoint: str, ttl: int, streams: int, client: str = "aio",
                timeout: float = CLIENT_TIMEOUT, by_node: bool = False,
                read_mode: str = "task") -> None:
    """The keep-alive process of one simulator process (``scale_native.py --keeper ...``).

    Refreshes every lease it was given (``add <id>`` on stdin) every TTL/3 on one asyncio loop,
    one LeaseKeepAlive message each on ``streams`` grpc.aio streams (``client`` "aio"), or on
    ``streams`` HTTP/2 streams written by hand, a connection each (``client`` "raw":
    :mod:`h2_keepalive`, ~20x less CPU per refresh); a lease on stream ``lease % streams``;
    ``remove <id>`` stops one.

    etcd renews a stream's leases one after the other, and the renewal of a lease that has
    just expired waits until its revocation is applied (seconds, when etcd is loaded): every
    lease behind it on the stream waits too. A real node's stream carries its own one or two
    leases; a stream carrying hundreds lost them in cascade (2026-11-30, N = 1,000, one
    stream per process: 110 daemon leases at the cold start, thousands in the join). So
    ``--keepalive-streams`` gives a process about one stream per node.

    As elasticd's :class:`LeaseKeeper` does, one refresh per lease is in flight at a time and
    it waits for its answer up to the client's ``timeout``; the next is sent TTL/3 after the
    last was (at once if the answer took longer). A refresh that is not a plain renewal is
    handed back (``step <id> <why>`` on stdout: ``gone``, etcd answered that the lease is
    gone; ``timeout``, no answer within ``timeout``) and refreshed no more until added again:
    elasticd's own ``LeaseKeeper.step`` then finds out what happened and acts. A refresh whose
    stream broke is sent again on the next stream, as the keeper retries (:func:`broken`).
    Until 2026-11-30 a refresh was handed back after one second without an answer: at N = 1,000 a slow etcd (answers in 1-2 s) turned into leases handed to a
    simulator process too busy to refresh them in time, lost, re-granted, their records
    rewritten to every daemon's watch, which slowed etcd further.

    ``by_node`` (``--keepalive-by-node``): a lease added with its node's slot (``add <id>
    <slot>``) goes on its node's stream, its refreshes with the node's other lease's
    (:mod:`refresh_plan`). ``read_mode`` "callback": each raw connection read in the loop's own
    callback (:class:`h2_keepalive._Protocol`), not by a reader task.
    """
    import asyncio
    import collections

    import grpc
    from pyetcd import etcdrpc

    period = ttl / 3.0
    live: dict[int, Any] = {}  # lease -> its LeaseKeepAliveRequest
    waiting: dict[int, float] = {}  # lease -> when its refresh in flight was sent
    sent: Any = collections.deque()  # (sent at, lease) in sending order: the timeouts' queue
    queues: list[Any] = [None] * streams
    loop = asyncio.new_event_loop()
    plan = RefreshPlan(streams, by_node)  # each lease's next refresh and its stream
    schedule, stream = plan.schedule, plan.stream

    # Each lease's last refreshes, (sent or answered, wall time, TTL answered): printed for a
    # lease handed back, to set its refreshes against etcd's and the simulator's CPU then.
    history: dict[int, Any] = collections.defaultdict(lambda: collections.deque(maxlen=8))

    def hand_back(lease: int, why: str) -> None:
        live.pop(lease, None)
        sys.stdout.write(f"step {lease} {why}\n")
        sys.stdout.flush()
        print(f"lease-history {lease} {why} at {time.time():.3f}: " + json.dumps(
            [[k, round(t, 3), x] for k, t, x in history.pop(lease, ())]),
            file=sys.stderr, flush=True)

    def answered(lease: int, ttl_left: int) -> None:
        if lease in live:
            history[lease].append(("a", time.time(), ttl_left))
        at = waiting.pop(lease, None)
        if at is None or lease not in live:
            return
        if ttl_left > 0:  # as LeaseKeeper._run: TTL/3 after the last refresh began
            now = time.monotonic()
            schedule(lease, max(at + period, now + 0.05), now)
        else:
            hand_back(lease, "gone")

    def broken(k: int) -> None:
        """Stream ``k`` ended: its refreshes in flight failed.

        As elasticd's keeper after a failed refresh (no re-grant: etcd may just be slow), each
        is sent again TTL/3 after it began, at once if that has passed, on the stream opened
        next (``retried`` on stdout counts them). etcd ends a whole LeaseKeepAlive stream when
        one renewal fails other than "not found" (e.g. "waiting for the applied index took too
        long"): here a stream carries hundreds of nodes' leases, a real node's only its own, so
        handing them all back to a simulator process busy with its nodes lost them (8,158
        leases in the first N = 1,000 run of 2026-11-30)."""
        now = time.monotonic()
        retried = 0
        for lease in [x for x in waiting if stream(x) == k]:
            at = waiting.pop(lease)
            if lease in live:
                schedule(lease, max(at + period, now + 0.05), now)
                retried += 1
        if retried:
            sys.stdout.write(f"retried {retried} broken\n")
            sys.stdout.flush()

    async def read(call: Any, k: int) -> None:
        try:
            async for resp in call:
                answered(resp.ID, resp.TTL)
        except Exception as exc:  # noqa: BLE001 - any stream failure: open another
            print(f"keep-alive stream {k} failed ({type(exc).__name__}): reopened",
                  file=sys.stderr, flush=True)
        queues[k] = None  # nothing sent until the next is open: it would be lost
        broken(k)
        await asyncio.sleep(0.1)
        open_stream(k)

    def open_stream(k: int) -> None:
        queue: Any = asyncio.Queue()

        async def requests() -> Any:
            while True:
                yield await queue.get()

        call = etcdrpc.LeaseStub(grpc.aio.insecure_channel(endpoint)).LeaseKeepAlive(
            requests())
        queues[k] = queue
        asyncio.ensure_future(read(call, k))

    raw: Any = None  # with client "raw": one RawKeepAlive (a connection) per stream
    if client == "raw":
        from h2_keepalive import RawKeepAlive, request

        def raw_broken(k: int) -> None:
            print(f"keep-alive stream {k} failed: reopened", file=sys.stderr, flush=True)
            broken(k)
            loop.call_later(0.1, lambda: asyncio.ensure_future(reopen(k)))

        async def reopen(k: int) -> None:
            try:
                await raw[k].open()
            except OSError:
                raw_broken(k)

        host, _, port = endpoint.rpartition(":")
        raw = [RawKeepAlive(host, int(port), answered, lambda k=k: raw_broken(k),
                            protocol=read_mode == "callback") for k in range(streams)]

    def command(line: str) -> None:
        what, lease_text, *slot = line.split(" ")
        lease = int(lease_text)
        if what == "add":  # the request message built once, sent every TTL/3
            live[lease] = (request(lease) if raw is not None
                           else etcdrpc.LeaseKeepAliveRequest(ID=lease))
            waiting.pop(lease, None)
            now = time.monotonic()
            plan.add(lease, int(slot[0]) if slot else None, now + period, now)
        else:
            live.pop(lease, None)
            history.pop(lease, None)
            plan.remove(lease)

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.02)
            now, wall = time.monotonic(), time.time()
            due: dict[int, list[bytes]] = {}
            later = []
            for due_at, lease in plan.due(now):
                if lease in live and lease not in waiting:
                    k = stream(lease)
                    if (raw[k].writer if raw is not None else queues[k]) is None:
                        later.append(lease)  # its stream is reopening: a send would be lost
                        continue
                    waiting[lease] = now
                    history[lease].append(("s", wall, round(now - due_at, 3)))  # sent late by
                    sent.append((now, lease))
                    if raw is not None:
                        due.setdefault(k, []).append(live[lease])
                    else:
                        queues[k].put_nowait(live[lease])
            for lease in later:
                plan.retry(lease, now + 0.05)
            for k, messages in due.items():  # every refresh due now on a stream, in one frame
                raw[k].send(b"".join(messages))
            while sent and now - sent[0][0] > timeout:
                at, lease = sent.popleft()
                if waiting.get(lease) == at:  # still this refresh in flight: no answer
                    del waiting[lease]
                    if lease in live:
                        hand_back(lease, "timeout")

    def stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(command, line.strip())
        loop.call_soon_threadsafe(loop.stop)  # the simulator process is gone

    async def start() -> None:
        if raw is not None:
            await asyncio.gather(*(r.open() for r in raw))
        else:
            for k in range(streams):
                open_stream(k)
        asyncio.ensure_future(tick())
        sys.stdout.write("ready\n")  # its imports take seconds on a busy host: a lease
        sys.stdout.flush()            # handed over before this would expire unrefreshed

    import scale_profile
    if scale_profile.directory():  # the loop's CPU function by function, dumped every 5 s
        scale_profile.install()

        def dump_every() -> None:
            scale_profile.dump(os.path.join(scale_profile.directory(),
                                            f"keeper-{os.getpid()}-{int(time.time())}.json"))
            loop.call_later(5.0, dump_every)
        loop.call_later(5.0, dump_every)
    threading.Thread(target=stdin, daemon=True).start()
    loop.run_until_complete(start())
    loop.run_forever()


class KeeperPool:
    """Keeps every lease of a process alive every TTL/3, as each :class:`LeaseKeeper`'s own
    thread does, without a thread per lease.

    A refresh is one LeaseKeepAlive message on one of ``streams`` grpc.aio streams, sent and
    answered on one asyncio loop (~0.13 ms of client CPU, measured here). Whenever the answer is
    not a plain renewal (the lease is gone, no answer within a second, no lease held), the
    keeper's own :meth:`LeaseKeeper.step` runs on a thread: it finds what happened and does what
    elasticd does (re-grant, tell the handler, distrust). elasticd's :class:`EtcdCoordinator`
    refreshes on a synchronous gRPC stream per client, ~0.3 ms of client CPU more per refresh
    for the thread hand-offs: nothing on a real node (3 refreshes a second), 0.9 of a core for
    1,000 simulated nodes. etcd receives the same messages either way.
    """

    def __init__(self, endpoint: str, ttl: int, streams: int, workers: int) -> None:
        import asyncio
        import concurrent.futures
        import heapq

        import grpc
        from pyetcd import etcdrpc

        self._asyncio, self._heapq, self._rpc = asyncio, heapq, etcdrpc
        self._period = ttl / 3.0
        self._heap: list[tuple[float, int, LeaseKeeper]] = []
        self._count = 0
        self._waiting: dict[int, Any] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        self._channel = lambda: grpc.aio.insecure_channel(endpoint)
        self._queues: list[Any] = [None] * streams

        async def start() -> None:
            for k in range(streams):
                self._open(k)
            asyncio.ensure_future(self._tick())

        asyncio.run_coroutine_threadsafe(start(), self.loop).result()

    def _open(self, k: int) -> None:
        """(Re)opens keep-alive stream ``k`` (on the loop): a stream that failed (etcd
        overloaded, restarted) is replaced, as elasticd's client replaces its own; the
        refreshes it carried are stepped after their second without an answer."""
        queue: Any = self._asyncio.Queue()

        async def requests() -> Any:
            while True:
                yield await queue.get()

        call = self._rpc.LeaseStub(self._channel()).LeaseKeepAlive(requests())
        self._queues[k] = queue
        self._asyncio.ensure_future(self._read(call, k))

    def add(self, keeper: LeaseKeeper, slot: int | None = None) -> None:
        """Takes the place of :meth:`LeaseKeeper.start` (any thread); ``slot`` is ignored."""
        self.loop.call_soon_threadsafe(self._schedule, keeper, self._period)

    def _schedule(self, keeper: LeaseKeeper, after: float) -> None:
        self._count += 1
        self._heapq.heappush(self._heap, (time.monotonic() + after, self._count, keeper))

    async def _read(self, call: Any, k: int) -> None:
        try:
            async for resp in call:
                sent = self._waiting.pop(resp.ID, None)
                if sent is not None:
                    if resp.TTL > 0:
                        self._schedule(sent[0], self._period)
                    else:
                        self._step(sent[0])
        except Exception as exc:  # noqa: BLE001 - any stream failure: open another
            print(f"keep-alive stream {k} failed ({type(exc).__name__}): reopened",
                  file=sys.stderr, flush=True)
        await self._asyncio.sleep(0.1)
        self._open(k)

    def _step(self, keeper: LeaseKeeper) -> None:
        """Not a plain renewal: elasticd's own step finds out and acts; the cadence goes on."""
        done = self.loop.run_in_executor(self._pool, keeper.step)
        done.add_done_callback(lambda _f: self._schedule(keeper, self._period))

    async def _tick(self) -> None:
        while True:
            await self._asyncio.sleep(0.02)
            now = time.monotonic()
            while self._heap and self._heap[0][0] <= now:
                _, _, keeper = self._heapq.heappop(self._heap)
                lease = keeper.lease
                if keeper._stop.is_set():
                    continue
                if lease is None or lease in self._waiting:
                    self._step(keeper)
                    continue
                self._waiting[lease] = (keeper, now)
                self._queues[lease % len(self._queues)].put_nowait(
                    self._rpc.LeaseKeepAliveRequest(ID=lease))
            late = [lease for lease, (_, at) in self._waiting.items() if now - at > 1.0]
            for lease in late:  # no answer within a second
                self._step(self._waiting.pop(lease)[0])


    def remove(self, keeper: LeaseKeeper) -> None:
        """Nothing to do: the loop skips a stopped keeper."""

    def cpu(self) -> float:
        """CPU seconds spent elsewhere than this process (none: the loop is a thread here)."""
        return 0.0

    def close(self) -> None:
        """Nothing to do: the loop's thread is a daemon thread."""


class KeeperProcess:
    """Keeps every lease of a simulator process alive every TTL/3, as each
    :class:`LeaseKeeper`'s own thread does, without a thread per lease and out of the GIL.

    The refreshes run in a keep-alive process of their own (:func:`keeper_main`): in the
    simulator process, hundreds of agents' threads busy at once (a join, a cold start) kept an
    asyncio loop off the GIL for longer than the 2 s TTL and leases expired (19 at an N = 1,000
    join, 76 at its cold start), which a real node, whose agent and daemon have a machine each,
    does not see. A refresh is one LeaseKeepAlive message (~0.13 ms of client CPU on a grpc.aio
    stream). Whenever the answer is not a plain renewal (the lease is gone, no answer within a
    second, no lease held), the keeper's own :meth:`LeaseKeeper.step` runs here, on a thread: it
    finds what happened and does what elasticd does (re-grant, tell the handler, distrust);
    then the keeper's lease, perhaps a new one, goes back to the keep-alive process. etcd
    receives the same messages as from elasticd's own keepers.
    """

    def __init__(self, endpoint: str, ttl: int, streams: int, workers: int,
                 client: str = "aio", timeout: float = CLIENT_TIMEOUT, by_node: bool = False,
                 read: str = "task") -> None:
        import concurrent.futures
        import subprocess

        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--keeper", endpoint, str(ttl),
             str(streams), client, str(timeout), "1" if by_node else "0", read],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1)
        self._lock = threading.Lock()
        self._keepers: dict[int, LeaseKeeper] = {}
        self._slots: dict[int, int] = {}  # id(keeper) -> its node's slot (a stream per node)
        #: refreshes handed back to elasticd's step, by why (gone, timeout, broken)
        self.handed_back: dict[str, int] = {"gone": 0, "timeout": 0}
        #: refreshes in flight on a stream that broke, sent again on the next (not handed back)
        self.retried: dict[str, int] = {"broken": 0}
        self._cpu = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        ready = self._proc.stdout.readline()  # type: ignore[union-attr]
        if ready.strip() != "ready":
            raise RuntimeError(f"keep-alive process did not start: {ready!r}")
        threading.Thread(target=self._read, daemon=True).start()

    def add(self, keeper: LeaseKeeper, slot: int | None = None) -> None:
        """Takes the place of :meth:`LeaseKeeper.start` (any thread); ``slot``: the keeper's
        node (its leases share a stream, with ``--keepalive-by-node``)."""
        lease = keeper.lease
        if keeper._stop.is_set():
            return
        if slot is not None:
            self._slots[id(keeper)] = slot
        if lease is None:
            self._pool.submit(self._step, keeper)
            return
        slot = self._slots.get(id(keeper))
        with self._lock:
            self._keepers[lease] = keeper
            self._proc.stdin.write(f"add {lease}\n" if slot is None  # type: ignore[union-attr]
                                   else f"add {lease} {slot}\n")

    def remove(self, keeper: LeaseKeeper) -> None:
        """No more refreshes of the keeper's lease (its node was killed)."""
        lease = keeper.lease
        if lease is not None:
            with self._lock:
                self._keepers.pop(lease, None)
                self._proc.stdin.write(f"remove {lease}\n")  # type: ignore[union-attr]

    def _read(self) -> None:
        for line in self._proc.stdout:  # type: ignore[union-attr]
            what, number, why = (line.split() + ["?"])[:3]
            if what == "retried":  # refreshes of a broken stream sent again, not handed back
                with self._lock:
                    self.retried[why] = self.retried.get(why, 0) + int(number)
                continue
            lease = int(number)
            with self._lock:
                self.handed_back[why] = self.handed_back.get(why, 0) + 1
                keeper = self._keepers.pop(lease, None)
            if keeper is not None:
                self._pool.submit(self._step, keeper)

    def _step(self, keeper: LeaseKeeper) -> None:
        """Not a plain renewal: elasticd's own step finds out and acts; the cadence goes on."""
        if keeper._stop.is_set():  # its node was killed
            return
        keeper.step()
        self.add(keeper)

    def cpu(self) -> float:
        """The keep-alive process's CPU seconds (counted in the simulator's CPU)."""
        try:
            t = psutil.Process(self._proc.pid).cpu_times()
        except psutil.Error:
            return self._cpu
        self._cpu = t.user + t.system
        return self._cpu

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()


class LoopThread:
    """An asyncio loop on a thread of its own (the daemons' node watches run on it)."""

    def __init__(self) -> None:
        import asyncio

        self._asyncio = asyncio
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()


class NodeWatchPool:
    """The daemons' ``nodes/`` watches of a process on a few grpc.aio Watch streams, each node
    with its own watch ID (etcd pays per watcher: its events go to each watch ID).

    A daemon's watch callback decodes each record into its membership mirror, about 20 µs a
    record in Python: at a cold start each daemon sees every later registration (N²/2 events
    in all), ~1,000 records per daemon at N = 1,000, which a real node decodes in 20 ms but a
    process holding 250 simulated daemons in 5 s, starving its lease keep-alives (996 of 2,000
    leases lost at N = 1,000 while every watch went through pyetcd's per-event objects). Here
    an event is only counted, from the raw response; what reaches etcd is the same: one watch
    per daemon, created from the revision after its own listing, cancelled at its kill.
    """

    def __init__(self, keepers: "LoopThread | KeeperPool", endpoint: str, streams: int) -> None:
        import grpc
        from pyetcd import etcdrpc

        self._rpc, self.loop = etcdrpc, keepers.loop
        self._asyncio = keepers._asyncio

        async def start() -> list[Any]:
            out = []
            for _ in range(streams):
                queue: Any = self._asyncio.Queue()
                pending: list[Any] = []  # creates sent, awaiting their "created" in order

                async def requests(queue: Any = queue) -> Any:
                    while True:
                        yield await queue.get()

                call = etcdrpc.WatchStub(grpc.aio.insecure_channel(endpoint)).Watch(requests())
                self._asyncio.ensure_future(self._read(call, pending))
                out.append((queue, pending))
            return out

        self._streams = self._asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self._counts: dict[int, list[int]] = {}  # (stream, watch id) -> [events]
        self._next = 0

    async def _read(self, call: Any, pending: list[Any]) -> None:
        async for resp in call:
            key = (id(pending), resp.watch_id)
            if resp.created:  # counted from here: its events may follow at once
                done, counter = pending.pop(0)
                self._counts[key] = counter
                done.set_result(resp.watch_id)
            elif resp.events:
                counter = self._counts.get(key)
                if counter is not None:
                    counter[0] += len(resp.events)

    def watch(self, prefix: bytes, start_revision: int) -> "tuple[list[int], Callable[[], None]]":
        """Creates one watch (any thread); returns its event counter and its cancel."""
        from pyetcd.utils import prefix_range_end

        self._next += 1
        queue, pending = self._streams[self._next % len(self._streams)]
        counter = [0]

        async def create() -> int:
            done = self.loop.create_future()
            pending.append((done, counter))
            queue.put_nowait(self._rpc.WatchRequest(create_request=self._rpc.WatchCreateRequest(
                key=prefix, range_end=prefix_range_end(prefix), start_revision=start_revision)))
            return await done

        watch_id = self._asyncio.run_coroutine_threadsafe(create(), self.loop).result(30)

        def cancel() -> None:
            def send() -> None:
                self._counts.pop((id(pending), watch_id), None)
                queue.put_nowait(self._rpc.WatchRequest(
                    cancel_request=self._rpc.WatchCancelRequest(watch_id=watch_id)))
            self.loop.call_soon_threadsafe(send)

        return counter, cancel


class RawNodeWatchPool:
    """:class:`NodeWatchPool` on streams written by hand (``--node-watch-client raw``,
    :class:`h2_keepalive.RawWatch`): the same watches, one per daemon with its own watch ID,
    created from the revision after its own listing, on the same number of streams, their
    events counted from each response's top level. What reaches etcd is the same; what the
    simulator process pays per response is a few microseconds, not grpc.aio's tens (at a
    cold start of N = 1,000 the daemons receive 500,000 responses)."""

    def __init__(self, loop: LoopThread, endpoint: str, streams: int) -> None:
        from h2_keepalive import RawWatch

        self.loop, self._asyncio = loop.loop, loop._asyncio
        host, _, port = endpoint.rpartition(":")
        self._counts: dict[tuple[int, int], list[int]] = {}  # (stream, watch id) -> [events]
        self._next = 0

        async def start() -> list[Any]:
            out = []
            for k in range(streams):
                pending: list[Any] = []  # creates sent, awaiting their "created" in order

                def on_response(wid: int, created: bool, canceled: bool, events: int,
                                k: int = k, pending: list[Any] = pending) -> None:
                    if created:  # counted from here: its events may follow at once
                        done, counter = pending.pop(0)
                        self._counts[(k, wid)] = counter
                        done.set_result(wid)
                    elif events:
                        counter = self._counts.get((k, wid))
                        if counter is not None:
                            counter[0] += events

                def broken(k: int = k) -> None:  # a node watch lost is a simulator failure
                    print(f"node watch stream {k} ended", file=sys.stderr, flush=True)

                stream = RawWatch(host, int(port), on_response, broken)
                await stream.open()
                out.append((stream, pending))
            return out

        self._streams = self._asyncio.run_coroutine_threadsafe(start(), self.loop).result()

    def watch(self, prefix: bytes, start_revision: int) -> "tuple[list[int], Callable[[], None]]":
        """Creates one watch (any thread); returns its event counter and its cancel."""
        from h2_keepalive import grpc_message
        from pyetcd import etcdrpc
        from pyetcd.utils import prefix_range_end

        self._next += 1
        k = self._next % len(self._streams)
        stream, pending = self._streams[k]
        counter = [0]
        create = grpc_message(etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=prefix, range_end=prefix_range_end(prefix),
            start_revision=start_revision)).SerializeToString())

        async def send() -> int:
            done = self.loop.create_future()
            pending.append((done, counter))
            stream.send(create)
            return await done

        watch_id = self._asyncio.run_coroutine_threadsafe(send(), self.loop).result(30)

        def cancel() -> None:
            def send_cancel() -> None:
                self._counts.pop((k, watch_id), None)
                stream.send(grpc_message(etcdrpc.WatchRequest(
                    cancel_request=etcdrpc.WatchCancelRequest(
                        watch_id=watch_id)).SerializeToString()))
            self.loop.call_soon_threadsafe(send_cancel)

        return counter, cancel


class RawLister:
    """A daemon's listing of ``nodes/`` as one Range request whose reply is parsed by protobuf
    and only its revision read (``--node-list-client raw``): etcd reads and sends every record
    as to the daemon; the simulator process no longer turns each into elasticd's key-value
    objects (N²/2 records in all at a cold start, 500,000 at N = 1,000, where a real daemon
    turns its ~1,000 on a machine of its own)."""

    def __init__(self, endpoint: str) -> None:
        import grpc
        from pyetcd import etcdrpc

        self._rpc = etcdrpc
        self._stub = etcdrpc.KVStub(grpc.insecure_channel(endpoint))

    def __call__(self, prefix: bytes) -> int:
        from pyetcd.utils import prefix_range_end

        return int(self._stub.Range(self._rpc.RangeRequest(
            key=prefix, range_end=prefix_range_end(prefix)), timeout=10).header.revision)


class SimNode:
    """One simulated node: its daemon's lease, record and node watch, and its agent."""

    def __init__(self, index: int, coord: EtcdCoordinator, n: int, min_nodes: int,
                 keepers: KeeperPool, watches: "NodeWatchPool | RawNodeWatchPool", a: argparse.Namespace) -> None:
        from elasticd.rendezvous.grace import OutageGrace
        from elasticd.rendezvous.config import HandlerSettings
        from elasticd.rendezvous.handler import EtcdNativeRendezvousHandler

        self.index, self.coord, self.keys = index, coord, Keyspace(f"{PREFIX}{n}")
        self.name = f"node-{index:05d}"
        self.keepers, self.watches = keepers, watches
        self.lister: RawLister | None = None
        self.daemon = LeaseKeeper(coord, a.ttl, EtcdHealth(describe="etcd (daemon)"))
        self.lost = 0
        self.grants: list[int] = []  # leases granted, per keeper (daemon, agent)
        self._node_events: list[int] = [0]
        self._cancel_watch: Callable[[], None] | None = None
        self.agent = EtcdNativeRendezvousHandler(
            coord, self.keys.rendezvous("job").prefix,
            HandlerSettings("job", min_nodes, n, liveness_ttl=a.ttl, liveness_confirm=a.confirm,
                            join_timeout=600, last_call=1.0),
            f"10.{index // 62500}.{index // 250 % 250}.{index % 250}", grace=OutageGrace(30.0))
        #: the keep-alive slots of the daemon's and the agent's lease (one stream per slot with
        #: --keepalive-by-node): the node's by default, one each with --keepalive-stream-per-lease
        self.slots = (index, index)
        self.agent._keeper.start = lambda: keepers.add(self.agent._keeper,  # type: ignore
                                                       self.slots[1])
        for keeper in (self.daemon, self.agent._keeper):
            keeper.grant = self._counted(keeper.grant)  # type: ignore[method-assign]
        self.written_at = 0.0  # wall time this agent's last join record write returned
        self.write_started_at = 0.0  # wall time it was sent
        write = self.agent._join.write

        def timed_write(target: int) -> None:
            self.write_started_at = time.time()
            write(target)
            self.written_at = time.time()

        self.agent._join.write = timed_write  # type: ignore[method-assign]

    def _counted(self, grant: Callable[[], int]) -> Callable[[], int]:
        """A keeper's own grant, counted (its step and replace call it to re-grant)."""
        slot = len(self.grants)
        self.grants.append(0)

        def counted() -> int:
            lease = grant()
            self.grants[slot] += 1
            return lease
        return counted

    @property
    def re_grants(self) -> int:
        """Leases granted by this node's keepers beyond each one's first."""
        return sum(max(0, g - 1) for g in self.grants)

    def register(self) -> None:
        """What the daemon does at start: lease, node record, list and watch ``nodes/``."""
        lease = self.daemon.grant()
        self.keepers.add(self.daemon, self.slots[0])
        record = json.dumps({"kind": "node", "v": 1, "node": self.name, "state": "up",
                             "host": f"{self.name}.cluster.example", "pid": 4242,
                             "api": "127.0.0.1:7777", "replication": "10.0.0.1:7788",
                             "pad": "x" * 200}).encode()
        self.coord.put(self.keys.node(self.name), record, lease=lease)
        if self.lister is not None:
            revision = self.lister(self.keys.nodes)
        else:
            _, revision = self.coord.get_prefix(self.keys.nodes)
        self._node_events, self._cancel_watch = self.watches.watch(self.keys.nodes,
                                                                   revision + 1)

    @property
    def node_events(self) -> int:
        return self._node_events[0]

    def kill(self) -> None:
        """kill -9 of the whole node: no more keep-alives, watches or writes; nothing revoked."""
        h = self.agent
        self.keepers.remove(self.daemon)
        self.keepers.remove(h._keeper)
        self.daemon.stop(revoke=False)
        h._keeper.stop(revoke=False)
        h._duty.stop()
        if self._cancel_watch is not None:
            self._cancel_watch()
        h._control_watch.stop()
        if h._election.closer is not None:
            h._election.closer.nodes.stop()

    def leases_lost(self) -> int:
        """Leases of this node found lost so far (a running total: ``take_lost`` forgets)."""
        self.lost += len(self.daemon.take_lost()) + len(self.agent._keeper.take_lost())
        return self.lost


class _Pass:
    """A task of :meth:`Ticker.every_pass`: called once per round with every node."""

    def __init__(self, fn: Callable[[list[SimNode]], None]) -> None:
        self.fn = fn

    def __call__(self, node: SimNode) -> None:
        self.fn([node])


class Ticker:
    """Per-node periodic work on one thread per process (see the module docstring)."""

    def __init__(self, nodes: dict[int, SimNode]) -> None:
        self._nodes = nodes
        self._tasks: list[tuple[float, Callable[[SimNode], None]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def every(self, seconds: float, fn: Callable[[SimNode], None]) -> None:
        self._tasks.append((seconds, fn))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def every_pass(self, seconds: float, fn: Callable[[list[SimNode]], None]) -> None:
        """As :meth:`every`, but ``fn`` gets every live node of the process at once (its own
        loop over them, so that its bookkeeping runs once per round, not once per node)."""
        self.every(seconds, _Pass(fn))

    def _run(self) -> None:
        due = [time.monotonic()] * len(self._tasks)
        while not self._stop.is_set():
            now = time.monotonic()
            for k, (period, fn) in enumerate(self._tasks):
                if now >= due[k]:
                    due[k] = now + period
                    if isinstance(fn, _Pass):
                        fn.fn(list(self._nodes.values()))
                        continue
                    for node in list(self._nodes.values()):
                        fn(node)
            self._stop.wait(max(0.001, min(due) - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()


def keepalive_slots(position: int, index: int, per_lease: int) -> tuple[int, int]:
    """The keep-alive slots (``slot % --keepalive-streams``: its stream) of the daemon's and
    the agent's lease of the node ``index``, ``position``-th of its process: the node's own,
    shared (``per_lease`` 0), or one each (1, as a real node's two processes hold two
    connections: etcd renews a stream's leases one after the other, each waiting for its apply
    loop, so the second lease of a shared stream waits twice)."""
    return (2 * position, 2 * position + 1) if per_lease else (index, index)


def keepalive_streams(a: argparse.Namespace) -> int:
    """LeaseKeepAlive streams per keep-alive process: ``--keepalive-streams``, else (0) one
    per etcd client with grpc.aio and one in all with the raw client (before 2026-11-30)."""
    if getattr(a, "keepalive_streams", 0):
        return a.keepalive_streams
    return a.clients if a.keepalive_client == "aio" else 1


def worker(conn: Any, endpoints: str, indices: list[int], n: int, min_nodes: int,
           a: argparse.Namespace) -> None:
    """A process of simulated nodes, driven by commands on ``conn`` (see :func:`run_size`)."""
    import concurrent.futures

    import scale_profile
    if scale_profile.directory():  # every thread of this process, function by function
        scale_profile.install()
    # Hundreds of simulated agents share one interpreter: a thread woken by its round record
    # waits for the GIL behind the watch threads, up to one switch interval per turn (5 ms by
    # default), a queue a real node (one agent per machine) does not have.
    sys.setswitchinterval(a.switch_interval)
    settings = EtcdSettings(parse_endpoints(endpoints), timeout=CLIENT_TIMEOUT)
    coords = [EtcdCoordinator(settings) for _ in range(a.clients)]
    endpoint = endpoints.split(",")[0].split("://")[-1]
    keepers: Any
    if a.keepalive_process:
        keepers = KeeperProcess(endpoint, a.ttl, keepalive_streams(a), a.keeper_threads,
                                a.keepalive_client, by_node=bool(getattr(a, "keepalive_by_node", 0)),
                                read=getattr(a, "keepalive_read", "task"))
        watches = (RawNodeWatchPool(LoopThread(), endpoint, a.clients)
                   if getattr(a, "node_watch_client", "aio") == "raw"
                   else NodeWatchPool(LoopThread(), endpoint, a.clients))
    else:  # the keep-alives on this process's own loop, beside the node watches
        keepers = KeeperPool(endpoint, a.ttl, a.clients, a.keeper_threads)
        watches = NodeWatchPool(keepers, endpoint, a.clients)
    if getattr(a, "worker_nice", 0):
        # After its keep-alive process started (a child inherits the niceness): on 2 cores a
        # process of 125 simulated agents busy at once takes the CPU from its keep-alives and
        # from etcd, which a real node's agent, on a machine of its own, does not.
        os.nice(a.worker_nice)
    nodes = {i: SimNode(i, coords[k % a.clients], n, min_nodes, keepers, watches, a)
             for k, i in enumerate(indices)}
    for k, x in enumerate(nodes.values()):
        x.slots = keepalive_slots(k, x.index, getattr(a, "keepalive_stream_per_lease", 0))
    if getattr(a, "node_list_client", "aio") == "raw":
        lister = RawLister(endpoint)
        for x in nodes.values():
            x.lister = lister
    ticker = Ticker(nodes)  # where a phase registers per-node periodic work
    phase_state: dict[str, Any] = {}
    pool = concurrent.futures.ThreadPoolExecutor(len(indices))
    if getattr(a, "prestart", 1):  # not inside the join round (scale_placement.prestart)
        prestart(pool, len(indices))
    me = psutil.Process()
    lost_by_killed = [0, 0]  # leases lost, re-grants: of the nodes killed so far
    conn.send("ready")

    def join(node: SimNode) -> Any:
        h = node.agent
        before = len(h.rounds)
        info = h.next_rendezvous()
        number, took = h.rounds[before]
        return (node.index, number, info.rank, time.time() - (time.monotonic() - h.moments["returned"]),
                node.written_at, node.write_started_at)

    def stats() -> dict[str, Any]:
        closers = {i: (c.cpu + c.nodes.cpu, c.nodes.events) for i, x in nodes.items()
                   if (c := x.agent._election.closer) is not None}
        t = me.cpu_times()
        return {"control_events": sum(x.agent._control_watch.events for x in nodes.values()),
                "node_events": sum(x.node_events for x in nodes.values()),
                "closers": closers, "cpu": t.user + t.system + keepers.cpu(),
                "keepalive_cpu": keepers.cpu(),
                "leases_lost": (sum(x.leases_lost() for x in nodes.values())
                                + lost_by_killed[0]),
                "re_grants": sum(x.re_grants for x in nodes.values()) + lost_by_killed[1],
                "handed_back": {**getattr(keepers, "handed_back", {}),
                                **{f"{k}_retried": v
                                   for k, v in getattr(keepers, "retried", {}).items()}},
                "threads": me.num_threads(), "thread_cpu": own_thread_cpu()}

    while True:
        cmd = conn.recv()
        try:
            if cmd[0] == "register":
                # A few at a time: hundreds of threads busy at once in one interpreter starve
                # its keep-alive loop of the GIL for longer than the TTL (every daemon lease
                # was lost at N = 1,000 with 250 at once); real daemons do not share one.
                with concurrent.futures.ThreadPoolExecutor(a.register_threads) as few:
                    list(few.map(lambda x: x.register(), nodes.values()))
                conn.send("ok")
            elif cmd[0] == "start_agents":  # --agents-started: before the join's clock
                # What an agent's first next_rendezvous does before its join record (its
                # lease, the control keys' listing and watch, the duty thread): a real node
                # pays it on its own machine, in parallel with every other; here 125 agents
                # would pay it one after another on one interpreter inside the round's clock.
                with concurrent.futures.ThreadPoolExecutor(a.register_threads) as few:
                    list(few.map(lambda x: x.agent._start(), nodes.values()))
                conn.send("ok")
            elif cmd[0] == "profile":  # SCALE_PROFILE: the table so far (two make a window)
                scale_profile.dump(os.path.join(scale_profile.directory(),
                                                f"worker-{indices[0]}-{cmd[1]}.json"))
                conn.send("ok")
            elif cmd[0] == "join":  # every agent joins, as torchrun's: see scale_agents.py
                while time.time() < cmd[1]:  # every process starts at the same moment
                    time.sleep(0.001)
                runs = phase_state["agents"] = AgentRuns(
                    join, lambda x: x.agent.num_nodes_waiting(),
                    lambda x: (x.agent._control.round, x.agent._control.waiting), pool.submit)
                runs.start(list(nodes.values()))
                conn.send("started")
            elif cmd[0] == "joined":  # the round each agent last returned into, None: in one
                conn.send({i: (r[1] if isinstance(r, tuple) else r)
                           for x, r in phase_state["agents"].latest().items()
                           for i in (x.index,) if i in nodes})
            elif cmd[0] == "settle":  # the round re-formed (or the driver gave up on it)
                runs = phase_state.pop("agents")
                conn.send((runs.settle(cmd[1]), runs.restarts()))
            elif cmd[0] == "stats":
                conn.send(stats())
            elif cmd[0] == "closer":
                conn.send([i for i, x in nodes.items() if x.agent._election.closer is not None])
            elif cmd[0] == "members":
                conn.send([(i, x.agent.me) for i, x in nodes.items()])
            elif cmd[0].startswith("commit_"):  # the steady-training phase (scale_commit.py)
                import scale_commit
                conn.send(scale_commit.handle(phase_state, cmd, nodes, ticker, indices[0],
                                              a.procs, a))
            elif cmd[0] == "kill":
                victim = nodes.pop(cmd[1])
                lost_by_killed[0] += victim.leases_lost()  # totals never go back
                lost_by_killed[1] += victim.re_grants
                victim.kill()
                conn.send(time.time())
            elif cmd[0] == "stop":
                ticker.stop()
                for x in nodes.values():
                    x.agent.stop()
                    x.daemon.stop(revoke=True)
                for c in coords:
                    c.close()
                keepers.close()
                conn.send("stopped")
                return
        except Exception as exc:  # noqa: BLE001 - the driver reports it
            conn.send(repr(exc))


class Cluster:
    """The driver's handle on the worker processes of one N."""

    def __init__(self, n: int, etcd: EmbeddedEtcd, min_nodes: int, a: argparse.Namespace):
        ctx = mp.get_context("spawn")
        self.parts = [list(range(n))[k::a.procs] for k in range(a.procs)]
        self.pipes, self.procs = [], []
        for part in self.parts:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(child, etcd.endpoints, part, n, min_nodes, a),
                               daemon=True)
            proc.start()
            self.pipes.append(conn)
            self.procs.append(proc)
        for c in self.pipes:
            assert c.recv() == "ready"
        self.owner = {i: k for k, part in enumerate(self.parts) for i in part}

    def ask(self, cmd: tuple) -> list[Any]:
        for c in self.pipes:
            c.send(cmd)
        return [c.recv() for c in self.pipes]

    def ask_one(self, index: int, cmd: tuple) -> Any:
        c = self.pipes[self.owner[index]]
        c.send(cmd)
        return c.recv()

    def stats(self) -> dict[str, Any]:
        parts = self.ask(("stats",))
        out: dict[str, Any] = {k: sum(p[k] for p in parts) for k in
                               ("control_events", "node_events", "cpu", "keepalive_cpu",
                                "leases_lost", "re_grants", "threads")}
        out["handed_back"] = {k: sum(p["handed_back"].get(k, 0) for p in parts)
                              for k in {k for p in parts for k in p["handed_back"]}}
        out["closers"] = {i: v for p in parts for i, v in p["closers"].items()}
        out["thread_cpu"] = {}
        for p in parts:
            for k, v in p["thread_cpu"].items():
                out["thread_cpu"][k] = out["thread_cpu"].get(k, 0.0) + v
        return out

    def close(self) -> None:
        for c in self.pipes:
            try:
                c.send(("stop",))
                if c.poll(30):
                    c.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class Etcd:
    """etcd's own counters, summed over its members: CPU seconds and requests by method."""

    def __init__(self, etcd: EmbeddedEtcd) -> None:
        self.urls = [f"http://{m.endpoint.split('://')[-1]}/metrics" for m in etcd.members]
        self.procs = [psutil.Process(m.proc.pid) for m in etcd.members]

    def cpu(self) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in self.procs))

    def requests(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for url in self.urls:
            for k, v in requests_by_method(scrape(url)).items():
                out[k] = out.get(k, 0.0) + v
        return out


class RoundClock:
    """The driver's own watch on the round key: when each round record reached it (wall
    time), to split a round's time into the agents' joins, the close and the fan-out."""

    def __init__(self, endpoints: str, n: int) -> None:
        self.coord = EtcdCoordinator(EtcdSettings(parse_endpoints(endpoints), timeout=10.0))
        key = Keyspace(f"{PREFIX}{n}").rendezvous("job").prefix + b"native/round"
        self.closed_at: list[float] = []
        _, revision = self.coord.get_prefix(key)
        self.watch = self.coord.watch_prefix(key, self._on, revision + 1)
        self.key = key

    def _on(self, batch: Any) -> None:
        if not isinstance(batch, CoordinationError):
            if any(e.kv.key == self.key for e in batch):
                self.closed_at.append(time.time())

    def close(self) -> None:
        self.watch.cancel()
        self.coord.close()


def lease_counts(s0: dict[str, Any], s1: dict[str, Any]) -> dict[str, Any]:
    """Between two :meth:`Cluster.stats`: leases lost (found gone by elasticd's keepers),
    leases re-granted, and refreshes the keep-alive processes handed back to elasticd's step
    (by why: gone, timeout) or sent again after their stream broke (broken_retried)."""
    return {"leases_lost": s1["leases_lost"] - s0["leases_lost"],
            "re_grants": s1["re_grants"] - s0["re_grants"],
            "keepalive_handed_back": {k: v - s0["handed_back"].get(k, 0)
                                      for k, v in sorted(s1["handed_back"].items())}}


class CpuTimeline:
    """etcd's and the simulator's (its processes and their keep-alive processes) CPU, in % of
    a core, every ``period`` seconds of a round: to set each lost lease's refreshes (the
    keep-alive processes' ``lease-history`` lines, wall times) against who had the CPU."""

    def __init__(self, etcd: "Etcd", cluster: "Cluster", period: float = 0.2) -> None:
        self._etcd, self._period = etcd, period
        self._sim = [psutil.Process(p.pid) for p in cluster.procs]
        self._sim += [c for p in self._sim for c in p.children(recursive=True)]
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sim_cpu(self) -> float:
        total = 0.0
        for p in self._sim:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def _run(self) -> None:
        last = (time.time(), self._etcd.cpu(), self._sim_cpu())
        while not self._stop.wait(self._period):
            now = (time.time(), self._etcd.cpu(), self._sim_cpu())
            dt = now[0] - last[0]
            self.samples.append([round(now[0], 2), round((now[1] - last[1]) / dt * 100),
                                 round((now[2] - last[2]) / dt * 100)])
            last = now

    def stop(self) -> list[list[float]]:
        """[wall time, etcd %, simulator %] per period."""
        self._stop.set()
        self._thread.join()
        return self.samples


def measure_round(cluster: Cluster, etcd: Etcd, agents: int,
                  before_join: Callable[[], float | None],
                  clock: "RoundClock | None" = None, round_limit: float = 60.0
                  ) -> dict[str, Any]:
    """One round: ``before_join`` (a kill, or nothing) then every live agent joins at once;
    given up after ``round_limit`` seconds (``seconds`` None, the run goes on)."""
    s0, m0, e0 = cluster.stats(), etcd.requests(), etcd.cpu()
    closes = len(clock.closed_at) if clock is not None else 0
    cpu = CpuTimeline(etcd, cluster)
    probe = EtcdProbe(etcd.urls)  # etcd's apply backlog, slow watchers, disk (the cascade)
    killed_at = before_join()
    start = time.time() + 0.2
    cluster.ask(("join", start))
    # Until every live agent returned into one round (one that raised counts as returned):
    # an agent left outside a closed round is taken in by the next, which the members'
    # num_nodes_waiting starts (scale_agents.py), as torchrun's agents do.
    deadline = time.monotonic() + round_limit
    while time.monotonic() < deadline:
        time.sleep(0.1)  # the times are the agents' own: this only ends the wait
        latest = [r for part in cluster.ask(("joined",)) for r in part.values()]
        if None not in latest and len({r for r in latest if isinstance(r, int)}) <= 1:
            break
    settled = cluster.ask(("settle", 30.0))
    joined = [r for part, _ in settled for r in part]
    restarts = sum(k for _, k in settled)
    timeline = cpu.stop()
    ok = [r for r in joined if isinstance(r, tuple)]
    s1, m1, e1 = cluster.stats(), etcd.requests(), etcd.cpu()
    requests = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1 if m1.get(k, 0) - m0.get(k, 0)}
    per_round = {k: v for k, v in requests.items() if k != "LeaseKeepAlive"}
    closer_cpu = sum(cpu - s0["closers"].get(i, (0.0, 0))[0]
                     for i, (cpu, _) in s1["closers"].items())
    closer_events = sum(ev - s0["closers"].get(i, (0.0, 0))[1]
                        for i, (_, ev) in s1["closers"].items())
    origin = killed_at if killed_at is not None else start
    etcd_view = probe.stop(origin)
    seen = sorted(r[3] - origin for r in ok)
    written = sorted(r[4] - origin for r in ok if r[4])
    first_write = min((r[5] for r in ok if r[5]), default=None)
    closed = [t - origin for t in clock.closed_at[closes:]] if clock is not None else []
    return {
        "seconds": (round(max(seen), 3) if len(ok) == agents and seen
                    and len({r[1] for r in ok}) == 1 else None),
        # where the round's time went: the last join record written, the round record's
        # arrival at the driver, the agents' next_rendezvous returning (median, last)
        "timeline": {"first_record_sent": (round(first_write - origin, 3)
                                           if first_write is not None else None),
                     "last_record_written": round(written[-1], 3) if written else None,
                     "round_closed": [round(t, 3) for t in closed],
                     "returned_median": round(seen[len(seen) // 2], 3) if seen else None,
                     "returned_last": round(seen[-1], 3) if seen else None},
        "agents_in_round": len(ok), "errors": [r for r in joined if not isinstance(r, tuple)][:3],
        "rounds": sorted({r[1] for r in ok}), "ranks_distinct": len({r[2] for r in ok}) == len(ok),
        # agents that joined again because num_nodes_waiting said a node waited outside
        "restarts": restarts,
        # [seconds from the kill (or start), etcd %, simulator %] of a core, every 0.2 s (at
        # most 40: longer rounds in runs of samples merged, scale_placement.compact_timeline)
        "cpu_timeline": compact_timeline([[round(t - origin, 2), e, c]
                                          for t, e, c in timeline]),
        "origin_wall_time": round(origin, 3),
        "requests_per_agent_round": round(sum(per_round.values()) / agents, 3),
        "requests_by_method": per_round,
        "keepalives": requests.get("LeaseKeepAlive", 0),
        "control_events_per_agent": round((s1["control_events"] - s0["control_events"])
                                          / agents, 3),
        "closer_events": closer_events,
        "events_per_agent_round": round((s1["control_events"] - s0["control_events"]
                                         + closer_events) / agents, 3),
        "daemon_node_watch_events": s1["node_events"] - s0["node_events"],
        "etcd_cpu_seconds": round(e1 - e0, 3),
        # etcd's own view (bench/scale_etcd_probe.py): apply backlog, slow watchers, disk
        "etcd_internals": etcd_view,
        "closer_cpu_seconds": round(closer_cpu, 4),
        "simulator_cpu_seconds_per_agent": round((s1["cpu"] - s0["cpu"]) / agents, 5),
        # the simulator processes' CPU by thread group (keep-alive processes apart): the
        # cheap profile of where a round's simulator CPU goes
        "simulator_thread_cpu_seconds": thread_cpu_delta(s0, s1),
        **lease_counts(s0, s1),
    }


def thread_cpu_delta(s0: dict[str, Any], s1: dict[str, Any], top: int = 8) -> dict[str, float]:
    """CPU seconds by thread group between two :meth:`Cluster.stats`, the ``top`` largest
    (the keep-alive processes' CPU as ``(keep-alive processes)``, what no live thread holds as
    ``(threads ended meanwhile)``; the rest summed)."""
    d = {k: v - s0["thread_cpu"].get(k, 0.0) for k, v in s1["thread_cpu"].items()}
    d["(keep-alive processes)"] = s1["keepalive_cpu"] - s0["keepalive_cpu"]
    # what no live thread holds: threads that ended meanwhile (a process's total counts them)
    d["(threads ended meanwhile)"] = s1["cpu"] - s0["cpu"] - sum(d.values())
    ranked = sorted(d.items(), key=lambda kv: -kv[1])
    out = {k: round(v, 3) for k, v in ranked[:top]}
    if len(ranked) > top:
        out["(other)"] = round(sum(v for _, v in ranked[top:]), 3)
    return out


def run_size(n: int, server: EmbeddedEtcd, a: argparse.Namespace,
             result: dict[str, Any]) -> dict[str, Any]:
    """Fills ``result`` as it goes (what a SIGTERM leaves in it is written, marked)."""
    etcd = Etcd(server)
    min_nodes = max(1, n - 2 * a.kills - 2)
    cluster = Cluster(n, server, min_nodes, a)
    clock: RoundClock | None = None
    keepalive = keepalive_streams(a) if a.keepalive_process else a.clients
    result.update({"n": n, "ttl": a.ttl, "processes": a.procs,
                              "etcd_clients": a.procs * a.clients,
                              "grpc_streams": a.procs * (a.clients * 2 + keepalive),
                              "keepalive_streams": a.procs * keepalive,
                              "keepalive_client": a.keepalive_client,
                              # a node's two leases in one frame on its stream (refresh_plan)
                              "keepalive_by_node": getattr(a, "keepalive_by_node", 0),
                              "keepalive_stream_per_lease": getattr(
                                  a, "keepalive_stream_per_lease", 0),
                              "keepalive_read": getattr(a, "keepalive_read", "task"),
                              "node_list_client": getattr(a, "node_list_client", "aio"),
                              "node_watch_client": (getattr(a, "node_watch_client", "aio")
                                                    if a.keepalive_process else "aio"),
                              "streams_note": "per process and etcd client: the client's watch "
                                              "stream (the agents' watches), a keep-alive "
                                              "stream (KeeperPool; with --keepalive-client "
                                              "raw one per process) and a watch stream (the "
                                              "daemons' node watches, NodeWatchPool)"})
    try:
        s_start = cluster.stats()
        t0, e0, c0 = time.monotonic(), etcd.cpu(), s_start["cpu"]
        cluster.ask(("register",))
        registered = time.monotonic() - t0
        # Each daemon's node watch sees the registrations after its own listing: wait for
        # that fan-out to end before the rounds are measured.
        events, still = -1, 0
        while still < 2:
            time.sleep(0.5)
            now_events = cluster.stats()["node_events"]
            still, events = (still + 1, events) if now_events == events else (0, now_events)
        at_start = cluster.stats()
        result["daemons"] = {"registered_seconds": round(registered, 2),
                             **lease_counts(s_start, at_start),
                             "simulator_cpu_seconds_at_start": round(at_start["cpu"] - c0, 2),
                             "node_watch_events_at_start": events,
                             "etcd_cpu_seconds_at_start": round(etcd.cpu() - e0, 2)}
        alive = n
        clock = RoundClock(server.endpoints, n)
        if a.agents_started:
            result["agents_started"] = start_agents(cluster, etcd)
        profiles = profile(cluster, a.profile_join, 15) if a.profile_join else []
        import scale_profile
        if scale_profile.directory():
            cluster.ask(("profile", "join-start"))
        join = measure_round(cluster, etcd, alive, lambda: None, clock)
        if scale_profile.directory():
            cluster.ask(("profile", "join-end"))
        for proc in profiles:
            proc.wait()
        result["join"] = join
        result["join_seconds"] = join_seconds(join, a.agents_started)
        result["join_seconds_definition"] = (
            "the first join record sent to the last agent returned into the round (agents "
            "started before: result['agents_started'])" if a.agents_started else
            "the agents' first next_rendezvous called to the last returned into the round")
        print(f"  N={n} join {join['seconds']} s {join['timeline']}, sim cpu/agent {join['simulator_cpu_seconds_per_agent']}, etcd cpu {join['etcd_cpu_seconds']}, daemons {result['daemons']}", flush=True)
        if a.commit_only:
            result["commit"] = {}  # filled as the phase goes (write_partial)
            result["commit"] = commit_phase(cluster, etcd, server, n, a, result["commit"])
            return result
        # steady: only keep-alives should reach etcd
        time.sleep(1.0)
        s0, m0, e0, t0 = cluster.stats(), etcd.requests(), etcd.cpu(), time.monotonic()
        time.sleep(a.window)
        s1, m1, e1, t1 = cluster.stats(), etcd.requests(), etcd.cpu(), time.monotonic()
        secs = t1 - t0
        result["steady"] = {
            "seconds": round(secs, 1),
            "requests_per_node_per_second": {k: round((m1.get(k, 0) - m0.get(k, 0)) / secs / n, 3)
                                             for k in m1 if m1.get(k, 0) - m0.get(k, 0)},
            "etcd_cpu_percent_of_core": round((e1 - e0) / secs * 100, 1),
            "simulator_cpu_percent_of_core": round((s1["cpu"] - s0["cpu"]) / secs * 100, 1),
            **lease_counts(s0, s1),
            "threads": s1["threads"]}
        members = dict(m for part in cluster.ask(("members",)) for m in part)
        rounds: list[dict[str, Any]] = []
        result["kills"] = rounds
        for kind in ("member", "closer"):
            for _ in range(a.kills):
                closer = [i for part in cluster.ask(("closer",)) for i in part]
                if kind == "closer":
                    victim = closer[0]
                else:
                    victim = random.choice([i for i in members if i not in closer])
                members.pop(victim)

                def kill(victim: int = victim) -> float:
                    return cluster.ask_one(victim, ("kill", victim))

                alive -= 1
                r = measure_round(cluster, etcd, alive, kill, clock)
                r["killed"] = kind
                rounds.append(r)
                print(f"  N={n} {kind} killed -> re-formed {r['seconds']} s {r['timeline']}, "
                      f"{r['requests_per_agent_round']} req, {r['events_per_agent_round']} "
                      f"events/agent, closer cpu {r['closer_cpu_seconds']} s", flush=True)
                time.sleep(0.5)
        summarize(result)
        result["commit"] = commit_phase(cluster, etcd, server, n, a) if a.commit_seconds else None
    finally:
        if clock is not None:
            clock.close()
        cluster.close()
    return result


def start_agents(cluster: Cluster, etcd: Etcd) -> dict[str, Any]:
    """``--agents-started``: every agent's start (its lease, the control keys' listing and
    watch, its duty thread, the closer's election) before the join's clock, timed apart."""
    import scale_profile
    if scale_profile.directory():
        cluster.ask(("profile", "start-start"))
    s0, e0, t0 = cluster.stats(), etcd.cpu(), time.monotonic()
    cluster.ask(("start_agents",))
    took = time.monotonic() - t0
    if scale_profile.directory():
        cluster.ask(("profile", "start-end"))
    time.sleep(1.0)  # the election's writes and their watch events land before the clock
    s1 = cluster.stats()
    agents = sum(len(p) for p in cluster.parts)
    return {"seconds": round(took, 2),
            "simulator_cpu_seconds_per_agent": round((s1["cpu"] - s0["cpu"]) / agents, 5),
            "etcd_cpu_seconds": round(etcd.cpu() - e0, 2), **lease_counts(s0, s1)}


def join_seconds(join: dict[str, Any], started: bool) -> float | None:
    """The join's figure: with the agents started before, from the first join record sent
    (the round's first write) to the last agent returned; else the driver's start to it."""
    first = join["timeline"]["first_record_sent"]
    if join["seconds"] is None or not started or first is None:
        return join["seconds"]
    return round(join["seconds"] - first, 3)


def profile(cluster: Cluster, out: str, seconds: int) -> list[Any]:
    """py-spy (``PY_SPY``, else on the PATH) records the first simulator process and its
    keep-alive process for ``seconds``, the thread holding the GIL only (what its CPU does),
    as collapsed stacks in ``out``/sim.txt and keeper.txt: where a round's time goes."""
    import subprocess

    os.makedirs(out, exist_ok=True)
    spy = os.environ.get("PY_SPY", "py-spy")
    sim = psutil.Process(cluster.procs[0].pid)
    targets = [("sim", sim.pid)] + [("keeper", c.pid) for c in sim.children()]
    return [subprocess.Popen([spy, "record", "--nonblocking", "--gil", "--rate", "50",
                              "--format", "raw", "-d", str(seconds), "-p", str(pid),
                              "-o", os.path.join(out, f"{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in targets]


def summarize(result: dict[str, Any]) -> None:
    """The entry's figures over its rounds so far (all of them, or a SIGTERM's part)."""
    rounds = result.setdefault("kills", [])
    result["reform_seconds"] = [r["seconds"] for r in rounds if r["killed"] == "member"]
    result["closer_reform_seconds"] = [r["seconds"] for r in rounds if r["killed"] == "closer"]
    every = [result["join"]] + rounds
    result["requests_per_agent_round"] = max(r["requests_per_agent_round"] for r in every)
    result["events_per_agent_round"] = max(r["events_per_agent_round"] for r in every)
    result["closer_cpu_seconds_per_round_max"] = max(r["closer_cpu_seconds"] for r in every)
    result["simulator_cpu_seconds_per_agent_round_median"] = statistics.median(
        r["simulator_cpu_seconds_per_agent"] for r in every)
    phases = every + [result[k] for k in ("steady", "daemons") if k in result]
    result["leases_lost"] = sum(r["leases_lost"] for r in phases)
    result["re_grants"] = sum(r["re_grants"] for r in phases)
    result["targets"] = targets(result)


def targets(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for a round entry, each with what was measured: met or not."""
    ttl = r["ttl"]

    def within(times: list[Any], limit: float) -> str:
        return f"{sum(t is not None and t <= limit for t in times)} of {len(times)}"

    phases = {"daemons' cold start": r["daemons"], "join": r["join"],
              **({"steady": r["steady"]} if "steady" in r else {}),
              **{f"kill {k + 1} ({x['killed']})": x for k, x in enumerate(r["kills"])}}
    lost = {k: v["leases_lost"] for k, v in phases.items() if v["leases_lost"]}
    return {
        "join_seconds_at_most_2": r["join_seconds"] is not None and r["join_seconds"] <= 2,
        f"member_reform_at_most_{ttl + 1}s": within(r["reform_seconds"], ttl + 1),
        f"closer_reform_at_most_{ttl + 1.5}s": within(r["closer_reform_seconds"], ttl + 1.5),
        "no_lease_lost_in_any_phase": not lost, "phases_that_lost_leases": lost,
        "requests_per_agent_round_at_most_6": r["requests_per_agent_round"] <= 6,
        "events_per_agent_round_at_most_4": r["events_per_agent_round"] <= 4,
        "closer_cpu_per_round_at_most_1s": r["closer_cpu_seconds_per_round_max"] <= 1,
    }


def commit_phase(cluster: Cluster, etcd: Etcd, server: EmbeddedEtcd, n: int,
                 a: argparse.Namespace, progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """Steady training at one snapshot per ``--period`` per node: bench/scale_commit.py
    (``progress``: filled with the figures so far as the phase goes)."""
    import scale_commit

    r = scale_commit.run_phase(cluster, etcd, server, Keyspace(f"{PREFIX}{n}"), n, a,
                               progress)
    print(f"  N={n} commit: {r['committed_steps']} commits in {r['window_s']} s, "
          f"{r['writes_per_step']} writes/step (max {r['write_bytes_max']} B), lag median "
          f"{r['lag_steps_median']} steps, etcd {r['etcd_cpu_pct']} % of a core "
          f"({r['etcd_cpu_pct_without_commits']} % without commits), db "
          f"{r['db_bytes']}, leases lost {r['leases_lost']}", flush=True)
    return r


#: Seconds the driver's clean-up may take after a SIGTERM before it exits regardless.
TERM_GRACE = 15.0
#: The data directories of the etcd this driver started (removed by :func:`exit_now`).
ETCD_DIRS: list[str] = []
#: What :func:`exit_now` writes first: the current N's rounds measured so far.
ON_EXIT: list[Callable[[], Any]] = []
#: Where etcd and the simulator ran (``--etcd-cpus`` ...), written beside each entry's figures.
PLACEMENT: dict[str, Any] = {}


def exit_now() -> None:
    """Kills every process this driver started (its workers, their keep-alive processes,
    etcd) and exits: a SIGTERM's clean-up that outlived :data:`TERM_GRACE` left them running
    before (2026-11-30: 8 workers, 8 keep-alive processes and etcd, ~2 cores for a minute,
    into the next run of the same lock hold)."""
    for write in list(ON_EXIT):  # the rounds measured, before everything goes
        try:
            ON_EXIT.clear()
            write()
        except Exception as exc:  # noqa: BLE001 - exiting regardless
            print(f"could not write the partial entry: {exc!r}", file=sys.stderr, flush=True)
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    for path in ETCD_DIRS:  # what etcd.stop() would have removed
        import shutil
        shutil.rmtree(path, ignore_errors=True)
    os._exit(143)


def on_term(*_: Any) -> None:
    """SIGTERM (a ``timeout``'s): unwind through the ``finally`` blocks (workers, etcd), and
    exit after :data:`TERM_GRACE` whatever is left. Without the deadline the driver outlived
    its timeout (2026-11-29, N = 1,000): its workers and etcd had the same signal and ended,
    and the clean-up's last steps waited on them (its round watch's cancel, non-daemon client
    threads at exit) until a SIGKILL 30 s later."""
    deadline = threading.Timer(TERM_GRACE, exit_now)
    deadline.daemon = True  # a clean unwind exits at once; a stuck one at the deadline
    deadline.start()
    sys.exit(143)


def record(doc: dict[str, Any], r: dict[str, Any], n: int, a: argparse.Namespace, t0: float,
           load: tuple[float, ...]) -> None:
    """Writes the entry ``r`` of size ``n`` into ``a.out`` (replacing the same N's)."""
    r["load_average_at_start"] = [round(x, 2) for x in load]
    r["etcd_members"] = a.members
    r["etcd_compaction"] = a.etcd_compaction
    r["cpu_placement"] = dict(PLACEMENT)
    r["command"] = "python bench/scale_native.py " + " ".join(sys.argv[1:])
    r["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r["simulation_seconds"] = round(time.monotonic() - t0, 1)
    print(f"N={n}: joined {r['join_seconds']} s; member kill -> "
          f"{r.get('reform_seconds')}; closer kill -> {r.get('closer_reform_seconds')}; "
          f"{r.get('requests_per_agent_round')} req and "
          f"{r.get('events_per_agent_round')} events per agent per round (max); leases "
          f"lost {r.get('leases_lost')} [{r['simulation_seconds']} s]", flush=True)
    old = [x for x in doc["results"]
           if (x.get("n"), x.get("etcd_members", 1)) == (n, a.members)]
    doc["results"] = [x for x in doc["results"] if x not in old]
    if a.commit_only and old:  # the other phases' figures stay as they were
        r = {**old[0], "commit": {**r["commit"], "command": r["command"],
                                  "date": r["date"], "etcd_compaction": a.etcd_compaction,
                                  "load_average_at_start": r["load_average_at_start"]}}
    doc["results"].append(r)
    doc["results"].sort(key=lambda x: (x.get("etcd_members", 1), x["n"]))
    doc.update(benchmark="scale_native", machine={
        "cores": os.cpu_count(), "python": platform.python_version()})
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def write_partial(doc: dict[str, Any], r: dict[str, Any], n: int, a: argparse.Namespace,
                  t0: float, load: tuple[float, ...]) -> bool:
    """A SIGTERM's entry: the rounds measured so far, or a commit-only run's commit phase so
    far (``r["commit"]``, which the phase fills as it goes: its baseline, its build, the
    window's figures every 10 s), written and marked ``incomplete``. False when nothing was
    measured yet (before the join). A commit-only run wrote nothing before (2026-11-30: the
    N = 1,000 attempt stopped 202 s into its window left only its log)."""
    if "join" not in r:
        return False
    if a.commit_only:
        if not r.get("commit"):
            return False
        r["commit"]["incomplete"] = ("stopped by SIGTERM " + (
            f"{r['commit']['window_s']} s into the {a.commit_seconds:.0f} s window"
            if "window_s" in r["commit"] else "before the window"))
        record(doc, r, n, a, t0, load)
        return True
    summarize(r)
    r["incomplete"] = f"stopped by SIGTERM after {len(r['kills'])} of {2 * a.kills} kills"
    record(doc, r, n, a, t0, load)
    return True


def main() -> int:
    if sys.argv[1:2] == ["--keeper"]:  # a simulator process's keep-alive process
        keeper_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), (sys.argv[5:6] or ["aio"])[0],
                    float((sys.argv[6:7] or [CLIENT_TIMEOUT])[0]),
                    (sys.argv[7:8] or ["0"])[0] == "1", (sys.argv[8:9] or ["task"])[0])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--sizes", default="100", help="node counts, comma-separated")
    p.add_argument("--procs", type=int, default=4, help="simulator processes")
    p.add_argument("--clients", type=int, default=2, help="etcd clients per process")
    p.add_argument("--keeper-threads", type=int, default=8,
                   help="threads per process that run a lease keeper's own step when a "
                        "refresh was not a plain renewal")
    p.add_argument("--register-threads", type=int, default=8,
                   help="daemons of a process that register at once")
    p.add_argument("--switch-interval", type=float, default=0.005,
                   help="sys.setswitchinterval of the simulator processes, seconds (CPython's "
                        "default 0.005)")
    p.add_argument("--keepalive-process", type=int, default=1,
                   help="1: each simulator process's lease keep-alives in a process of their "
                        "own (KeeperProcess); 0: on the simulator process's own asyncio loop "
                        "(KeeperPool, the simulator before 2026-11-29 15:00)")
    p.add_argument("--keepalive-client", choices=("aio", "raw"), default="aio",
                   help="with --keepalive-process 1: aio, one grpc.aio stream per etcd client "
                        "(~0.4 ms of CPU per refresh); raw, one HTTP/2 stream written by hand "
                        "per keep-alive process (bench/h2_keepalive.py, ~20 us)")
    p.add_argument("--keepalive-by-node", type=int, default=1,
                   help="1: a node's leases on one keep-alive stream (--keepalive-streams), "
                        "refreshed in one frame once aligned (keeper_main); 0: a lease's stream "
                        "is its ID modulo the streams, each refreshed on its own")
    p.add_argument("--keepalive-stream-per-lease", type=int, default=0,
                   help="1 (with --keepalive-by-node 1): the daemon's and the agent's lease of "
                        "a node each on a stream of its own, as on a real node (two processes, "
                        "two connections); etcd renews a stream's leases one after the other, "
                        "each waiting for its apply loop, so a node's second lease on a shared "
                        "stream waits twice. Needs --keepalive-streams >= 2 x nodes per process")
    p.add_argument("--keepalive-read", choices=("callback", "task"), default="callback",
                   help="raw keep-alive streams read in the loop's callback, or by a reader "
                        "task per stream (before 2026-11-30)")
    p.add_argument("--keepalive-streams", type=int, default=0,
                   help="LeaseKeepAlive streams per keep-alive process, lease on stream "
                        "lease %% K (raw: a connection each); 0: one per etcd client with aio, "
                        "one with raw (before 2026-11-30). etcd renews a stream's leases in "
                        "turn: a stream of hundreds of leases waits behind one just expired")
    p.add_argument("--node-watch-client", choices=("aio", "raw"), default="raw",
                   help="with --keepalive-process 1: the daemons' node watches on grpc.aio "
                        "streams (aio, tens of us of CPU per response) or on streams written "
                        "by hand (raw, bench/h2_keepalive.py RawWatch, a few us); the same "
                        "watches and streams reach etcd either way")
    p.add_argument("--node-list-client", choices=("aio", "raw"), default="raw",
                   help="the daemons' listing of nodes/ at registration: through elasticd's "
                        "client, every record decoded (aio), or one Range request whose reply "
                        "is read for its revision only (raw, RawLister); etcd sends the same")
    p.add_argument("--commit-pool-threads", type=int, default=16,
                   help="the commit phase: 0, each node's commit code on a pool of its own (2 "
                        "threads, as the daemon's replicator; the default before 2026-11-29 "
                        "21:00); K, one pool of K threads per simulator process for all its "
                        "nodes (the same tasks, fewer threads: bench/results/"
                        "scale_native_commit_pool_ab.json)")
    p.add_argument("--tick-batch", type=int, default=1,
                   help="1: the commit phase's per-node tick as one pass over a process's "
                        "nodes (the simulator's bookkeeping once per pass, the lag sampled "
                        "every 0.5 s); 0: node by node, the lag every 0.1 s (before "
                        "2026-11-29 15:00)")
    p.add_argument("--worker-nice", type=int, default=0,
                   help="niceness added to each simulator process after its keep-alive "
                        "process started (etcd and the keep-alives then take the CPU first)")
    p.add_argument("--etcd-cpus", default="",
                   help="CPUs etcd's threads are pinned to, e.g. 0 (default: any)")
    p.add_argument("--sim-cpus", default="",
                   help="CPUs the driver and the simulator processes are pinned to, e.g. 1")
    p.add_argument("--etcd-nice", type=int, default=0,
                   help="etcd's niceness (negative: it takes the CPU before the simulator)")
    p.add_argument("--etcd-tmpfs", action="store_true",
                   help="etcd's data directory in /dev/shm (removed at the end): no fsync")
    p.add_argument("--prestart", type=int, default=1,
                   help="1: each simulator process starts its agents' pool threads before "
                        "the rounds (0: inside the join round, before 2026-11-30 06:00)")
    p.add_argument("--agents-started", type=int, default=0,
                   help="1: start every agent (lease, control watch, duty thread, election) "
                        "before the join's clock, and time the join from its first join "
                        "record (a real agent's start runs on its own machine)")
    p.add_argument("--profile-join", default="",
                   help="a directory: py-spy records the first simulator process and its "
                        "keep-alive process through the join round (collapsed stacks)")
    p.add_argument("--ttl", type=int, default=2, help="lease TTL, seconds")
    p.add_argument("--confirm", type=float, default=1.0, help="rdzv liveness_confirm, seconds")
    p.add_argument("--window", type=float, default=5.0, help="steady window, seconds")
    p.add_argument("--kills", type=int, default=10, help="member kills, then closer kills")
    p.add_argument("--members", type=int, default=1, help="etcd members (3: a local cluster)")
    p.add_argument("--etcd-compaction", default=":".join(COMPACTION), metavar="MODE:RETENTION",
                   help="etcd's --auto-compaction-mode and --auto-compaction-retention, e.g. "
                        "periodic:1m (default: the embedded etcd's, %(default)s)")
    p.add_argument("--out", default="bench/results/scale_native.json",
                   help="results file; an existing entry for the same N (and members) is "
                        "replaced, the others kept")
    p.add_argument("--commit-seconds", type=float, default=0.0,
                   help="steady training with commits, measured for this long after the kills "
                        "(0: no commit phase); bench/scale_commit.py")
    p.add_argument("--commit-only", action="store_true",
                   help="join, then the commit phase only (no kills); only the entry's "
                        "`commit` field is written")
    p.add_argument("--commit-warmup", type=float, default=15.0,
                   help="seconds of commits before the measured window")
    p.add_argument("--commit-baseline", type=float, default=15.0,
                   help="seconds measured just before the commit phase, without commits")
    p.add_argument("--period", type=float, default=1.0, help="snapshot period per node")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2, help="m: copies of each snapshot")
    a = p.parse_args()
    if a.keepalive_stream_per_lease:
        most = -(-max(int(x) for x in a.sizes.split(",")) // a.procs)
        if not a.keepalive_by_node or a.keepalive_streams < 2 * most:
            p.error(f"--keepalive-stream-per-lease needs --keepalive-by-node 1 and "
                    f"--keepalive-streams >= {2 * most} (two leases per node, {most} nodes "
                    f"per process)")
    a.commit_authkey = os.urandom(16)
    sizes = [int(x) for x in a.sizes.split(",") if x]
    signal.signal(signal.SIGTERM, on_term)
    random.seed(0)
    try:
        with open(a.out) as f:
            doc = json.load(f)
        if not isinstance(doc.get("results"), list):
            doc = {}
    except (OSError, ValueError):
        doc = {}
    doc.setdefault("results", [])
    etcd_cpus, sim_cpus = parse_cpus(a.etcd_cpus), parse_cpus(a.sim_cpus)
    # --etcd-tmpfs: etcd's data (its WAL) in memory. At N = 1,000 etcd's CPU fell to 0 % of a
    # core in 0.2 s slots of a kill round even at nice -10 while leases were lost: not
    # runnable, blocked on its WAL's fsync on this VM's disk, which other sessions' checkpoint
    # writes share (the lock covers the CPU, not the disk). etcd's own SSD is what a real
    # cluster has; the fsync's cost is measured apart (--members 3).
    data_dir = tempfile.mkdtemp(prefix="elasticd-etcd-", dir="/dev/shm") if a.etcd_tmpfs \
        else None
    if data_dir:
        ETCD_DIRS.append(data_dir)
    mode, _, retention = a.etcd_compaction.partition(":")
    etcd = EmbeddedEtcd(a.members, data_dir=data_dir, compaction=(mode, retention)).start()
    ETCD_DIRS.append(etcd.dir)
    # etcd's core and priority (scale_placement): etcd's threads now, the simulator's by
    # inheritance (the workers are spawned from this thread after it)
    for m in etcd.members:
        place(m.proc.pid, etcd_cpus or None, a.etcd_nice if a.etcd_nice else None)
    if sim_cpus:
        os.sched_setaffinity(0, sim_cpus)
    PLACEMENT.update(etcd_cpus=etcd_cpus or "any", simulator_cpus=sim_cpus or "any",
                     etcd_nice=a.etcd_nice, worker_nice=a.worker_nice,
                     etcd_data="tmpfs (no fsync cost)" if data_dir else "disk")
    try:
        for n in sizes:
            t0, load = time.monotonic(), os.getloadavg()  # others' work beside the lock
            r: dict[str, Any] = {}

            def partial(r: dict[str, Any] = r, n: int = n, t0: float = t0,
                        load: tuple[float, ...] = load) -> bool:
                """A SIGTERM's: what was measured so far written, marked."""
                return write_partial(doc, r, n, a, t0, load)

            # exit_now writes them too: a clean-up past TERM_GRACE never reaches the except
            ON_EXIT[:] = [partial]
            try:
                run_size(n, etcd, a, r)
            except SystemExit:  # SIGTERM (a timeout): the rounds measured are written, marked
                ON_EXIT.clear()
                if not partial():
                    raise
                raise SystemExit(143) from None
            ON_EXIT.clear()
            record(doc, r, n, a, t0, load)
    finally:
        if os.environ.get("SCALE_ETCD_LOGS"):  # etcd's own warnings, beside the lost leases
            import shutil
            for m in etcd.members:
                shutil.copy(m.log_path, os.environ["SCALE_ETCD_LOGS"])
        etcd.stop()
        if data_dir:
            import shutil
            shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
