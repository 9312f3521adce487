"""The follower of an acknowledged, not yet committed local version (see
:mod:`elasticd.replication.tracker`): it waits until the commit book decides the version, and
asks the job's commit coordinator whether the version is hopeless only when an answer can pay
off.

A version waits for its commit (its copies stay in their slots meanwhile) until it is
committed, abandoned, or to be withdrawn: at once when the coordinator says it can never commit
(another owner skipped it, or has a newer version without it), or ``withdraw_after`` after its
first acknowledgement when a local snapshot is blocked by it, on a coordinator's word given
after that deadline (:meth:`~elasticd.replication.commit_state.CommitBook.verdict`).

Each question is a report the coordinator decodes and weighs, so the follower asks:

* before the deadline, once, shortly before this node's next snapshot wants the slot
  (:meth:`~elasticd.replication.commit_state.CommitBook.ask_at`): a hopeless version withdrawn
  then frees it in time. Most versions are committed before that and never ask. The report
  carrying a new version asks about every waiting one too, and a reply naming one hopeless
  wakes its follower at once, whenever it comes;
* past the deadline of a version that blocks a snapshot, at once (a withdrawal waits for an
  answer given after the deadline), then every :data:`ASK_AT_MOST` while none comes.

A follower holds a thread of the tracker's pool while it runs, so it starts only when it may
have to act: a version that blocks a snapshot at once, every other one (all of them, in steady
training) :data:`START_AHEAD` before its question is due, by the reporter's tick
(:func:`start_due`), or at once when a reply names it hopeless. Most versions are committed
before then and are never followed by a thread: none waits for the commit, holding a pool thread
that the node's reports and pushes need (2 threads on a daemon), and none is woken by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticd.replication.api import Version
from elasticd.replication.commit_state import Verdict

if TYPE_CHECKING:
    from elasticd.replication.commit_state import CommitBook
    from elasticd.replication.tracker import CommitTracker

#: Seconds before a version's next snapshot (or its deadline) at which its follower asks: the
#: answer's round trip, and a withdrawal's etcd write, fit in it.
ASK_LEAD = 0.1
#: Past the deadline, seconds between two questions while no coordinator answers.
ASK_AT_MOST = 0.8
#: Seconds between two looks past the deadline (cheap: the commit book, no question).
LOOK_EVERY = 0.05
#: Seconds before its first look at which a version's follower starts, by the reporter's tick:
#: the shortest time between two ticks (reporter.TICK), so that the tick before the look starts
#: it. A tick planned for later than the look is brought forward (``Reporter.tick_by``).
START_AHEAD = 0.1


def followers_due(book: "CommitBook", waiting: dict[Version, float],
                  now: float) -> tuple[list[tuple[Version, float]], float]:
    """Of the versions whose follower has not started (``waiting``: each one's first look,
    its question's time as known when acknowledged; updated in place): those whose follower starts now, their first look
    within :data:`START_AHEAD`; and when the next of the others is due (inf: none). A version
    decided meanwhile (committed, most of them) leaves ``waiting`` unfollowed: its follower
    would only have found it decided."""
    due, next_at = [], float("inf")
    for version, look in list(waiting.items()):
        if book.ask_at(version, ASK_LEAD) == float("-inf"):  # no longer in the book: decided
            del waiting[version]
        elif look - START_AHEAD <= now:
            del waiting[version]
            due.append((version, look))
        else:
            next_at = min(next_at, look - START_AHEAD)
    return due, next_at


def start(t: "CommitTracker", job: str, version: Version, look: float = float("-inf"),
          hopeless: bool = False) -> None:
    """Starts the follower of ``version`` on the tracker's pool (see :func:`follow` for
    ``look`` and ``hopeless``). Not counted by ``wait_idle``: a version waiting for a commit
    that may never come is not work in progress."""
    t.submit(follow, t, job, version, look, hopeless, track=False)


def start_due(t: "CommitTracker", now: float) -> float:
    """Starts the followers that may have to act before the next tick (the reporter's tick
    calls it); returns when the next one is due (inf: none waits to start)."""
    next_at = float("inf")
    with t.lock:
        for job, st in t.jobs.items():
            if st.unstarted:
                due, at = followers_due(st.book, st.unstarted, now)
                next_at = min(next_at, at)
                for version, look in due:
                    start(t, job, version, look)
    return next_at


def start_hopeless(t: "CommitTracker", job: str, hopeless: frozenset[Version]) -> None:
    """A coordinator's reply named ``hopeless`` versions (call with the tracker's lock held):
    those whose follower has not started start now, to withdraw them (the running ones are
    woken by the caller)."""
    st = t.jobs.get(job)
    if st is None or not st.unstarted:
        return
    for version in [v for v in st.unstarted if v in hopeless]:
        start(t, job, version, st.unstarted.pop(version), hopeless=True)


def follow(t: "CommitTracker", job: str, version: Version, look: float = float("-inf"),
           hopeless: bool = False) -> None:
    """Follows ``version`` of ``job`` on ``t`` until decided; withdraws it when so decided.
    ``look``: its first look (a later landing may teach the book a shorter cadence: the
    follower sees it then, not before), for a follower started ahead of it (nothing is asked
    before it, unless past the deadline); ``hopeless``: started by a reply naming it so."""
    asked = False
    while True:
        with t.cond:
            st = t.jobs.get(job)
            if st is None or t.closing:
                return
            now = t.clock.monotonic()
            verdict = st.book.verdict(version, now, hopeless)
            if verdict is not Verdict.WAIT:
                break
            deadline, ask_at = st.book.deadline(version), st.book.ask_at(version, ASK_LEAD)
            past = now >= deadline
            question = past or (now >= ask_at and now >= look and not asked)
            if not question:
                # Nothing to ask yet: a commit, or a reply naming it hopeless, wakes it.
                until = look if now < look else ask_at if now < ask_at else deadline
                t.cond.wait(min(until - now, 3600.0))
        if not question:
            hopeless = t.reporter.hopeless(job, version, ask=False)
        elif not past:
            hopeless, asked = t.reporter.hopeless(job, version, ask_at), True
        else:
            hopeless = t.reporter.hopeless(job, version, deadline, ASK_AT_MOST)
            if not hopeless:
                with t.cond:
                    t.cond.wait(LOOK_EVERY)
    if verdict is Verdict.WITHDRAW:
        t.withdraw(job, version)
