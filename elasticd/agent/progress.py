"""Hang detection from workers' progress reports: pure decisions on an injected clock.

Every worker reports the step it reached (:func:`elasticd.worker.progress`, one-way over the
local API). A worker group is hung when a rank that has reported before makes no progress for
its timeout — a collective waiting for a dead peer, a deadlock, a stuck data loader; nothing
is decided before a group's first report (a restarted group may wait long in its rendezvous for
nodes, and a job may take long to load its data). The timeout is either set (``--hang-timeout``)
or learned from the job's step intervals (:mod:`elasticd.cluster.learned_timeout`: a multiple of
the longest recent interval, with a floor, and an allowance for each worker process's first
steps).
:meth:`ProgressTracker.check` only says so, as a :class:`Hang` value; killing and restarting the
group, and recording the reason, is the daemon's job.

Progress means a *different* step or a new process for that rank, not only a larger step: a
script may count steps per epoch, and a restarted worker resumes from an older step; neither is
a hang. A report that repeats the same step is a sign of life but not progress.

A report may carry the rank's compute time of the step outside collectives
(:class:`elasticd.worker.compute_time.ComputeTimer`): the tracker keeps each rank's last
:data:`COMPUTE_WINDOW` and reports their median (per rank in ``/status``, and the node's: the
median of its ranks'), which is what tells a slow node apart in synchronous training.

After :meth:`ProgressTracker.reset` (workers restarted), reports from the processes of the
previous generation are ignored: one still in the socket when its sender was killed must not
count as the new generation's first report.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import threading
from typing import Any, Callable

from elasticd.cluster.learned_timeout import WARMUP_STEPS, LearnedTimeout, StepHistory
from elasticd.clock import Clock
from elasticd.local.wire import RequestError

_MAX_RETIRED_PIDS = 4096
#: Compute times kept per rank: the median of 50 steps is steady against one slow step.
COMPUTE_WINDOW = 50


@dataclasses.dataclass(frozen=True)
class StalledRank:
    """One rank that has not progressed.

    Attributes:
        pid: the process that reported it (None if not given).
        seconds: how long since it last progressed.
    """

    rank: int
    last_step: int
    pid: int | None
    seconds: float


@dataclasses.dataclass(frozen=True)
class Hang:
    """A hung worker group: ranks that reported before and have not progressed since.

    Attributes:
        reason: a short sentence, e.g. ``"no progress for 30 s"``.
        ranks: the stalled ranks, by rank.
        learned: the timeout was the learned one (a restart for it doubles it).
    """

    job: str
    reason: str
    ranks: tuple[StalledRank, ...]
    learned: bool = False

    def __str__(self) -> str:
        stalled = ", ".join(f"rank {r.rank} at step {r.last_step} for {r.seconds:.1f} s"
                            for r in self.ranks[:8])
        more = f" and {len(self.ranks) - 8} more" if len(self.ranks) > 8 else ""
        return f"job {self.job}: {self.reason}: {stalled}{more}"


@dataclasses.dataclass
class _Rank:
    step: int
    pid: int | None
    progressed_at: float
    reported_at: float
    steps: int = 0  # steps this process completed since its first report
    compute: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=COMPUTE_WINDOW))


@dataclasses.dataclass
class _Job:
    started_at: float
    ranks: dict[int, _Rank] = dataclasses.field(default_factory=dict)
    retired_pids: set[int] = dataclasses.field(default_factory=set)


class ProgressTracker:
    """The last step of every rank of every job on this node, and whether a group is hung.

    Thread-safe: reports arrive on the local API's connection threads, checks come from the
    daemon's loop.

    Args:
        hang_timeout: seconds without progress of a rank that makes its group hung (set by
            hand), or a :class:`LearnedTimeout`: the timeout is learned from each job's step
            intervals.
        alive: says whether a reporting process still exists (None: assume so). A rank whose
            process is gone is not stalled but restarting: torchrun restarts a group whose
            worker died, or that a joining node re-forms, and the rendezvous and restore that
            follow may take longer than any timeout learned from steps.

    Raises:
        ValueError: a timeout is not positive.
    """

    def __init__(self, hang_timeout: float | LearnedTimeout, clock: Clock,
                 alive: Callable[[int], bool] | None = None) -> None:
        if isinstance(hang_timeout, LearnedTimeout):
            self.learned: LearnedTimeout | None = hang_timeout
            self.hang_timeout: float | None = None
        else:
            if not hang_timeout > 0:
                raise ValueError(f"hang_timeout must be positive seconds, got {hang_timeout!r}")
            self.learned, self.hang_timeout = None, float(hang_timeout)
        self._clock = clock
        self._alive = alive
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._histories: dict[str, StepHistory] = {}  # learned step times, across resets

    def _history(self, job: str) -> StepHistory:
        history = self._histories.get(job)
        if history is None:
            assert self.learned is not None
            history = self._histories[job] = StepHistory()
        return history

    def _limit(self, job: str, r: _Rank) -> float:
        """The seconds ``r`` may go without progress (under the lock)."""
        if self.learned is None:
            assert self.hang_timeout is not None
            return self.hang_timeout
        history = self._history(job)
        if r.steps < WARMUP_STEPS or history.longest() is None:
            return self.learned.warmup_timeout(history)
        return self.learned.timeout(history)

    def report(self, job: str, rank: int, step: int, pid: int | None = None,
               compute_seconds: float | None = None) -> bool:
        """Records that ``rank`` of ``job`` reached ``step`` (and, optionally, the step's
        compute time outside collectives).

        Returns:
            False when the report was ignored: it came from a process of the generation
            before the last :meth:`reset`.
        """
        now = self._clock.monotonic()
        with self._lock:
            state = self._jobs.get(job)
            if state is None:  # a report before any reset: the job started then
                state = self._jobs[job] = _Job(started_at=now)
            if pid is not None and pid in state.retired_pids:
                return False
            last = state.ranks.get(rank)
            if last is None or last.pid != pid:  # a new process: its first steps warm up
                state.ranks[rank] = _Rank(step, pid, progressed_at=now, reported_at=now)
            elif last.step != step:
                interval = now - last.progressed_at
                last.step, last.progressed_at, last.reported_at = step, now, now
                last.steps += 1
                if self.learned is not None and last.steps > WARMUP_STEPS:
                    self._history(job).observe(rank, interval)
            else:
                last.reported_at = now
            if compute_seconds is not None and math.isfinite(compute_seconds) \
                    and compute_seconds >= 0:
                state.ranks[rank].compute.append(float(compute_seconds))
            return True

    def reset(self, job: str) -> None:
        """Forgets ``job``'s ranks (its workers were restarted) and its start's clock."""
        now = self._clock.monotonic()
        with self._lock:
            old = self._jobs.get(job)
            retired: set[int] = set()
            if old is not None:
                retired = {r.pid for r in old.ranks.values() if r.pid is not None}
                if len(old.retired_pids) + len(retired) <= _MAX_RETIRED_PIDS:
                    retired |= old.retired_pids
            self._jobs[job] = _Job(started_at=now, retired_pids=retired)

    def restarted_for(self, hang: Hang) -> None:
        """The group was restarted for ``hang``: a learned timeout that fired is doubled
        for the job (a long step the window had not seen costs one restart, not a loop)."""
        if not hang.learned or self.learned is None:
            return
        with self._lock:
            self.learned.fired(self._history(hang.job))

    def timeout(self, job: str) -> tuple[float, str]:
        """The timeout in force for ``job``'s ranks past their first steps, and where it
        comes from: ``"set"`` (by hand), ``"learned"`` (from the step times), ``"floor"``
        (learned, but the floor is higher) or ``"first_step"`` (nothing learned yet: the
        first-step allowance holds)."""
        if self.learned is None:
            assert self.hang_timeout is not None
            return self.hang_timeout, "set"
        with self._lock:
            history = self._history(job)
            if history.longest() is None:
                return self.learned.warmup_timeout(history), "first_step"
            return self.learned.timeout(history), self.learned.source(history)

    def check(self, job: str) -> Hang | None:
        """Returns the hang of ``job``'s worker group, or None while it progresses (or is
        unknown). Pure: calling it again returns the same answer until something changes."""
        now = self._clock.monotonic()
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                return None
            learned = self.learned is not None
            if not state.ranks:
                return None
            found = []  # (stalled rank, its limit, whether in its first steps)
            for rank, r in sorted(state.ranks.items()):
                limit = self._limit(job, r)
                if now - r.progressed_at >= limit:
                    found.append((StalledRank(rank, r.step, r.pid, now - r.progressed_at),
                                  limit, r.steps < WARMUP_STEPS))
        # Outside the lock: whether a process exists is a look at /proc.
        if self._alive is not None:
            found = [f for f in found if f[0].pid is None or self._alive(f[0].pid)]
        if not found:
            return None
        stalled = tuple(f[0] for f in found)
        limit = min(f[1] for f in found)
        warm = any(f[2] for f in found)
        shown = f"{limit:.0f}" if limit >= 100 else f"{limit:.3g}"
        reason = (f"no progress for {shown} s (learned hang timeout"
                  f"{', first steps' if warm else ''})" if learned
                  else f"no progress for {limit:g} s")
        return Hang(job, reason, stalled, learned=learned)

    def compute_seconds(self, job: str) -> float | None:
        """This node's compute time per step for ``job``: the median over its ranks of each
        rank's median of its last compute times; None when no rank measures it."""
        with self._lock:
            state = self._jobs.get(job)
            medians = [] if state is None else [statistics.median(r.compute)
                                                for r in state.ranks.values() if r.compute]
        return statistics.median(medians) if medians else None

    def status(self, job: str) -> dict[str, Any]:
        """A JSON-able summary for ``/status``: each rank's last step and how long ago it
        progressed and reported, the job's last step and its longest stall."""
        now = self._clock.monotonic()
        with self._lock:
            state = self._jobs.get(job)
            ranks = [] if state is None else [
                {"rank": rank, "step": r.step, "pid": r.pid,
                 "seconds_since_progress": round(now - r.progressed_at, 3),
                 "seconds_since_report": round(now - r.reported_at, 3),
                 "timeout_seconds": round(self._limit(job, r), 3),
                 "compute_seconds": (round(statistics.median(r.compute), 4) if r.compute
                                     else None)}
                for rank, r in sorted(state.ranks.items())]
            started = None if state is None else round(now - state.started_at, 3)
            learned = (None if self.learned is None
                       else self.learned.status(self._history(job)))
        timeout, source = self.timeout(job)
        compute = self.compute_seconds(job)
        return {
            "job": job,
            "ranks": ranks,
            "last_step": min((r["step"] for r in ranks), default=None),
            "seconds_since_progress": max((r["seconds_since_progress"] for r in ranks),
                                          default=None),
            "seconds_since_start": started,
            "hang_timeout_seconds": round(timeout, 3),
            "hang_timeout_source": source,
            "startup_timeout_seconds": None,  # a /status key; no start-up deadline
            "learned": learned,
            "compute_seconds": None if compute is None else round(compute, 4),
        }


