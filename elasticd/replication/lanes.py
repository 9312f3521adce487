"""Bounded push queues: one lane per peer, one reused connection per lane, a small thread pool.

Snapshots complete faster than a slow peer can take them, and replication must never make the
training loop wait or queue without bound. So each peer gets a *lane*: its pushes run one at a
time on the peer's single connection (a pool thread serves the lane while it has work), and a
lane holds at most one pending push per shard. A newer snapshot of a shard whose push has not
started yet replaces it: the intermediate step is skipped, and counted. A lane therefore holds
at most one push in flight plus one pending per shard, whatever the peer's speed.

Re-replication and drain pushes name an exact (older, committed) version; they are queued apart
from the newest-wins pushes of the same shard and carry a future their caller may wait on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import ssl
import threading
from typing import Callable

from elasticd.clock import Clock
from elasticd.replication.api import ReplicationError, Version
from elasticd.replication.transport import ReplicaClient

log = logging.getLogger(__name__)

#: Given a node id, where its replica server listens, or None when unknown.
AddressBook = Callable[[str], "tuple[str, int] | None"]


class NoAddress(ReplicationError):
    """The peer's replica server address is not known (it left, or never registered)."""


@dataclasses.dataclass
class Task:
    """One push of a shard to a peer.

    Attributes:
        version: the version notified (newest-wins tasks push the newest held at start).
        exact: push exactly ``version`` (re-replication, drain) rather than the newest.
        done: resolved with True/False when an exact push ends.
    """

    job: str
    rank: int
    version: Version
    exact: bool = False
    done: concurrent.futures.Future | None = None

    @property
    def key(self) -> tuple:
        return (self.job, self.rank, self.version if self.exact else None)


@dataclasses.dataclass
class _Lane:
    pending: "collections.OrderedDict[tuple, Task]" = dataclasses.field(
        default_factory=collections.OrderedDict)
    running: bool = False


class Connections:
    """One authenticated :class:`ReplicaClient` per peer, reused across pushes and fetches."""

    def __init__(self, node_id: str, secret: bytes, addresses: AddressBook, *,
                 timeout: float = 30.0, ssl_context: ssl.SSLContext | None = None,
                 clock: Clock | None = None, scope: str | None = None) -> None:
        self.node_id, self._secret, self.addresses = node_id, secret, addresses
        self.timeout, self.ssl_context, self.clock = timeout, ssl_context, clock
        #: A job: every session of the pool may only fetch its copies (``Hello.scope``).
        self.scope = scope
        self._lock = threading.Lock()
        self._clients: dict[str, ReplicaClient] = {}

    def get(self, peer: str, connect_timeout: float | None = None
            ) -> tuple[ReplicaClient, bool]:
        """(client, reused): the pooled connection to ``peer``, or a new one. A reused one may
        have been closed by the peer's idle timeout, so a caller retries once on a fresh one.

        Args:
            connect_timeout: seconds a new connection's connect and handshake may each wait
                (a frozen peer's kernel still accepts); None: the pool's timeout. The
                connection keeps the pool's timeout afterwards.

        Raises: NoAddress, ConnectionLost, AuthenticationFailed.
        """
        # The address book is the membership: a peer that left it (declared dead, or gone)
        # loses its pooled connection too. A frozen peer's socket stays open, and a fetch over
        # it waited for the whole timeout while the restoring workers gave up (bench: SIGSTOP
        # of a daemon, survivors restarted from step 0).
        address = self.addresses(peer)
        if address is None:
            self.discard(peer)
            raise NoAddress(f"no replica server address known for node {peer!r}")
        with self._lock:
            client = self._clients.get(peer)
        if client is not None:
            return client, True
        client = self._connect(peer, address, connect_timeout, self.scope)
        with self._lock:
            old, self._clients[peer] = self._clients.get(peer), client
        if old is not None:
            old.close()
        return client, False

    def open_scoped(self, peer: str, job: str,
                    connect_timeout: float | None = None) -> ReplicaClient:
        """A new session to ``peer`` that may only fetch ``job``'s copies (``Hello.scope``),
        outside the pool: the caller owns it (to hand it over, :mod:`.handed`).
        ``connect_timeout``: as for :meth:`get`.

        Raises: NoAddress, ConnectionLost, AuthenticationFailed.
        """
        address = self.addresses(peer)
        if address is None:
            raise NoAddress(f"no replica server address known for node {peer!r}")
        return self._connect(peer, address, connect_timeout, job)

    def _connect(self, peer: str, address: tuple[str, int], connect_timeout: float | None,
                 scope: str | None) -> ReplicaClient:
        """A new authenticated connection to ``peer``, its connect and handshake each within
        ``connect_timeout`` (None: the pool's timeout), the pool's timeout afterwards."""
        client = ReplicaClient.connect(address[0], address[1], self._secret, self.node_id,
                                       expected_peer=peer,
                                       timeout=connect_timeout or self.timeout,
                                       ssl_context=self.ssl_context, clock=self.clock,
                                       scope=scope)
        if connect_timeout is not None:
            client.channel.sock.settimeout(self.timeout)
        return client

    def discard(self, peer: str, client: ReplicaClient | None = None) -> None:
        """Closes the connection to ``peer`` (only if it is still ``client``, when given)."""
        with self._lock:
            current = self._clients.get(peer)
            if current is None or (client is not None and current is not client):
                return
            del self._clients[peer]
        current.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


