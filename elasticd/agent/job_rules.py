"""What a job does on this node, as pure decisions: which job runs, whether it starts now, when
a running one stops, what a dead agent or a failed peer means for the workers, whether a
straggler drains, and what the job's nodes' statuses say (the group's ranks, who writes a
recovery's timeline).

Nothing here does I/O, takes a lock or reads a clock: the job manager
(:mod:`elasticd.agent.manager`) gathers what was observed (the job records in etcd, the agent's
exit code, the last rendezvous round, ``now``) and carries out the answer through its parts. The other rules of a job on a node are pure modules of their
own: crash loops (:mod:`elasticd.agent.crashloop`), hangs (:mod:`elasticd.agent.progress`),
stragglers (:mod:`elasticd.agent.straggler`), refusals and waits (:mod:`elasticd.agent.job_holds`).
Each rule is tested alone in ``tests/unit/test_job_rules.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import signal
from typing import Callable, Iterable

from elasticd.agent.job_holds import JobHolds
from elasticd.cluster.jobspec import DEFAULT_REFORM_DEADLINE, JobState, NodeJobStatus


@dataclasses.dataclass(frozen=True)
class JobView:
    """The job records as this node sees them, reduced to what the decisions read.

    Attributes:
        created: job -> its spec's create revision (readable or not): the older, the first.
        desired: job -> what its control asks (absent: running).
        reasons: job -> the reason its control gives.
        unreadable: job -> why its spec does not read.
        finished: jobs this node completed or gave up on.
        succeeded_elsewhere: jobs another node's agent finished with success.
    """

    created: dict[str, int]
    desired: dict[str, JobState]
    reasons: dict[str, str]
    unreadable: dict[str, str]
    finished: frozenset[str]
    succeeded_elsewhere: frozenset[str]


def wanted(view: JobView, running: str | None, hold: str,
           held: Callable[[str], bool]) -> str | None:
    """The job this node should run: the oldest wanted job it has not finished.

    Args:
        hold: why the node runs no job for now (a drain), or "".
        held: whether a job other than ``running`` is left aside (refused, or waiting for
            its files): :class:`elasticd.agent.job_holds.JobHolds`.
    """
    if hold:
        return None
    for job in sorted(view.created, key=lambda j: (view.created[j], j)):
        if view.desired.get(job, JobState.RUNNING) != JobState.RUNNING:
            continue
        if job in view.finished or (job != running and job in view.succeeded_elsewhere):
            continue  # a running agent here ends on its own (its exit is judged)
        if job != running and held(job):
            continue
        return job
    return None


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop the running job: ``why``, and the state it ends in on this node."""

    why: str
    state: JobState


def stop_running(view: JobView, running: str, wanted_job: str | None, hold: str) -> Stop | None:
    """Whether the job this node runs stops, and why (None: it goes on)."""
    if running in view.unreadable:
        return Stop(view.unreadable[running], JobState.REFUSED)
    if running == wanted_job:
        return None
    if hold:
        return Stop(f"node {hold}", JobState.DRAINED)
    if view.desired.get(running) == JobState.FAILED:
        return Stop(view.reasons.get(running) or f"job {running} failed", JobState.FAILED)
    return Stop(f"job {running} is no longer wanted here", JobState.STOPPED)


def decided_elsewhere(view: JobView, job: str) -> tuple[JobState, str] | None:
    """A job this node was about to restart (its agent died) that succeeded on a peer
    meanwhile, or was failed (a crash loop seen here or elsewhere): its final state here and
    why; None while it is still to be restarted."""
    if job in view.finished:
        return None
    if job in view.succeeded_elsewhere:
        return JobState.SUCCEEDED, ""
    if view.desired.get(job) == JobState.FAILED:
        return JobState.FAILED, view.reasons.get(job, "")
    return None


class AgentExit(enum.Enum):
    """What a dead agent means for its job on this node."""

    SUCCEEDED = "succeeded"  # exit 0: the job is done here
    SUCCEEDED_ELSEWHERE = "succeeded elsewhere"  # a peer's agent finished the job
    GIVE_UP = "give up"  # more deaths than ``agent_restarts``: failed here
    RESTART = "restart"  # start the agent again after a backoff


