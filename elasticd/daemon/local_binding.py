"""Who may use the daemon's local socket, and for what: each connection bound to its caller.

The daemon runs as root; a job runs as its own (unprivileged) user. That user's workers must
reach the daemon (progress reports, checkpoint slots), so the socket admits more than root — and
each request must then be held to what its caller is. The rules are docs/security.md's ("The
daemon's local socket"): a connection is admitted for the daemon's own uid (then not bound), or
for the running job's uid *and* a pid that descends from the job's agent or zygote, each known
by pid and start time; it is bound to that job (refused once the job changes); its writing ops
(``ckpt_reserve``, ``ckpt_complete``, ``ckpt_report``, ``progress``, ``register``, and
``ckpt_sessions`` and ``ckpt_sessions_done``, which keep and end sessions per rank) to the
first rank it used, within the spec's largest world (:class:`RankClaims`). Beyond the doc:
only ``/proc/<pid>/stat`` is read, never the caller's memory (its environment can be made to
read for minutes, :data:`~elasticd.agent.supervisor.ENV_READ_LIMIT`), as this runs on the
accept thread;
reads reach any rank of the job (after a resize a rank restores another's old shard);
``ckpt_release`` releases only the pins this connection was given.

The same uid is one principal to the kernel (ptrace, signals): the pid check keeps other
programs of the job's user and leftovers of an earlier job from acting for the job, it is not a
wall between processes of one user. Linux only (``/proc``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable

from elasticd.local.job_scope import JobScope, stat_fields
from elasticd.errors import LocalProtocolError

#: Ops that write on behalf of one rank: bound to the first rank a connection uses.
#: ``ckpt_sessions`` too: each (rank, old rank) it is asked for keeps a live set of sessions to
#: holders, whose connection caps other jobs share, so one process asks for one rank's alone.
BOUND_WRITES = frozenset({"ckpt_reserve", "ckpt_complete", "ckpt_report", "progress",
                          "register", "ckpt_sessions", "ckpt_sessions_done"})
_PINNING = frozenset({"ckpt_open", "ckpt_fetch"})
_MAX_DEPTH = 64  # parent links followed from a caller up to the job's agent or zygote


class CallerRefused(LocalProtocolError):
    """A connection or request the caller may not make; the message says why."""


@dataclasses.dataclass
class Caller:
    """What one connection is bound to.

    Attributes:
        pid, uid: the kernel's credentials of the connecting process.
        job: the job it belongs to; None for an unbound caller of the daemon's own uid.
        rank: the rank its writing ops are bound to, once it used one.
        pins: read pins given to this connection (the only ones it may release).
        refusals: requests of this connection refused so far.
    """

    pid: int
    uid: int
    job: str | None
    rank: int | None = None
    pins: set[int] = dataclasses.field(default_factory=set)
    refusals: int = 0


def outside_world(msg: dict[str, Any], world_max: int) -> str:
    """Why ``msg`` names a rank or world size beyond a world of ``world_max`` ranks ("" when
    it does not)."""
    rank, world = msg.get("rank"), msg.get("world_size")
    if type(rank) is int and not 0 <= rank < world_max:
        return (f"rank {rank} is outside the job's largest world ({world_max} ranks: its "
                "spec's nnodes max x nproc_per_node)")
    if type(world) is int and world > world_max:
        return (f"world size {world} is larger than the job's largest world ({world_max} "
                "ranks: its spec's nnodes max x nproc_per_node)")
    return ""


class RankClaims:
    """The rank each process of a job writes for, held while it has a connection open.

    Every rank a worker names costs the daemon state until the job ends: its progress and step
    history, a slot pair in shared memory, a fetch lock, a "failing" reason. A connection's
    writing ops are bound to the first rank it used (:class:`CallerBinding`), but each new
    connection could claim a new rank, and a rank could be any integer, so one process of the
    job could grow the daemon without bound. So:

    * a rank (and a world size) a request names must lie within the job's largest world, its
      spec's ``nnodes_max x nproc_per_node`` (reads too: a restore after a resize reads old
      ranks, which were within the same spec's world; :func:`outside_world`);
    * the writing ops of every connection of one process are bound to one rank: a process
      claims a rank with its first write, and another connection of the same pid that writes
      for another rank is refused while the claim holds. The claim ends with the process' last
      connection (a pid the kernel reuses later starts afresh).

    The daemon's own uid outside any job is not bound (it is the operator's or a test's tool).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (job, pid) -> [rank, connections of that pid bound to it]
        self._claims: dict[tuple[str, int], list[int]] = {}

    def claim(self, job: str, pid: int, rank: int) -> str:
        """A connection of ``pid`` binds its writes to ``rank``: "" when that is the pid's
        rank (or it had none), else why not. Each successful claim is matched by one
        :meth:`release` when that connection closes."""
        with self._lock:
            held = self._claims.get((job, pid))
            if held is None:
                self._claims[(job, pid)] = [rank, 1]
                return ""
            if held[0] != rank:
                return (f"pid {pid} writes for rank {held[0]} of {job} (on another connection), "
                        f"not rank {rank}: one rank per process")
            held[1] += 1
            return ""

    def release(self, job: str, pid: int) -> None:
        """A connection of ``pid`` that claimed its rank closed."""
        with self._lock:
            held = self._claims.get((job, pid))
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self._claims[(job, pid)]