class Lanes:
    """Per-peer serial push queues on a shared executor.

    Args:
        executor: runs lanes; one thread serves one lane while it has work.
        run: performs one push (exceptions are logged, never propagated).
    """

    def __init__(self, executor: concurrent.futures.Executor,
                 run: Callable[[str, Task], None]) -> None:
        self._executor, self._run = executor, run
        self._lock = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._closed = False
        self.skipped = 0

    def submit(self, peer: str, task: Task) -> bool:
        """Queues ``task`` for ``peer``; False when closed or superseded by a queued newer one."""
        with self._lock:
            if self._closed:
                resolve(task, False)
                return False
            lane = self._lanes.setdefault(peer, _Lane())
            queued = lane.pending.get(task.key)
            if queued is not None:
                if task.exact or task.version <= queued.version:
                    _chain(task, queued)
                    return False
                # The queued push never started: its step is skipped for the newer one.
                self.skipped += 1
                _chain(queued, task)
                del lane.pending[task.key]
            lane.pending[task.key] = task
            if not lane.running:
                lane.running = True
                self._executor.submit(self._serve, peer)
            return True

    def _serve(self, peer: str) -> None:
        while True:
            with self._lock:
                lane = self._lanes[peer]
                if not lane.pending:  # close() empties every lane, and submit() then adds none
                    lane.running = False
                    self._lock.notify_all()
                    return
                _, task = lane.pending.popitem(last=False)
            try:
                self._run(peer, task)
            except Exception:  # noqa: BLE001 — one bad push must not stop the lane
                log.exception("push of %s rank %d to %s failed", task.job, task.rank, peer)
                resolve(task, False)

    def backlog(self) -> dict[str, int]:
        """Pending pushes per peer (the one in flight not counted)."""
        with self._lock:
            return {p: len(lane.pending) for p, lane in self._lanes.items() if lane.pending}

    def wait_idle(self, timeout: float) -> bool:
        """Blocks (real time) until no lane has work; False on timeout."""
        with self._lock:
            return self._lock.wait_for(
                lambda: not any(l.running or l.pending for l in self._lanes.values()), timeout)

    def close(self) -> None:
        """Drops pending pushes (their futures resolve False); pushes in flight finish."""
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                for task in lane.pending.values():
                    resolve(task, False)
                lane.pending.clear()
            self._lock.notify_all()


def resolve(task: Task, ok: bool) -> None:
    if task.done is not None and not task.done.done():
        task.done.set_result(ok)


def _chain(dropped: Task, kept: Task) -> None:
    """Whoever waits on ``dropped`` learns the outcome of ``kept`` instead."""
    if dropped.done is None:
        return
    if kept.done is None:
        kept.done = concurrent.futures.Future()
    kept.done.add_done_callback(lambda f: resolve(dropped, bool(f.result())))
