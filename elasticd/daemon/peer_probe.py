"""A peer whose daemon's port refuses connections is dead: confirming a node's death before its
lease expires, once a worker's collective broke (issue 31).

A node killed whole resets every connection its processes held, but its lease lives until its
TTL. A worker whose collective broke tells its daemon (``group_broke``); the daemon knocks at
the HTTP port of each peer that ran workers of its job and revokes the lease of one whose port
**refuses** the connection (its kernel answered, nothing listens: a live daemon serves that port
from before it registers until after it revoked its lease, ``daemon/node.py``); everything after
is the lease-expiry path. A refusal counts only from a peer whose port answered this daemon
before under the same lease (:meth:`PeerProbe.baseline`); a connection that opens, a timeout, an
unreachable host, a peer not ``up`` or without an address is never taken for a death (a firewall
rule added later that rejects is: the peer is fenced, a cost, never two owners of one lease).
The rule, its cases and what it measured: docs/in-process-design.md, "A node killed whole is
found before its lease expires". One series of probes at a time per daemon, at :data:`SCHEDULE`
(the killed node's processes do not all die in the same millisecond).
"""

from __future__ import annotations

import enum
import errno
import logging
import socket
import threading
from typing import Callable

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.cluster.membership import NodeRecord, NodeState
from elasticd.coordination.api import CoordinationError

log = logging.getLogger("elasticd.daemon.daemon")

#: Seconds after a break at which the peers are probed (those that answered, again).
SCHEDULE = (0.0, 0.05, 0.2, 0.5)
#: Seconds one connection attempt may take: longer is no answer (never a death).
TIMEOUT = 0.25


class Answer(str, enum.Enum):
    ANSWERED = "answered"  # the connection opened: something listens
    REFUSED = "refused"  # the host answered with a reset: nothing listens
    SILENT = "silent"  # no answer, or an error that proves nothing


def split_address(address: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a pair, or None."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def knock(address: str, timeout: float = TIMEOUT) -> Answer:
    """Opens (and closes) a TCP connection to ``address``: who answers."""
    where = split_address(address)
    if where is None:
        return Answer.SILENT
    try:
        with socket.create_connection(where, timeout=timeout):
            return Answer.ANSWERED
    except ConnectionRefusedError:
        return Answer.REFUSED
    except OSError as exc:
        # ECONNREFUSED under another class on some platforms; everything else (a timeout,
        # EHOSTUNREACH from an ICMP message, ...) proves nothing.
        return Answer.REFUSED if exc.errno == errno.ECONNREFUSED else Answer.SILENT


def suspects(records: list[NodeRecord], me: str, ran_workers: Callable[[str], bool]) -> list[
        NodeRecord]:
    """The peers a broken collective may point at: ``up``, with an address and a lease, and
    with workers of this node's job."""
    return [r for r in records if r.node != me and r.state == NodeState.UP.value and r.address
            and r.lease > 0 and ran_workers(r.node)]


class PeerProbe:
    """The daemon's probes of its job's peers after a worker's collective broke.

    Args:
        peers: the peers to probe now (called before each round of probes; from another thread
            than the daemon's loop: it returns copies).
        revoke: revokes a lease (a missing lease is no error).
        revoking: told the node's record and why before its lease is revoked (the daemon's
            failure record then says what happened: :meth:`Membership.revoked`), and told
            again with "" when the revocation failed (the lease then expires).
    """

    def __init__(self, me: str, peers: Callable[[], list[NodeRecord]],
                 revoke: Callable[[int], None], clock: Clock = SYSTEM_CLOCK,
                 schedule: tuple[float, ...] = SCHEDULE, timeout: float = TIMEOUT,
                 knock: Callable[[str, float], Answer] = knock,
                 revoking: Callable[[NodeRecord, str], None] = lambda rec, why: None) -> None:
        self.me = me
        self.revoking = revoking
        self.peers = peers
        self.revoke = revoke
        self.clock = clock
        self.schedule = schedule
        self.timeout = timeout
        self.knock = knock
        self._lock = threading.Lock()
        self._running = False
        #: (node, lease) of the peers whose port answered this daemon.
        self.answered: set[tuple[str, int]] = set()

    def baseline(self, records: list[NodeRecord]) -> None:
        """Knocks once at each of ``records`` (the peers, once the job's round closed) in a
        thread of its own (:meth:`knock_all`)."""
        threading.Thread(target=self.knock_all, args=(records,), daemon=True,
                         name="elasticd-peer-baseline").start()

    def knock_all(self, records: list[NodeRecord]) -> None:
        """Knocks at each of ``records`` not known to answer: a refusal later counts only
        from those that answered. Forgets the older leases of their nodes."""
        with self._lock:
            known = set(self.answered)
        for rec in records:
            if (rec.node, rec.lease) not in known and rec.address and \
                    self.knock(rec.address, self.timeout) is Answer.ANSWERED:
                with self._lock:
                    self.answered.add((rec.node, rec.lease))
        current = {(r.node, r.lease) for r in records}
        nodes = {node for node, _ in current}
        with self._lock:  # in place: a baseline running beside this one keeps what it added
            self.answered -= {p for p in self.answered if p not in current and p[0] in nodes}

    def suspect(self, why: str = "") -> bool:
        """A worker's collective broke: probes the peers in a thread of its own, unless a
        series already runs; returns whether this call started one."""
        with self._lock:
            if self._running:
                return False
            self._running = True
        threading.Thread(target=self._series, args=(why,), daemon=True,
                         name="elasticd-peer-probe").start()
        return True

    def _series(self, why: str) -> None:
        try:
            self.probe_series(why)
        except Exception:  # noqa: BLE001 — a probe must not end the daemon: the TTL still holds
            log.exception("probing the peers failed")
        finally:
            with self._lock:
                self._running = False

    def probe_series(self, why: str = "") -> None:
        """Probes the peers at each moment of the schedule."""
        start = self.clock.monotonic()
        done: set[int] = set()
        for at in self.schedule:
            self.clock.sleep(max(0.0, start + at - self.clock.monotonic()))
            for rec in self.peers():
                if rec.lease in done or (rec.node, rec.lease) not in self.answered:
                    continue
                answer = self.knock(rec.address, self.timeout)
                if answer is not Answer.REFUSED:
                    continue
                done.add(rec.lease)
                log.warning("%s's daemon refuses connections at %s after a collective broke "
                            "(%s): revoking its lease %x (it failed)", rec.node, rec.address,
                            why[:120] or "no reason given", rec.lease)
                self.revoking(rec, f"its daemon refused connections at {rec.address} after "
                                   f"a collective broke, found by {self.me}'s probe")
                try:
                    self.revoke(rec.lease)
                except CoordinationError as exc:  # its lease expires as before
                    self.revoking(rec, "")  # and its failure says so, not "revoked"
                    log.warning("could not revoke %s's lease %x: %s", rec.node, rec.lease, exc)