def progress_handler(tracker: ProgressTracker,
                     default_job: str | None = None) -> Callable[[dict[str, Any]], None]:
    """The local API handler for ``progress`` messages (:meth:`DaemonClient.progress`).

    The pid is the one the kernel reports for the connection (``_peer``), not the one the
    message claims.

    Args:
        default_job: the job to file reports without a ``job`` under (a node runs one job).

    Raises (from the handler):
        RequestError: a field is missing or of the wrong type.
    """
    def handle(msg: dict[str, Any]) -> None:
        job, rank, step = msg.get("job") or default_job, msg.get("rank"), msg.get("step")
        if not isinstance(job, str):
            raise RequestError("progress without a job (is ELASTICD_JOB set for the workers?)")
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise RequestError(f"progress needs an integer rank, got {rank!r} (is RANK set, "
                               "i.e. does the worker run under torchrun?)")
        if not isinstance(step, int) or isinstance(step, bool):
            raise RequestError(f"progress needs an integer step, got {step!r}")
        compute = msg.get("compute_seconds")
        if compute is not None and (isinstance(compute, bool)
                                    or not isinstance(compute, (int, float))
                                    or not math.isfinite(compute) or compute < 0):
            raise RequestError("progress: compute_seconds must be a finite number >= 0, got "
                               f"{compute!r}")
        peer = msg.get("_peer") or {}
        pid = peer.get("pid", msg.get("pid"))
        tracker.report(job, rank, step, pid if isinstance(pid, int) else None,
                       None if compute is None else float(compute))

    return handle
