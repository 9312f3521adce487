"""``@elasticd.in_process``: a training function re-entered in the same worker process after
each re-formation of the job's group (issue 31; docs/in-process-design.md, section 6).

::

    @elasticd.in_process(backend="gloo")
    def train(round: elasticd.Round) -> None:   # re-entered after every re-formation
        ddp = DDP(model)                        # built per round, around the same module
        ...
        round.check()                           # once a step: leave when the agent asks

    train()

elasticd makes the default process group before each call and destroys it after. In a job
submitted with ``elasticctl submit --in-process``, when the group breaks (a peer died: the
pending collective raises; or the agent says ``abort``) the wrapper first shuts down the old
group's connections (:mod:`elasticd.worker.group_sockets`: every peer still waiting on it raises
at once, and a collective this worker is blocked in ends when the agent asks), then leaves the
group completely (the exception and its frames dropped, ``destroy_process_group``, a collection
only if some of its sockets are still open), tells its agent over the worker link
(:mod:`elasticd.local.worker_link`) that it left, waits for the new round's ranks and calls the
function again: the process, its model, its compiled code and its data loader stay. Each
round's group lives on the round's own TCPStore (hosted by its rank 0) under a fresh prefix, so
a rank of an old round can never touch a newer round's keys. Outside that mode, and which
errors end a round rather than the process: docs/in-process-design.md §6.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import logging
import os
import queue
import threading
from typing import Any, Callable, TypeVar

from elasticd.clock import SYSTEM_CLOCK
from elasticd.errors import ElasticdError, LocalProtocolError
from elasticd.listening import wait_listening
from elasticd.local import worker_link as link
from elasticd.worker import dtensor_caches, group_sockets
from elasticd.worker.collective_timeout import FLOOR, CollectiveTimeout, worth_setting

log = logging.getLogger(__name__)

#: Whether this process re-entered its training function after a re-formation (see kept()).
_kept = False


def kept() -> bool:
    """Whether this process is a survivor kept in-process: it re-entered its training function
    after a re-formation (the path its restores report, :meth:`Checkpointer.restore`)."""
    return _kept


def restarted_from() -> tuple[int, int] | None:
    """(rank, world size) of the worker this fresh process replaces on its node, when its agent
    restarted its node's workers into a new round (the fallback, or a local worker's death, in
    an in-process job): that rank's slots in its node's RAM hold the steps it completed, which
    the restore offers as a survivor's own (:meth:`Checkpointer.restore`). None otherwise: a
    first start, a new node, a job not in in-process mode."""
    return link.previous_place(os.environ)


def linked() -> bool:
    """Whether this process's training function runs under an in-process agent (its link is
    set): the only kind of process that restores again, its state kept, after a re-formation."""
    return bool(os.environ.get(link.LINK_ENV))


def staged() -> bool:
    """Whether this process is a staged newcomer still waiting for its first round: its agent
    started it before joining (:data:`~elasticd.local.worker_link.STAGED_ENV`); its rank and
    world size in the environment are torch's placeholders (-1) until the function's entry."""
    return link.staged(os.environ)


T = TypeVar("T")

#: The default collective timeout of a round's group until its steps are learned, seconds (then
#: it is learned: :mod:`elasticd.worker.collective_timeout`; the agent's deadline restarts a
#: survivor stuck longer).
DEFAULT_TIMEOUT = 60.0


class Reformation(ElasticdError):
    """The agent asked this worker to leave its round's group (:meth:`Round.check`)."""