class CallerBinding:
    """Admits connections and checks every request against its connection's :class:`Caller`
    (``scope``: the job running on this node now)."""

    def __init__(self, scope: Callable[[], JobScope | None]) -> None:
        self._scope = scope
        self.daemon_uid = os.geteuid()  # its processes outside a job are not bound
        self._lock = threading.Lock()
        self.claims = RankClaims()

    def admit(self, pid: int, uid: int) -> Caller:
        """The caller a new connection from ``pid``/``uid`` is bound to.

        Raises:
            CallerRefused: neither the daemon's uid nor a process of the running job.
        """
        scope = self._scope()
        if scope is not None and (uid == scope.uid or uid == self.daemon_uid):
            why = self._not_of_job(pid, scope)
            if not why:
                return Caller(pid, uid, scope.job)
            if uid != self.daemon_uid:
                raise CallerRefused(f"pid {pid} (uid {uid}) is not a process of job {scope.job}: "
                              f"{why}")
        if uid == self.daemon_uid:
            return Caller(pid, uid, None)
        if scope is None:
            raise CallerRefused(f"uid {uid} may not use this elasticd: no job runs here")
        raise CallerRefused(f"uid {uid} may not use this elasticd: job {scope.job} runs as uid "
                      f"{scope.uid}")

    def check(self, caller: Caller, op: str, msg: dict[str, Any]) -> None:
        """Holds ``msg`` to what ``caller`` may do; fills in its job when it names none.

        Raises:
            CallerRefused: the request reaches outside the caller's job or rank, or its job ended.
        """
        if caller.job is None:
            return
        scope = self._scope()
        if scope is None or scope.job != caller.job:
            raise CallerRefused(f"job {caller.job} no longer runs on this node; this connection "
                          "is closed to it")
        job = msg.setdefault("job", caller.job)
        if job != caller.job:
            raise CallerRefused(f"this connection belongs to job {caller.job}, not {job!r:.80}")
        why = outside_world(msg, scope.world_max) if scope.world_max is not None else ""
        if why:
            raise CallerRefused(why)
        if op in BOUND_WRITES:
            rank = msg.get("rank")
            if type(rank) is int:
                with self._lock:
                    first = caller.rank is None
                    if first:
                        caller.rank = rank
                if rank != caller.rank:
                    raise CallerRefused(f"this connection writes for rank {caller.rank} of "
                                  f"{caller.job}, not rank {rank}")
                why = self.claims.claim(caller.job, caller.pid, rank) if first else ""
                if why:
                    caller.rank = None
                    raise CallerRefused(why)
        elif op == "ckpt_release":
            pin = msg.get("pin")
            with self._lock:
                mine = pin in caller.pins
                caller.pins.discard(pin)
            if not mine:
                raise CallerRefused(f"pin {pin!r:.40} was not given to this connection")

    def closed(self, caller: Caller) -> None:
        """``caller``'s connection closed: its process' rank claim loses a connection."""
        if caller.job is not None and caller.rank is not None:
            self.claims.release(caller.job, caller.pid)

    def replied(self, caller: Caller, op: str, reply: dict[str, Any]) -> None:
        """Notes what a successful reply gave the connection (read pins)."""
        if op in _PINNING and reply.get("ok") and type(reply.get("pin")) is int:
            with self._lock:
                caller.pins.add(reply["pin"])

    def _not_of_job(self, pid: int, scope: JobScope) -> str:
        """Why ``pid`` is not a process of ``scope``'s job ("" when it is)."""
        if pid <= 0:
            return "the kernel gave no pid (another pid namespace?)"
        current = pid
        for _ in range(_MAX_DEPTH):
            fields = stat_fields(current)
            if len(fields) < 20:
                break
            if current in scope.roots and fields[19] == str(scope.roots[current]).encode():
                return ""
            current = int(fields[1])  # the kernel's %d: the parent's pid
            if current <= 1:
                break
        return "it does not descend from the job's agent or zygote"