@dataclasses.dataclass
class JobBook:
    """What this node decided about its jobs so far, which its rules read back (no I/O).

    Attributes:
        finished: jobs this node completed (exit 0) or gave up on: not started here again.
        holds: jobs left aside for now (refused, or waiting for their files).
        deaths: the deaths of ``dying``'s agent counted against ``agent_restarts``: those since
            the job last committed a newer step (:meth:`agent_died`).
        dying: the job ``deaths`` and ``not_before`` are about.
        progress: ``dying``'s newest committed (generation, step) at its agent's last death.
        not_before: no agent of ``dying`` starts before this (monotonic): the backoff after a
            death.
        reform_by: the deadline (monotonic) of an in-process re-formation under way, or None.
    """

    finished: set[str] = dataclasses.field(default_factory=set)
    holds: JobHolds = dataclasses.field(default_factory=JobHolds)
    deaths: int = 0
    dying: str | None = None
    progress: tuple[int, int] | None = None
    not_before: float = 0.0
    reform_by: float | None = None

    def reform_started(self, now: float, deadline: float = DEFAULT_REFORM_DEADLINE) -> None:
        """A peer failed and the job's agent re-forms in-process: the daemon restarts the
        workers itself if the agent has not said it is done by ``reform_by``: the agent's
        ``deadline`` (the job's ``reform_deadline``) plus :data:`REFORM_ROUND_ALLOWANCE` (the
        earliest failure's holds: a second failure does not push it back)."""
        by = now + deadline + REFORM_ROUND_ALLOWANCE
        self.reform_by = by if self.reform_by is None else min(self.reform_by, by)

    def reform_ended(self) -> None:
        """The agent re-formed its workers, in-process or by restarting them."""
        self.reform_by = None

    def reform_overdue(self, now: float) -> bool:
        """Whether the re-formation's deadline passed (once: it is forgotten then)."""
        if self.reform_by is None or now < self.reform_by:
            return False
        self.reform_by = None
        return True

    def agent_died(self, job: str, committed: tuple[int, int] | None) -> int:
        """Counts a death of ``job``'s agent (``committed``: the job's newest committed
        (generation, step) now, None if none is known); returns the count.

        The budget is one job's, and a restart that worked renews it: another job's deaths do
        not count (they did, for as long as the daemon ran), and neither do this job's from
        before it committed a newer step, as the crash-loop rule counts restarts
        (:mod:`elasticd.agent.crashloop`). A weeks-long job whose agent dies now and then for
        reasons outside it (a long etcd outage ends the agent's rendezvous) is not given up on
        its eleventh death; one that dies without progress still is. A job that commits nothing
        keeps one budget while it runs here.
        """
        if job != self.dying:
            self.dying, self.deaths, self.progress = job, 0, committed
        elif committed is not None and (self.progress is None or committed > self.progress):
            self.deaths, self.progress = 0, committed
        self.deaths += 1
        return self.deaths

    def not_before_for(self, job: str) -> float:
        """When ``job``'s agent may start: the backoff is the dying job's, not the next one's."""
        return self.not_before if job == self.dying else 0.0

    def agent_exited(self, code: int, succeeded_elsewhere: bool, agent_restarts: int,
                     now: float) -> AgentExit:
        """:func:`agent_exited`, the death already counted; a restart waits its backoff."""
        verdict = agent_exited(code, succeeded_elsewhere, self.deaths, agent_restarts)
        if verdict is AgentExit.RESTART:
            self.not_before = now + restart_backoff(self.deaths)
        return verdict


#: The longest wait before an agent is started again.
MAX_BACKOFF = 30.0


def agent_exited(code: int, succeeded_elsewhere: bool, failures: int,
                 agent_restarts: int) -> AgentExit:
    """The agent exited with ``code``; ``failures`` counts its deaths so far, this one
    included (the crash-loop rule is asked first, :mod:`elasticd.agent.crashloop`).

    A job that succeeded on a peer is over here too: torch closes the rendezvous when an agent
    succeeds, and a standby's agent (or one restarting) then exits with an error that is no
    reason to start it again.
    """
    if code == 0:
        return AgentExit.SUCCEEDED
    if succeeded_elsewhere:
        return AgentExit.SUCCEEDED_ELSEWHERE
    if failures > agent_restarts:
        return AgentExit.GIVE_UP
    return AgentExit.RESTART


def restart_backoff(failures: int) -> float:
    """Seconds before the agent is started again after its ``failures``-th death."""
    return min(MAX_BACKOFF, 0.5 * 2 ** (failures - 1))


class PeerFailure(enum.Enum):
    """What a failed peer means for this node's workers."""

    NOT_OURS = "not ours"  # no job here, or the peer did not run it
    LEFT_RUNNING = "left running"  # the last rendezvous round already went on without it
    RESTART = "restart"  # kill the workers now (the proactive abort)
    REFORM = "reform"  # in-process job: the agent re-forms its live workers, by a deadline