@dataclasses.dataclass
class Round:
    """One entry of the function: the group elasticd made for it.

    Attributes:
        number: the rendezvous round.
        rank, world_size, local_rank: this worker's place in it.
        previous_rank: this process's rank in the round before (None: a fresh process).
        path: ``"first"`` (a fresh process) or ``"in-process"`` (re-entered).
        group_seconds: how long making the group took.
        times: the moments of the re-formation that led to this entry, wall time (empty on a
            fresh process's first entry): the agent's ``learned`` (a member is gone),
            ``reform_started``, ``round_closed``, ``all_left`` (every local worker left the
            old group); this worker's ``left``, ``assigned`` (the assignment arrived) and
            ``group_made``. A staged newcomer's first entry (its agent started it before
            joining the round: :mod:`elasticd.agent.in_process_agent`) has ``ready`` (its
            script reached the function), ``assigned`` and ``group_made``. The training
            function may add its own (``restored``, ...): the per-path timeline the benchmark
            reads.
        collective_timeout: the round's group's collective timeout in force, seconds (learned
            from the steps: :mod:`elasticd.worker.collective_timeout`).
    """

    number: int
    rank: int
    world_size: int
    local_rank: int
    previous_rank: int | None
    path: str
    group_seconds: float
    _asked: Callable[[], str] = dataclasses.field(default=lambda: "", repr=False)
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    collective_timeout: float = 0.0
    _step: Callable[[], float] = dataclasses.field(default=lambda: 0.0, repr=False)

    def check(self) -> None:
        """Call once a step: raises :class:`Reformation` when the agent asked this worker to
        leave the round (a member is gone, or the round re-forms). Each call is also a step
        boundary the collective timeout learns from."""
        self.collective_timeout = self._step() or self.collective_timeout
        why = self._asked()
        if why:
            raise Reformation(why)


def distributed_error(exc: BaseException) -> bool:
    """Whether ``exc`` ends a round rather than the process: torch's ``DistError`` (a peer's
    connection reset or closed, a collective timed out), gloo's ``RuntimeError``s, and
    :class:`Reformation`."""
    import torch.distributed as dist

    if isinstance(exc, (Reformation, dist.DistError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "Connection", "Timed out", "NCCL"))


def in_process(fn: Callable[[Round], T] | None = None, *, backend: str = "gloo",
               timeout: float = DEFAULT_TIMEOUT, floor: float = FLOOR) -> Any:
    """Decorates a training function ``fn(round)``; the wrapper takes no argument and returns
    what the function's last call returns.

    Args:
        backend: the process group's backend (``gloo``; ``nccl`` as torch allows).
        timeout: the collective timeout of each round's group, seconds: in an in-process
            job, of a round's first steps only (and of the round's store); then it is learned
            from the steps, never below ``floor`` (:mod:`elasticd.worker.collective_timeout`).
        floor: the lowest learned collective timeout, seconds.
    """
    def wrap(f: Callable[[Round], T]) -> Callable[[], T]:
        @functools.wraps(f)
        def run() -> T:
            if not linked():
                return _once(f, backend, timeout)
            return _Worker(os.environ[link.LINK_ENV], backend, timeout, floor).run(f)
        return run
    return wrap(fn) if fn is not None else wrap


def _once(fn: Callable[[Round], T], backend: str, timeout: float) -> T:
    """Plain torchrun, or a job not in in-process mode: one group, one call."""
    import torch.distributed as dist

    t0 = SYSTEM_CLOCK.perf_counter()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        return fn(Round(0, dist.get_rank(), dist.get_world_size(),
                        int(os.environ.get("LOCAL_RANK", "0")), None, "first",
                        SYSTEM_CLOCK.perf_counter() - t0, collective_timeout=timeout))
    except BaseException as exc:
        if distributed_error(exc):
            group_broke(exc)  # the restart path learns a dead peer as early as this one
        raise
    finally:
        dist.destroy_process_group()


def group_broke(exc: BaseException) -> bool:
    """Tells the node's daemon (``ELASTICD_SOCKET``) that this worker's collective broke:
    a peer whose daemon's port then refuses connections is recorded failed at once, not when
    its lease expires (:mod:`elasticd.daemon.peer_probe`). One-way; whether it was sent (no
    daemon, or the agent asked the worker out: nothing to tell)."""
    from elasticd.worker.client import SOCKET_ENV, DaemonClient

    path = os.environ.get(SOCKET_ENV, "")
    if not path or isinstance(exc, Reformation):
        return False
    client = DaemonClient(path, timeout=1.0)
    try:
        return client.send("group_broke", why=f"{type(exc).__name__}: {str(exc)[:160]}")
    finally:
        client.close()


