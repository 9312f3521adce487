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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticd.replication.api import Version
from elasticd.replication.commit_state import Verdict

if TYPE_CHECKING:
    from elasticd.replication.tracker import CommitTracker

#: Seconds before a version's next snapshot (or its deadline) at which its follower asks: the
#: answer's round trip, and a withdrawal's etcd write, fit in it.
ASK_LEAD = 0.1
#: Past the deadline, seconds between two questions while no coordinator answers.
ASK_AT_MOST = 0.8
#: Seconds between two looks past the deadline (cheap: the commit book, no question).
LOOK_EVERY = 0.05


def follow(t: "CommitTracker", job: str, version: Version) -> None:
    """Follows ``version`` of ``job`` on ``t`` until decided; withdraws it when so decided."""
    hopeless, asked = False, False
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
            question = past or (now >= ask_at and not asked)
            if not question:
                # Nothing to ask yet: a commit, or a reply naming it hopeless, wakes it.
                t.cond.wait(min((ask_at if now < ask_at else deadline) - now, 3600.0))
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