def peer_failed(running: bool, peer: str, members: Iterable[str],
                reformed_without: Callable[[], bool], in_process: bool = False) -> PeerFailure:
    """A peer's lease expired (``peer`` "*": every peer). Its workers may be blocked in a
    collective with the dead one, and a machine that loses power sends no TCP reset (gloo
    would wait minutes): the workers are restarted at once, unless the job's last rendezvous
    round already has this node's agent in it and not the peer's (``reformed_without``, asked
    only when it matters: it reads etcd).

    A job in in-process mode (``in_process``) is not killed for one failed peer: its agent
    aborts its workers' group and re-forms them in-process (:mod:`.in_process_agent`), and the
    daemon keeps a deadline (:meth:`JobBook.reform_started`) after which it restarts them as
    today. Every peer at once ("*") is today's restart in either mode."""
    if not running or (peer != "*" and peer not in set(members)):
        return PeerFailure.NOT_OURS
    if peer != "*" and reformed_without():
        return PeerFailure.LEFT_RUNNING
    return PeerFailure.REFORM if in_process and peer != "*" else PeerFailure.RESTART


#: What a daemon sends its in-process agent when it decided :attr:`PeerFailure.REFORM`: the
#: agent re-forms at once (:func:`elasticd.agent.in_process_agent.install`) instead of when
#: the rendezvous' summary of the death reaches it through etcd (20-60 ms later, measured).
#: SIGWINCH: ignored by default, so an agent that never installed a handler (an older one,
#: or one still starting) is not killed by it.
PEER_FAILED_SIGNAL = signal.SIGWINCH

#: The daemon's backstop (:meth:`JobBook.reform_started`): the agent's deadline, plus this
#: much for it to notice the failure and close its round. Past it, the daemon restarts the
#: workers itself (the agent never re-formed nor fell back: it may be stuck).
REFORM_ROUND_ALLOWANCE = 20.0


def reform_wait(deadline: float, collective_timeout: float | None) -> tuple[float, str]:
    """How long an agent waits, after its round, for its workers to leave the old group, and
    what set it: the job's ``deadline`` (its ``reform_deadline``), or the workers' collective
    timeout when shorter (each reported it: ``collective_timeout``, the longest of the node's
    workers; None while one has not). A survivor stuck on a frozen or partitioned peer leaves
    when its pending collective times out, and that collective began before the failure was
    recorded (a lease TTL or more before the round closed), so it has left by then or is stuck
    for another reason: waiting longer only delays the fallback
    (:mod:`elasticd.worker.collective_timeout`)."""
    if collective_timeout is not None and 0 < collective_timeout < deadline:
        return collective_timeout, f"the workers' collective timeout {collective_timeout:g} s"
    return deadline, f"the job's reform deadline {deadline:g} s"


class Reform(enum.Enum):
    """Where an agent's in-process re-formation stands, after its rendezvous round."""

    ASSIGN = "assign"  # every local worker left the old group cleanly: hand them the new round
    WAIT = "wait"  # not all have left yet, and the deadline has not passed
    RESTART = "restart"  # fall back: restart the node's workers into the round, as today


def can_reform(local_world: int, alive: bool, linked: Iterable[int]) -> str:
    """Why a node's workers cannot re-form in-process ("" when they can): each of the
    ``local_world`` workers must be alive and linked (a script without
    ``@elasticd.in_process`` never links: its node takes today's path at every failure)."""
    if not alive:
        return "a local worker is not running"
    missing = sorted(set(range(local_world)) - set(linked))
    if missing:
        return (f"local ranks {missing} are not linked to the agent (no @elasticd.in_process "
                "in the script, or not started yet)")
    return ""


def all_left(local_world: int, current_round: int,
             left: dict[int, tuple[int, bool, str]]) -> bool:
    """Whether every one of the node's ``local_world`` workers has left ``current_round``'s
    group on its own (its collective raised: a peer's process died, or the collective timed
    out). The group is broken for all of them then, whatever the rendezvous knows yet: the
    agent joins the next round at once, as a restarted node would (its workers would have
    exited), so the round closes as soon as the dead member's record goes, rather than after
    the rendezvous counts it dead and the agent next asks."""
    done = {r for r, v in left.items() if v[0] == current_round and r < local_world}
    return local_world > 0 and len(done) == local_world