class _Worker:
    """The worker's end of the link, and the loop that re-enters the function."""

    def __init__(self, name: str, backend: str, timeout: float, floor: float = FLOOR) -> None:
        pid = os.environ.get(link.LINK_PID_ENV, "")
        self.sock = link.connect(name, int(pid) if pid.isdigit() else None)
        self.backend, self.timeout = backend, timeout
        self.collective = CollectiveTimeout(floor, first=timeout)
        self.applied: float | None = None  # the collective timeout set on the group
        self.round = int(os.environ.get(link.ROUND_ENV, "0"))
        self.asked = ""  # why the agent wants this worker out of its round
        self.assignments: queue.Queue[dict[str, Any]] = queue.Queue()
        #: The live round's group connections (group_sockets), until shut down or the group
        #: destroyed; under the lock: the link's thread shuts them down on an abort.
        self._conns: set[int] = set()
        self._conns_lock = threading.Lock()
        #: A staged worker's moment of readiness (wall time; None: not staged): its script
        #: reached the function, the point where it asks for its round.
        self.ready_at = SYSTEM_CLOCK.wall() if staged() else None
        link.send(self.sock, {"op": "hello", "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                              "pid": os.getpid(), "staged": self.ready_at is not None})
        threading.Thread(target=self._read, daemon=True, name="elasticd-link").start()

    def _read(self) -> None:
        while True:
            try:
                msg = link.recv(self.sock)
            except (OSError, LocalProtocolError):
                msg = None
            if msg is None:  # the agent is gone: torchrun's agent takes its workers with it
                self.asked = "the agent is gone"
                self.assignments.put({})
                return
            op = msg.get("op")
            if op == "abort" and msg.get("round") == self.round:
                self.asked = "the agent asked to leave the round"
                # A collective the main thread is blocked in (a silent peer's, or one waiting
                # on a rank that has not raised yet) ends now, not at its timeout.
                self._end_connections()
            elif op == "assign" and isinstance(msg.get("env"), dict):
                self.assignments.put(msg)

    def run(self, fn: Callable[[Round], T]) -> T:
        global _kept
        import torch.distributed as dist

        path, previous = "first", None
        times: dict[str, float] = {}
        if self.ready_at is not None:
            # Staged: no group, no rank until the round its agent joined after this moment.
            log.info("staged worker pid %d ready: waiting for its first round", os.getpid())
            times = self._assigned("before its first round", ready=self.ready_at)
            os.environ.pop(link.STAGED_ENV, None)
        while True:
            self.round = int(os.environ.get(link.ROUND_ENV, "0"))
            self.asked = ""
            self.collective.round_started()
            t0 = SYSTEM_CLOCK.perf_counter()
            fds = self._make_group()
            if times:
                times["group_made"] = SYSTEM_CLOCK.wall()
                if path != "first":  # a re-formation's moments (a staged start's are the Round's)
                    _report(times)
            info = Round(self.round, dist.get_rank(), dist.get_world_size(),
                         int(os.environ.get("LOCAL_RANK", "0")), previous, path,
                         SYSTEM_CLOCK.perf_counter() - t0, lambda: self.asked, times,
                         self.applied or self.timeout, self._stepped)
            try:
                result = fn(info)
            except BaseException as exc:  # noqa: BLE001 - only a distributed error is kept
                if not distributed_error(exc):
                    raise
                # First: every peer still waiting on this rank raises now, not once this rank
                # has left (the cascade: one whole leave per hop, 50-100 ms each).
                self._end_connections()
                if not self.asked:  # the agent asked: it knows, and the shutdown was ours
                    group_broke(exc)  # the daemon probes while this one cleans up
                # The text is all a timeout shows: torch 2.13's gloo raises a plain
                # RuntimeError ("[.../unbound_buffer.cc:78] Timed out waiting 2000ms for recv
                # operation to complete": bench/results/spikes/inprocess/gloo_timeout.json),
                # the type a peer's reset raises too; DistError has no timeout subclass.
                if "Timed out" in str(exc) and not self.asked:
                    self.collective.fired()  # no member gone: a step longer than learned
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            else:
                self._forget_connections()
                dist.destroy_process_group()
                return result
            # Out of the except clause: the exception, its traceback and the frames holding
            # the round's DDP are gone; only then can the group's sockets close.
            previous = info.rank
            del info
            clean = self._leave(fds)
            left_at = SYSTEM_CLOCK.wall()
            log.warning("rank %d left round %d (%s)%s", previous, self.round, why,
                        "" if clean else "; some of its sockets are still open")
            link.send(self.sock, {"op": "left", "round": self.round, "clean": clean,
                                  "why": why})
            times = self._assigned("during a re-formation", left=left_at)
            path = "in-process"
            _kept = True

    def _assigned(self, when: str, **moments: float) -> dict[str, float]:
        """Waits for the agent's ``assign`` and takes its round's environment; returns the
        re-formation's moments (the agent's, then ``moments`` and ``assigned``)."""
        msg = self.assignments.get()
        if not msg:
            raise SystemExit(f"elasticd: the agent is gone {when}")
        times = {str(k): float(v) for k, v in (msg.get("times") or {}).items()
                 if isinstance(v, (int, float))}
        times.update(moments, assigned=SYSTEM_CLOCK.wall())
        os.environ.update({str(k): str(v) for k, v in msg["env"].items()})
        return times

    def _make_group(self) -> set[int]:
        """The round's default group on its rank 0's TCPStore, under a fresh prefix; returns
        the socket descriptors it opened (checked closed when the group is left)."""
        import torch.distributed as dist

        env = os.environ
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        before = _socket_fds()
        timeout = datetime.timedelta(seconds=self.timeout)
        collective = self.collective.seconds()  # the round's first steps: warm-up
        if rank != 0:
            wait_listening(env["MASTER_ADDR"], int(env["MASTER_PORT"]), self.timeout)
        tcp = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world,
                            is_master=(rank == 0), timeout=timeout, use_libuv=True)
        job = env.get("TORCHELASTIC_RUN_ID", "job")
        store = dist.PrefixStore(f"elasticd/{job}/round/{self.round}/", tcp)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective))
        opened = _socket_fds() - before
        with self._conns_lock:
            self._conns = group_sockets.connections(opened, int(env["MASTER_PORT"]))
        self._applied(collective)
        return opened

    def _stepped(self) -> float:
        """A step boundary (:meth:`Round.check`): learns it and sets the group's collective
        timeout when the value in force moved; returns it."""
        self.collective.step(SYSTEM_CLOCK.monotonic())
        seconds = self.collective.seconds()
        if worth_setting(seconds, self.applied):
            from torch.distributed import distributed_c10d

            distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), None)
            self._applied(seconds)
        return self.applied or seconds

    def _applied(self, seconds: float) -> None:
        """The group's collective timeout is now ``seconds``: the agent's fallback deadline
        follows it (a survivor stuck on a silent peer leaves its group at it)."""
        self.applied = seconds
        try:
            link.send(self.sock, {"op": "timeout", "seconds": round(seconds, 3),
                                  "source": self.collective.source()})
        except OSError:
            pass  # the agent is gone: the reader thread says so

    def _end_connections(self) -> None:
        """Shuts down the live round's group connections, once (any thread)."""
        with self._conns_lock:
            conns, self._conns = self._conns, set()
            group_sockets.shut_down(conns)

    def _forget_connections(self) -> None:
        """Before the group is destroyed: its descriptors close then, and their numbers may
        be reused, so the link's thread must not shut them down any more."""
        with self._conns_lock:
            self._conns = set()

    def _leave(self, fds: set[int]) -> bool:
        """Leaves the default group completely; whether its sockets are all closed (one held
        open keeps the old group's objects, its threads and buffers, alive).

        The group is usually freed by reference counting once the round's frames are gone,
        and ``destroy_process_group`` closes its sockets at once; a collection, which walks
        the whole heap (~60 ms in a torch worker, on every rank at the same moment), runs
        only when some are still open (a reference cycle holds the group)."""
        import torch.distributed as dist

        self._forget_connections()
        dist.destroy_process_group()
        # DTensor's caches hold a process's first FSDP2 round's mesh, and so its group, for
        # good (dtensor_caches); emptied before the check, which still catches any other hold.
        dtensor_caches.forget()
        if fds & _socket_fds():
            gc.collect()
        return not (fds & _socket_fds())


def _report(times: dict[str, float]) -> None:
    """Tells the node's daemon this re-formation's moments (one-way, ``reform_moments``): its
    recovery timeline keeps them (:mod:`elasticd.cluster.timeline`, the in-process path's
    phases). Over the process's shared connection, which stays open: a worker connection that
    closes is read as the worker's exit."""
    from elasticd.worker import default_client

    client = default_client()
    if client is not None:
        client.send("reform_moments", times=dict(times),
                    **({"job": os.environ["ELASTICD_JOB"]} if os.environ.get("ELASTICD_JOB")
                       else {}))


def _socket_fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:
            pass
    return out
