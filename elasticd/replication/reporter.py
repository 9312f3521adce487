"""This node's side of the commit protocol: its reports, and its turns as coordinator.

Per job, a :class:`Reporter` keeps the job's coordinator as the election record says (the
tracker's watch on the committed prefix brings it), sends it this node's
:class:`~elasticd.replication.report.Report` whenever what it says changed (a version reached
``m`` copies on every local rank, a skip, a withdrawal, a new placement, generation or
coordinator), and keeps the coordinator's last answer about the versions this node waits on
(:meth:`Reporter.hopeless`, for the tracker's follower). A report is sent over the
authenticated replication channel (``send``: the replicator's own connection pool, apart from
pushes, so a report never waits behind a snapshot), or handed over in-process when this node
is the coordinator. Nothing here writes etcd per step: a node's only etcd traffic per
committed step is the commit watch's event.

When no node holds the election key this node campaigns after
:func:`~elasticd.replication.election.campaign_delay` (the placement's first node at once), and
on winning runs a :class:`~elasticd.replication.coordinator.JobCoordinator` for the term.

No thread of its own but its :class:`~elasticd.replication.ticker.Ticker` (retries, campaigns,
the election lease): a simulator drives the same code by calling :meth:`Reporter.tick` itself.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from typing import TYPE_CHECKING, Any, Callable

import xxhash

from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError
from elasticd.replication.api import ReplicationError, Version
from elasticd.replication.commit import KEEP_SKIPPED, KEEP_VERSIONS, KEEP_WITHDRAWN, Committed
from elasticd.replication.coordinator import JobCoordinator
from elasticd.replication.election import Coordinatorship, campaign, campaign_delay
from elasticd.replication.election import decode as decode_election
from elasticd.replication import follower
from elasticd.replication.fences import encode_fence, read_fence
from elasticd.replication.report import MAX_ASK, MAX_DEAD, Reply, Report
from elasticd.replication.tally import Tally
from elasticd.replication.ticker import Ticker

if TYPE_CHECKING:
    from elasticd.replication.tracker import CommitTracker

log = logging.getLogger(__name__)

#: Seconds between two ticks of the reporter's ticker while something is due soon
#: (a retry, a campaign, this node's term as coordinator); with nothing pending it ticks
#: every :data:`IDLE_TICK` (a safety net: every change that makes work due wakes it).
TICK = 0.1
IDLE_TICK = 1.0
#: How long a commit the coordinator named may stay unseen by this node's watch before the node
#: reads the committed record itself. The reply usually beats the watch event by milliseconds:
#: reading at once cost one range read per node per step (0.6 per node per step at N = 300).
WATCH_GRACE = 1.0
#: Each node waits its own share of this many seconds beyond :data:`WATCH_GRACE`
#: (:func:`watch_grace`): when etcd's delivery to every watcher fell a second behind, every node
#: of N = 1,000 read the prefix in the same tick, 1,000 linearizable reads at once, and
#: keep-alives waited behind them (leases lost in the 10-minute commit window, session 33).
WATCH_SPREAD = 1.0


@dataclasses.dataclass
class JobReports:
    """Reporting state of one job (guarded by the tracker's lock)."""

    ship: Coordinatorship | None = None
    known: bool = False  # the election key was read at least once (absent is then news)
    absent_since: float | None = None
    leading: JobCoordinator | None = None
    campaigning: bool = False
    fence: int | None = None  # this node's fence revision; None: read it before reporting
    dirty: bool = True
    busy: bool = False
    failures: int = 0
    retry_at: float = 0.0
    hopeless: frozenset[Version] = frozenset()
    answered_at: float = float("-inf")
    asked_at: float = float("-inf")  # when a follower's question last made a report due
    last_reason: str = ""
    ahead: Version | None = None  # a commit a reply named that the watch had not brought yet
    ahead_since: float = 0.0
    ahead_known: Version | None = None  # what the watch had brought when ``ahead`` was set
    stale_at: float | None = None  # when to read the prefix: the coordinator said its term ended
    stale_ship: Coordinatorship | None = None  # the election record it said that of

    def failed(self, why: str, now: float) -> bool:
        """A report was not delivered: due again after a backoff. True when ``why`` is new."""
        self.dirty = True
        self.failures += 1
        self.retry_at = now + min(0.05 * 2 ** self.failures, 1.0)
        first, self.last_reason = self.last_reason != why, why
        return first

    def watch_lagging(self, known: Version | None, now: float,
                      grace: float = WATCH_GRACE) -> bool:
        """True (once) when a commit a reply named is still unseen after ``grace`` seconds
        and the watch brought no newer commit meanwhile (``known``: the newest commit the
        watch brought). A watch that moved is late, not stuck: it is given another grace
        from its new position rather than read over (a stuck one is read a grace later)."""
        if self.ahead is None or now - self.ahead_since < grace:
            return False
        if known is not None and known < self.ahead and known != self.ahead_known:
            self.ahead_since, self.ahead_known = now, known
            return False
        ahead, self.ahead = self.ahead, None
        return known is None or known < ahead

    def term_stale(self, now: float) -> bool:
        """True (once) when a coordinator said its term ended and, at ``stale_at``, the
        election record is still the one it said that of (the watch brought no other)."""
        if self.stale_at is None or now < self.stale_at:
            return False
        stale, self.stale_at, self.stale_ship = self.ship == self.stale_ship, None, None
        return stale


class Reporter:
    """Sends this node's commit reports and takes its turns as coordinator.

    Args:
        tracker: the node's commit tracker (its job states, lock, clock, etcd).
        send: delivers a report to a node (that node's coordination) and returns its reply;
            raises ReplicationError when it cannot.
        ttl: the election lease's TTL in seconds (a dead coordinator costs about this).
        reread: reads the job's committed prefix again (a lagging watch, a stale election
            record).
        abandon: ends a report in flight to a node at once (closes the connection it waits
            on); called when that node stops being the job's coordinator.
    """

    def __init__(self, tracker: "CommitTracker", send: Callable[[str, Report], Reply],
                 ttl: float, submit: Callable[..., None], reread: Callable[[str], None],
                 abandon: Callable[[str], None] = lambda node: None) -> None:
        self.t, self._send, self.ttl, self.submit, self.reread = tracker, send, ttl, submit, reread
        self.abandon = abandon
        #: This node's grace for a lagging watch (:data:`WATCH_GRACE` plus its spread).
        self.grace = watch_grace(tracker.node_id)
        self._rng = random.SystemRandom()
        self.boot = self._rng.getrandbits(62)
        self.seq = 0
        self.jobs: dict[str, JobReports] = {}
        #: Set when work may have become due before the next tick (:meth:`tick`'s answer).
        self.wake = threading.Event()
        #: When the next tick is due, as the last one said (inf: not said, or one running).
        self._next_tick = float("inf")
        #: Runs :meth:`tick` when it says, and when woken (started by the replicator).
        self.ticker = Ticker(lambda: self.tick(), self.wake, TICK,
                             f"commit-tick-{tracker.node_id}")

    def job(self, job: str) -> JobReports:
        """The job's reporting state, created if new (call with the tracker's lock held).

        A job the tracker no longer follows gets a state that is not kept: news of it (the
        deletion of the election key its own term just resigned) must not make this node
        campaign for, and owe reports to, a job that ended here."""
        if job not in self.t.jobs:
            return self.jobs.get(job) or JobReports()
        return self.jobs.setdefault(job, JobReports())

    # -- what the tracker tells it --------------------------------------------------------------

    def changed(self, job: str) -> None:
        """What this node's report says changed: send it soon."""
        with self.t.lock:
            self.job(job).dirty = True
        self._kick(job)

    def coordinator_seen(self, job: str, ship: Coordinatorship | None) -> None:
        """The election key as read or watched (None: absent)."""
        now = self.t.clock.monotonic()
        with self.t.lock:
            j = self.job(job)
            old, j.ship, j.known = j.ship, ship, True
            j.absent_since = (j.absent_since or now) if ship is None else None
            leading = j.leading
            ended = leading is not None and (ship is None or ship.term != leading.ship.term)
            new = (old is None) != (ship is None) or (
                old is not None and ship is not None and old.term != ship.term)
            if new:
                j.dirty, j.failures, j.retry_at, j.hopeless = True, 0, 0.0, frozenset()
            first = ship is None and _delay(self.t.node_id, self.t.jobs.get(job)) == 0
            # A report in flight to the coordinator whose term just ended waits on a node
            # that may be frozen (a SIGSTOPped daemon's kernel still accepts): for the whole
            # report deadline (5 s), while the new coordinator heard nothing from this node,
            # withdrew its own versions in turn and widened the grid past the job's end
            # (chaos: a world-2 phase committed nothing, the grow restored step 0).
            stale = (old.node if new and j.busy and old is not None and old.node
                     and old.node != self.t.node_id and (ship is None or ship.node != old.node)
                     else None)
        if stale is not None:
            self.abandon(stale)
        if ship is None or new:
            self.wake.set()  # a campaign comes due, or a report
        if ended:
            leading.end("the election key is gone" if ship is None  # type: ignore[union-attr]
                        else f"{ship.node} holds the election key")
        if new:
            self._kick(job)
        if first:
            self.submit(self._campaign, job)

    def committed_seen(self, job: str, c: Committed | None, revision: int) -> None:
        """The committed record changed (the watch): tells this node's coordination."""
        leading = self.leading(job)
        if leading is not None:
            leading.learn_committed(c.version if c is not None else None, revision)

    def placement_changed(self, job: str) -> None:
        """A new placement: reported again; a coordinator no longer in it resigns."""
        with self.t.lock:
            st, j = self.t.jobs.get(job), self.job(job)
            leading, j.dirty = j.leading, True
            placement = st.placement if st is not None else None
        if leading is not None and placement is not None:
            if self.t.node_id in placement.nodes:
                leading.set_placement(placement)
            else:
                leading.end("this node left the job's placement", resign_key=True)
        self._kick(job)

    def fence_written(self, job: str, revision: int | None) -> None:
        """This node's fence key is now at ``revision`` (None: unknown, read it again)."""
        with self.t.lock:
            j = self.job(job)
            j.fence, j.dirty = revision, True
        self._kick(job)

    def hopeless(self, job: str, version: Version, fresh_after: float = float("-inf"),
                 every: float = float("inf"), ask: bool = True) -> bool:
        """The coordinator's last word on ``version`` (which this node waits on): True when it
        can never commit. With ``ask``, asks again (a report) when that word is older than
        ``fresh_after`` or ``every`` seconds, unless a question made since is not (see
        :mod:`elasticd.replication.follower`)."""
        now = self.t.clock.monotonic()
        with self.t.lock:
            j = self.jobs.get(job)
            if j is None:
                return False
            stale = ask and all(at < fresh_after or now - at > every
                                for at in (j.answered_at, j.asked_at))
            if stale:
                j.dirty, j.asked_at = True, now
            answer = tuple(version) in j.hopeless
        if stale:
            self._kick(job)
        return answer

    def on_report(self, report: Report) -> Reply:
        """A report from a node (the replica server's thread): for this node's coordination
        of its job, if it has one."""
        leading = self.leading(report.job)
        if leading is None:
            return Reply(False, "term")
        return leading.on_report(report)

    # -- sending ----------------------------------------------------------------------------

    def _kick(self, job: str) -> None:
        with self.t.lock:
            j = self.jobs.get(job)
            if (j is None or j.busy or not j.dirty or self.t.closing
                    or self.t.clock.monotonic() < j.retry_at):
                return
            j.busy = True
        self.submit(self._run, job)

    def _run(self, job: str) -> None:
        try:
            while self._send_once(job):
                pass
        finally:
            with self.t.lock:
                j = self.jobs.get(job)
                again = j is not None and j.dirty
                if j is not None:
                    j.busy = False
                if again:
                    # Not sent (a failure's backoff, a refusal, no coordinator to send to):
                    # the tick retries it, a TICK from now at the soonest; a retry due now spun
                    # the pool while the reason lasted (~18,000 tries a second).
                    j.retry_at = max(j.retry_at, self.t.clock.monotonic() + TICK)
            if again:
                self.wake.set()

    def _send_once(self, job: str) -> bool:
        """Sends the job's report once if it is due; True when another may be due."""
        with self.t.lock:
            st, j = self.t.jobs.get(job), self.jobs.get(job)
            if (st is None or j is None or not j.dirty or st.placement is None
                    or self.t.closing or j.ship is None):
                return False
            ship, leading, fence = j.ship, j.leading, j.fence
            if not ship.node:
                j.last_reason = "the coordinator record is unreadable"
                return False
            if ship.node == self.t.node_id and (leading is None or
                                                 leading.ship.term != ship.term):
                return False  # our own earlier term (a restart): its lease expires
        try:
            if fence is None:
                fence = read_fence(self.t.coord, self.t.keys, job, self.t.node_id)[0]
                with self.t.lock:
                    j.fence = fence
            with self.t.lock:
                if j.ship is not ship:
                    return True  # the term changed while the fence was read: the new one
                report = self._report(job, st, ship, fence)
                j.dirty = False
            reply = (leading.on_report(report) if leading is not None and ship.node == self.t.node_id
                     else self._send(ship.node, report))
        except (ReplicationError, CoordinationError) as exc:
            why, now = f"{type(exc).__name__}: {exc}", self.t.clock.monotonic()
            with self.t.lock:
                first = j.failed(why, now)
            self.wake.set()  # the retry's time
            (log.warning if first else log.debug)(
                "%s: cannot report to the commit coordinator (%s); retrying", job, why)
            return False
        return self._answered(job, j, ship, reply)

    def _report(self, job: str, st: Any, ship: Coordinatorship, fence: int) -> Report:
        """This node's report (call with the tracker's lock held)."""
        book, placement = st.book, st.placement
        mine = placement.ranks.get(self.t.node_id, ())
        ranks = {r: tuple(v for v in st.replicated.get(r, ())
                          if book.recordable(v) and v[0] >= book.floor)[:KEEP_VERSIONS]
                 for r in mine}
        dead = sorted({*st.skipped[:KEEP_SKIPPED], *st.withdrawn[:KEEP_WITHDRAWN]},
                      reverse=True)[:MAX_DEAD]
        self.seq += 1
        return Report(job, self.t.node_id, ship.term, st.digest, self.boot, self.seq, fence,
                      book.floor, ranks, tuple(dead), tuple(book.awaiting()[-MAX_ASK:]))

    def _answered(self, job: str, j: JobReports, ship: Coordinatorship, reply: Reply) -> bool:
        """Takes the coordinator's reply; True when another report is due at once."""
        now = self.t.clock.monotonic()
        with self.t.lock:
            st = self.t.jobs.get(job)
            if st is not None and (reply.accepted or reply.reason not in ("term", "term ended")):
                st.book.heard(ship.term, now)  # in office: its word counts for withdrawals
            if reply.accepted:
                j.hopeless, j.answered_at = frozenset(reply.hopeless), now
                if j.hopeless:  # a follower waiting on one of them withdraws it now
                    self.t.cond.notify_all()
                    follower.start_hopeless(self.t, job, j.hopeless)
                j.failures, j.last_reason = 0, ""
                known = st.committed.version if st is not None and st.committed else None
                # The coordinator knows a newer commit than our watch brought: the watch
                # brings it in a moment; :meth:`tick` reads it if it has not by WATCH_GRACE.
                if (reply.committed is not None and (known is None or reply.committed > known)
                        and j.ahead is None):
                    j.ahead, j.ahead_since, j.ahead_known = reply.committed, now, known
                again = j.dirty
            else:
                j.dirty, j.failures, j.last_reason = True, j.failures + 1, reply.reason
                if reply.reason == "fenced":
                    j.fence = None  # a withdrawal of ours it saw first: read our fence again
                # It answered: what it waits for (its fences, its placement, our fence, the
                # election record) comes soon; ask again shortly, without backing off.
                j.retry_at = now + 0.1
                again = False
                if reply.reason in ("term", "term ended") and j.stale_at is None:
                    # Our election record is stale: the watch brings the new one in a moment;
                    # :meth:`tick` reads the prefix at this node's share of the spread if it has
                    # not. Read at once, every node read in the same moment, and again at each
                    # retry (every TICK) while the read was slow: a term's end at N = 1,000.
                    j.stale_at, j.stale_ship = now + self.grace - WATCH_GRACE, ship
        if not reply.accepted or j.ahead is not None:
            self.wake.set()  # a retry, or a look at the watch after WATCH_GRACE
        if not reply.accepted:
            log.debug("%s: coordinator %s did not count this report: %s", job, ship.node,
                      reply.reason)
        return again

    # -- coordinating ----------------------------------------------------------------------

    def _campaign(self, job: str) -> None:
        with self.t.lock:
            st, j = self.t.jobs.get(job), self.jobs.get(job)
            if (st is None or j is None or j.ship is not None or j.leading is not None
                    or j.campaigning or self.t.closing or st.placement is None
                    or self.t.node_id not in st.placement.nodes):
                return
            j.campaigning = True
        t = self.t
        lease = None
        try:
            stored = t.coord.get(t.keys.replication(job).commit_placement)
            lease = t.coord.grant_lease(max(1, round(self.ttl)))
            term = self._rng.getrandbits(62)
            revision = campaign(t.coord, t.keys, job, t.node_id, term, lease, t.clock.wall())
            if revision is None:
                t.coord.revoke_lease(lease)  # lost: the watch brings the winner
                return
            removed = t.coord.delete_prefix(t.keys.replication(job).replicated_prefix)
        except CoordinationError as exc:
            t.etcd_error("campaign for commit coordinator", exc)
            if lease is not None:
                try:
                    t.coord.revoke_lease(lease)
                except CoordinationError:
                    pass  # it expires by itself
            return
        finally:
            with t.lock:
                j.campaigning = False
        if removed:
            log.warning("%s: removed %d per-node records of the old commit protocol "
                        "(ckpt/replicated/): every node must run this release", job, removed)
        ship = Coordinatorship(t.node_id, term, revision)
        with t.lock:
            committed = st.committed
            tally = Tally(term, revision, st.placement, committed=committed.version
                          if committed else None, committed_rev=st.committed_rev,
                          stored_placement=(xxhash.xxh3_64_hexdigest(stored.value)
                                            if stored is not None else ""),
                          ahead=st.ahead, floor=st.book.floor)
            leading = JobCoordinator(
                t.node_id, job, t.coord, t.keys, t.clock, ship, lease, self.ttl, tally,
                on_commit=lambda c: t.learn(job, c, by_me=True),
                on_end=lambda why: self._ended(job, ship),
                wake=lambda: self.submit(self._flush, job))
            j.leading, j.ship, j.dirty, j.absent_since = leading, ship, True, None
        log.info("%s: %s coordinates commits (term %x)", job, t.node_id, term)
        self.wake.set()  # its term ticks (the election lease)
        self._kick(job)
        self.submit(self._flush, job)

    def _flush(self, job: str) -> None:
        leading = self.leading(job)
        if leading is not None:
            leading.flush()

    def _ended(self, job: str, ship: Coordinatorship) -> None:
        with self.t.lock:
            j = self.jobs.get(job)
            if j is not None and j.leading is not None and j.leading.ship == ship:
                j.leading = None

    def leading(self, job: str) -> JobCoordinator | None:
        with self.t.lock:
            j = self.jobs.get(job)
            return j.leading if j is not None else None

    # -- periodic work --------------------------------------------------------------------------

    def tick_by(self, at: float) -> None:
        """Work comes due at ``at`` (monotonic): the ticker is woken unless its next tick
        comes by then (call it after the work is where :meth:`tick` finds it)."""
        if at < self._next_tick:
            self.wake.set()

    def tick(self) -> float:
        """One round of periodic work: the election lease, due retries and campaigns, the
        followers due to start. Returns the seconds until the next round is due (:data:`TICK`
        to :data:`IDLE_TICK`)."""
        self._next_tick = float("inf")  # work made due meanwhile wakes the ticker again
        now = self.t.clock.monotonic()
        with self.t.lock:
            jobs = list(self.jobs.items())
        due_in = min(IDLE_TICK, follower.start_due(self.t, now) - now)
        for job, j in jobs:
            leading = j.leading
            if leading is not None:
                leading.tick()
            with self.t.lock:
                # The delay (a search of the placement's node list: O(N)) only when no node
                # holds the election key: not at every tick of every node.
                campaign_at = (j.absent_since + _delay(self.t.node_id, self.t.jobs.get(job))
                               if j.known and j.ship is None and j.leading is None
                               and not j.campaigning and j.absent_since is not None
                               else float("inf"))
            if now >= campaign_at:
                self._campaign(job)
            with self.t.lock:
                st = self.t.jobs.get(job)
                lagging = j.watch_lagging(st.committed.version if st is not None and st.committed
                                          else None, now, self.grace)
                if lagging:
                    self.t.counters["watch_lagging_rereads"] += 1
                stale = j.term_stale(now)
                if stale:
                    self.t.counters["term_rereads"] += 1
            if lagging or stale:
                self.submit(self.reread, job)
            self._kick(job)
            with self.t.lock:
                # A report being sent (busy) is sent again by its sender while due, and a
                # failure wakes the ticker: no retry to tick for meanwhile (every node's report
                # is in flight for part of each step; ticking at TICK through it cost ~4 ticks
                # per node per second).
                at = min(campaign_at, j.ahead_since + self.grace if j.ahead else float("inf"),
                         j.stale_at if j.stale_at is not None else float("inf"),
                         j.retry_at if j.dirty and j.ship is not None and not j.busy
                         else float("inf"))
            due_in = min(due_in, TICK if j.leading is not None else at - now)
        due_in = max(TICK, due_in)
        self._next_tick = now + due_in
        return due_in

    def settled(self) -> bool:
        """No report being sent, and none waiting that its coordinator could take now."""
        with self.t.lock:
            return not any(j.busy or j.campaigning or (j.dirty and j.ship is not None
                                                        and j.failures < 3)
                           for j in self.jobs.values())

    def republish(self, job: str, withdrawn: list[Version]) -> None:
        """etcd lost its data: the term (if any) ended with the election key, this node's
        fence is rewritten (its withdrawals, for the holders' sake) and read again."""
        with self.t.lock:
            j = self.job(job)
            leading, j.fence, j.dirty = j.leading, None, True
        if leading is not None:
            leading.end("its election key went with etcd's data")
        if withdrawn:
            try:
                self.t.coord.put(self.t.keys.replication(job).fence(self.t.node_id),
                                 encode_fence(self.t.node_id, withdrawn, self.t.clock.wall()))
            except CoordinationError as exc:
                self.t.etcd_error("write its fence again", exc)
        self._kick(job)

    def forget(self, job: str) -> None:
        """The job ended here: its term ends (resigned) and its state goes."""
        with self.t.lock:
            j = self.jobs.pop(job, None)
        if j is not None and j.leading is not None:
            j.leading.end("the job ended on this node", resign_key=True)

    def close(self, resign: bool = True) -> None:
        """Stops the ticker; ends every term (``resign``: deleting the election keys, so that
        another node takes over at once; else they expire with the lease)."""
        self.ticker.stop()
        with self.t.lock:
            leading = [j.leading for j in self.jobs.values() if j.leading is not None]
        for term in leading:
            term.end("this node stops", resign_key=resign)

    def status(self, job: str) -> dict[str, Any]:
        with self.t.lock:
            j = self.jobs.get(job)
            if j is None:
                return {"coordinator": None, "coordinating": None}
            ship, leading = j.ship, j.leading
            reason = j.last_reason
        return {"coordinator": None if ship is None else {"node": ship.node,
                                                          "term": f"{ship.term:x}"},
                "coordinating": leading.status() if leading is not None else None,
                "report_problem": reason or None}


def watch_grace(node_id: str) -> float:
    """Seconds ``node_id`` leaves a commit a reply named to its watch before reading the
    committed prefix itself: :data:`WATCH_GRACE` plus a share of :data:`WATCH_SPREAD` fixed
    by the node's name, so that the nodes' reads of one late commit spread evenly."""
    return WATCH_GRACE + xxhash.xxh3_64_intdigest(node_id.encode()) / 2.0 ** 64 * WATCH_SPREAD


def _delay(node_id: str, st: Any) -> float:
    """Seconds ``node_id`` waits before campaigning in ``st``'s placement (inf: not in one)."""
    return campaign_delay(node_id, st.placement.nodes) if (
        st is not None and st.placement is not None) else float("inf")


def decode_ship(kv: Any) -> Coordinatorship:
    """The election record of a watched key-value. An unreadable one names no node: nobody
    campaigns while it is there (a create would fail) and no report can be sent, which the
    log and ``/status`` say (an operator deletes the key)."""
    try:
        return decode_election(kv.value, kv.key, kv.mod_revision)
    except records.RecordError as exc:
        log.error("unreadable commit coordinator record (commits stop until it is deleted "
                  "or expires): %s", exc)
        return Coordinatorship("", 0, kv.mod_revision)