def reform_step(local_world: int, old_round: int, left: dict[int, tuple[int, bool, str]],
                alive: bool, now: float, deadline: float) -> tuple[Reform, str]:
    """What an agent does next in a re-formation, and why (for a fallback).

    Args:
        local_world: the node's local workers (local ranks 0..n-1).
        old_round: the round they are to leave.
        left: local rank -> (round it last left, whether cleanly, why) from its ``left``.
        alive: every local worker process still runs.
        now, deadline: monotonic seconds; the deadline is the round's end plus the job's
            ``reform_deadline``: a worker stuck longer is restarted as today.
    """
    if not alive:
        return Reform.RESTART, "a local worker died during the re-formation"
    done = {r: v for r, v in left.items() if v[0] == old_round and r < local_world}
    unclean = sorted(r for r, v in done.items() if not v[1])
    if unclean:
        return Reform.RESTART, f"local rank {unclean[0]} could not leave: {done[unclean[0]][2]}"
    if len(done) == local_world:
        return Reform.ASSIGN, ""
    if now >= deadline:
        stuck = sorted(set(range(local_world)) - set(done))
        return Reform.RESTART, (f"local ranks {stuck} did not leave round {old_round} by the "
                                "deadline")
    return Reform.WAIT, ""


def reformed_without(round_agent_pids: Iterable[int] | None, mine: int | None,
                     theirs: int | None) -> bool:
    """Whether the last closed round (its members' agent pids; None: no round, or one that
    does not read) has this node's agent (``mine``) and not the failed peer's (``theirs``).
    Unknown pids mean no: abort, as a peer that vanished silently leaves collectives hanging."""
    if not mine or not theirs or round_agent_pids is None:
        return False
    pids = set(round_agent_pids)
    return mine in pids and theirs not in pids


class Start(enum.Enum):
    """Whether the job wanted here starts now."""

    LATER = "later"  # the backoff after the agent's last death runs
    REFUSE = "refuse"  # it cannot run here (the reason says why)
    CHECKING = "checking"  # its files are being checked off the main loop
    WAIT = "wait"  # its files are not on this node yet
    GO = "go"  # start its agent


def start(now: float, not_before: float, unreadable: str | None,
          check: Callable[[], tuple[str, bool] | None]) -> tuple[Start, str]:
    """Whether the wanted job's agent starts now, and why not.

    Args:
        now, not_before: monotonic seconds; no agent starts before ``not_before`` (backoff).
        unreadable: why its spec does not read, or None.
        check: the check of its files on this node (:mod:`elasticd.agent.job_check`, asked
            only when it matters: it may start one): (problem, "" if none; whether the problem
            may go away by itself), or None while it runs.
    """
    if now < not_before:
        return Start.LATER, ""
    if unreadable is not None:
        return Start.REFUSE, unreadable
    answer = check()
    if answer is None:
        return Start.CHECKING, ""
    problem, waiting = answer
    if waiting:
        return Start.WAIT, problem
    return (Start.REFUSE, problem) if problem else (Start.GO, "")


def still_waited(view: JobView, job: str, hold: str) -> bool:
    """Whether a job this node waits for (its files not deployed yet) is still wanted here:
    its spec reads, the node is not held, its control asks it to run."""
    return (job in view.created and job not in view.unreadable and not hold
            and view.desired.get(job, JobState.RUNNING) == JobState.RUNNING)


def drain_straggler(asked: bool, others_running: int, nnodes_min: int) -> bool:
    """Whether a node newly named a straggler asks for its own drain: when its job asks for it
    (``straggler_drain``), and not below the job's minimum of nodes."""
    return asked and others_running >= nnodes_min


def ran_workers(status: NodeJobStatus) -> bool:
    """Whether a node ran workers of the job (ranks, or a step, in its published status): a
    worker group restart empties its ranks for a moment, its step stays; a spare never ran."""
    return bool(status.ranks) or status.last_step >= 0


def round_ranks(statuses: dict[str, NodeJobStatus], world: int) -> dict[str, list[int]]:
    """The current worker group's nodes and their global ranks (``statuses``: every node's,
    this one's included), once every node of it has published them: they agree on the world
    size and the ranks add up to it. Empty until then."""
    group = {n: st.ranks for n, st in statuses.items()
             if st.state == JobState.RUNNING and st.world_size == world and st.ranks}
    if not world or sorted(r for rs in group.values() for r in rs) != list(range(world)):
        return {}
    return group


def recovery_writer(statuses: dict[str, NodeJobStatus], live: Iterable[str],
                    failed: str) -> str | None:
    """The node that writes the timeline of the job's recovery from ``failed``'s failure
    (:mod:`elasticd.daemon.recovery_timeline`): the lowest node id among the job's other live
    nodes (``live``) that ran workers, else among its other live nodes (a spare never ran any).
    Every survivor computes it from the same statuses in etcd."""
    live = {n: st for n, st in statuses.items() if n != failed and n in set(live)}
    ran = [n for n, st in live.items() if ran_workers(st)]
    return min(ran or live, default=None)
