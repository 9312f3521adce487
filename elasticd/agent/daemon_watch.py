"""In the torchrun agent: stop this node's job when its daemon was declared dead and is silent.

A daemon that learns it was declared dead (its lease expired, so the peers have restarted their
workers without it) fences its node: it stops the agent and the workers before it rejoins. A
daemon that is frozen (SIGSTOP, a debugger, a stuck page fault) or killed on its own cannot, and
its agent and workers run on: the agent joins the survivors' next rendezvous round, and the
restore of that round has a rank whose daemon does not answer
(:class:`~elasticd.worker.restore.DaemonUnreachable`). So the agent fences for its daemon.

Rule (:meth:`DaemonWatch.tick`, on the agent's monotonic clock): fence when the node's record
(``<prefix>/nodes/<node>``, bound to the daemon's lease) is absent from etcd, as a watch on that
one key shows it (checked every 0.25 s under a daemon; read anew every :data:`VERIFY_EVERY`
seconds and after a watch error: a watch costs etcd nothing while nothing changes), *and* the
daemon has not answered a ping on its local socket for ``silent_for`` seconds (1 s; it is pinged
every 0.25 s by a thread of its own, each ping waiting up to 0.5 s, and answers in about a
millisecond when alive). Either alone is normal for a while: every record vanishes for a moment
after an etcd outage longer than the lease TTL (each daemon re-grants and re-registers within a
heartbeat), and a busy daemon can answer late. A failed etcd read never fences (no judgement
from a doubtful view). A wrong fence costs one agent restart: a live daemon sees its
agent exit and starts it again. Because a frozen daemon has been silent since it froze, a lease
TTL before its record goes, the fence follows the record's deletion by one read.

Fencing kills every process carrying this job's tag on this node (workers, the warm-start
zygote) with SIGKILL, revokes the agent's rendezvous alive key (so the survivors drop this node
at once rather than after its TTL) and ends the agent with :data:`FENCED_EXIT`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import CoordinationError, Coordinator, EventType, Watch

log = logging.getLogger(__name__)

#: The agent's exit code after it fenced its node (EX_TEMPFAIL: try again later).
FENCED_EXIT = 75
#: Seconds between reads of the record while the watch follows it: a watch made silent by an
#: etcd data loss (its revision is in the wiped cluster's future) is caught by the next read.
VERIFY_EVERY = 10.0


class DaemonWatch:
    """Decides, every ``interval`` seconds, whether this agent must fence its node.

    Args:
        node_key: the node's record, bound to the daemon's lease.
        ping: True when the daemon answers on its local socket in time.
        fence: called once, with the reason, when the rule holds (normally does not return).
        interval: seconds between etcd reads, and between pings (by the pinger thread,
            :meth:`probe`).
        silent_for: seconds without an answer to a ping that make the daemon silent.
        ping_timeout: the longest a ping takes, answered or not (None: unknown); below
            ``silent_for``, :meth:`settle` skips a probe that could not change its answer.
    """

    def __init__(self, coordinator: Coordinator, node_key: bytes, ping: Callable[[], bool],
                 fence: Callable[[str], None], interval: float = 0.25, silent_for: float = 1.0,
                 clock: Clock | None = None, ping_timeout: float | None = None) -> None:
        self._coordinator = coordinator
        self.node_key = node_key
        self._ping = ping
        self._fence = fence
        self.interval = interval
        self.silent_for = silent_for
        self.ping_timeout = ping_timeout
        self._clock = clock or SystemClock()
        # The daemon started this agent just now: it counts as having answered.
        self._answered = self._clock.monotonic()
        self._stop = threading.Event()
        # What the watch on the record says (None: no watch, or in doubt: read), when it was
        # last read, and the watch events seen (a read raced by an event keeps the event's).
        self._lock = threading.Lock()
        self._present: bool | None = None
        self._lease: int | None = None  # the record's lease as last seen (None: not known)
        self._read_at = float("-inf")
        self._events = 0
        self._watch: Watch | None = None

    def probe(self) -> bool:
        """One ping of the daemon; an answer resets its silence. Returns whether it answered."""
        if self._ping():
            self._answered = self._clock.monotonic()
            return True
        return False

    def silence(self) -> float:
        """Seconds since the daemon last answered a ping."""
        return self._clock.monotonic() - self._answered

    def follow(self) -> None:
        """Watches the record, so that :meth:`tick` reads etcd only every
        :data:`VERIFY_EVERY` seconds and after a watch error (without it, at every tick)."""
        # The agent's etcd role may read this one key: the revision and the watch are its.
        revision = self._coordinator.revision(self.node_key)
        self._watch = self._coordinator.watch_key(self.node_key, self._on_watch, revision + 1)

    def _on_watch(self, batch: object) -> None:
        with self._lock:
            self._events += 1
            if isinstance(batch, CoordinationError):
                self._present = self._lease = None  # in doubt: the next tick reads
                return
            for e in batch:  # type: ignore[attr-defined]
                self._present = e.type is EventType.PUT
                self._lease = e.kv.lease if self._present else None

    def lease_seen(self) -> int | None:
        """The lease the record is bound to, as the watch (or the last read) saw it; None when
        that is not known (no sight yet, in doubt, or the record absent). A view that may be
        late: the join record's write compares it with the record's (:mod:`..rendezvous.join`)."""
        with self._lock:
            return self._lease or None

    def _is_present(self, now: float) -> bool:
        """The watch's view, or a read when there is no watch, it is in doubt, or the last
        read is :data:`VERIFY_EVERY` old. A failed read answers True: no judgement from a
        doubtful view."""
        with self._lock:
            view, events = self._present, self._events
            if view is not None and self._watch is not None \
                    and now - self._read_at < VERIFY_EVERY:
                return view
        try:
            kv = self._coordinator.get(self.node_key)
        except CoordinationError:
            with self._lock:
                self._present = self._lease = None
            return True
        present = kv is not None
        missed = False
        with self._lock:
            self._read_at = now
            if self._events == events:
                self._lease = kv.lease if kv is not None else None
            if self._watch is None:
                return present
            if self._events == events:
                # The watch said otherwise with no event since: it missed one (an etcd data
                # loss leaves it silent, its revision in the wiped cluster's future).
                missed = view is not None and view != present
                self._present = present
            elif self._present is not None:
                present = self._present  # an event came during the read: it is newer
        if missed:
            self._refollow()
        return present

    def _refollow(self) -> None:
        old = self._watch
        try:
            self.follow()
        except CoordinationError:
            return  # the next verification tries again
        if old is not None:
            old.cancel()

    def tick(self) -> str | None:
        """One look at the record; returns why to fence, or None."""
        if self._is_present(self._clock.monotonic()):
            return None
        silent = self.silence()
        if silent < self.silent_for:
            return None
        return (f"this node's record {self.node_key.decode(errors='replace')} is gone from "
                f"etcd (its daemon was declared dead) and the daemon has not answered on its "
                f"local socket for {silent:.1f} s")

    def settle(self, timeout: float) -> str:
        """Before this node's agent joins a rendezvous round: fences now if the rule holds;
        while the daemon is silent, waits up to ``timeout`` seconds for it to answer or for the
        rule to hold. A node that joins a round and is fenced right after has closed that round
        with a member that never starts: the survivors' agents wait on it in torch's rank
        assignment (CI: a SIGSTOP of one daemon re-formed the job only after 60 s).

        No probe when the daemon answered the pinger less than ``silent_for - ping_timeout``
        ago: a probe ends within ``ping_timeout`` and only an answer moves the silence's start,
        so the silence stays below ``silent_for``, :meth:`tick` cannot fence, and the answer is
        "answering" either way (docs/in-process-design.md §7.6: the probe cost the round ~14 ms).

        Returns:
            "answering"; "silent" when the daemon stayed silent for ``timeout`` with its record
            present (the join goes ahead: a wrong fence costs more than a late one); "fenced"
            when the fence given returned (only in tests: the real one ends the process).
        """
        deadline = self._clock.monotonic() + timeout
        while True:
            if self.ping_timeout is not None \
                    and self.silence() + self.ping_timeout < self.silent_for:
                return "answering"  # a probe could not change it: the docstring
            self.probe()
            reason = self.tick()
            if reason is not None:
                self._fence(reason)
                return "fenced"
            if self.silence() < self.silent_for:
                return "answering"
            if self._clock.monotonic() >= deadline:
                return "silent"
            self._clock.sleep(self.interval)

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            reason = self.tick()
            if reason is not None:
                self._fence(reason)
                return

    def _pinger(self) -> None:
        while not self._stop.wait(self.interval):
            self.probe()

    def start(self) -> None:
        try:
            self.follow()
        except CoordinationError as exc:  # etcd unreachable now: read at every tick
            log.warning("elasticd: cannot watch this node's record (%s): reading it every "
                        "%.2g s", exc, self.interval)
        for target, name in ((self.run, "elasticd-daemon-watch"),
                             (self._pinger, "elasticd-daemon-ping")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.cancel()


def ping_daemon(socket_path: str, timeout: float) -> Callable[[], bool]:
    """A ping of the daemon at ``socket_path``: any answer, an error included, means alive."""
    from elasticd.worker.client import DaemonClient, DaemonError, DaemonUnavailable, WorkerIdentity

    def ping() -> bool:
        client = DaemonClient(socket_path, WorkerIdentity(), timeout=timeout)
        try:
            client.call("ping")
            return True
        except DaemonError:
            return True  # it answered (a daemon that predates "ping" refuses it)
        except DaemonUnavailable:
            return False
        finally:
            client.close()

    return ping


def fence_agent(tag: str, revoke: Callable[[], None]) -> Callable[[str], None]:
    """The fence: SIGKILL every other process tagged ``tag``, ``revoke`` the alive key, exit."""
    from elasticd.agent.supervisor import signal_all, tagged_pids

    def fence(reason: str) -> None:
        log.error("elasticd: %s: fencing this node, killing its workers and ending the agent",
                  reason)
        signal_all(tagged_pids(tag), signal.SIGKILL)
        try:
            revoke()
        except Exception as exc:  # noqa: BLE001 — the alive key then expires with its TTL
            log.warning("elasticd: could not revoke the rendezvous alive key: %s", exc)
        logging.shutdown()
        os._exit(FENCED_EXIT)

    return fence
