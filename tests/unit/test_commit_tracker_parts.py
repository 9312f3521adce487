"""The commit tracker's and reporter's parts, each alone: the committed prefix it follows
(:class:`~elasticd.replication.committed_prefix.CommittedPrefix`, on the in-memory coordinator,
whose watch callbacks run on the writer's thread) and the reporter's thread
(:class:`~elasticd.replication.ticker.Ticker`)."""

from __future__ import annotations

import threading

from elasticd.coordination.keys import Keyspace
from elasticd.replication.commit import Committed, Grid, encode_ahead, encode_committed, encode_grid
from elasticd.replication.committed_prefix import CommittedPrefix
from elasticd.replication.election import Coordinatorship
from elasticd.replication.election import encode as encode_election
from elasticd.replication.ticker import Ticker
from elasticd.replication.tracker import JobState
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore

KEYS = Keyspace("/t")
RECORD = Committed(0, 3, (0,), {0: ("n1",)})


class Reporter:
    """What the part tells the reporter, recorded."""

    def __init__(self) -> None:
        self.ships: list[Coordinatorship | None] = []
        self.seen: list[tuple[Committed | None, int]] = []

    def coordinator_seen(self, job, ship):
        self.ships.append(ship)

    def committed_seen(self, job, c, revision):
        self.seen.append((c, revision))


def prefix(store: MemoryStore, jobs: dict):
    reporter, learned, errors = Reporter(), [], []
    part = CommittedPrefix(MemoryCoordinator(store), KEYS, threading.Lock(), jobs, reporter,
                           lambda job, c: learned.append(c), lambda fn, *a: fn(*a),
                           lambda what, exc: errors.append(what))
    return part, reporter, learned, errors


def test_the_listing_and_the_watch_bring_each_key_of_the_prefix_to_the_job_state():
    store, jobs = MemoryStore(), {"job": JobState()}
    writer, k = MemoryCoordinator(store), KEYS.replication("job")
    writer.put(k.committed, encode_committed(RECORD))
    part, reporter, learned, errors = prefix(store, jobs)
    part.watch("job")
    assert learned == [RECORD] and reporter.seen[-1][0] == RECORD and not errors
    assert reporter.ships == [None]  # listed: no coordinator yet
    writer.put(k.commit_grid, encode_grid(Grid(4, (0, 3))))
    writer.put(k.commit_ahead, encode_ahead((0, 4)))
    assert part.grid("job") == 4 and jobs["job"].ahead == (0, 4)
    revision = writer.put(k.committed, encode_committed(Committed(0, 4, (0,), {0: ("n1",)})))
    assert learned[-1].version == (0, 4) and jobs["job"].committed_rev == revision
    writer.delete(k.committed)
    assert reporter.seen[-1] == (None, 0) and len(learned) == 2  # absent: nothing learned
    assert part.grid("other") == 1  # a job not followed: every step


def test_a_forgotten_job_is_no_longer_watched_and_a_closed_part_starts_no_watch():
    store, jobs = MemoryStore(), {"job": JobState(), "late": JobState()}
    part, _, learned, _ = prefix(store, jobs)
    part.watch("job")
    assert len(store._watches) == 1
    del jobs["job"]
    part.forget("job")
    assert not store._watches
    MemoryCoordinator(store).put(KEYS.replication("job").committed, encode_committed(RECORD))
    assert learned == []
    part.close()
    part.watch("late")  # e.g. a placement adopted while the node stops
    assert not store._watches and part.watches == {}


def test_the_ticker_ticks_when_woken_and_stops():
    wake, ticked = threading.Event(), threading.Semaphore(0)

    def tick() -> float:
        ticked.release()
        return 3600.0  # nothing due for an hour: only a wake brings the next tick

    ticker = Ticker(tick, wake, 0.0, "ticker-test")
    ticker.start()
    try:
        assert ticked.acquire(timeout=5)  # the first, after ``first`` seconds
        wake.set()
        assert ticked.acquire(timeout=5)
    finally:
        ticker.stop()
    assert not ticker._thread.is_alive()


def test_the_ahead_record_is_checked_when_read_not_at_each_watch_event(monkeypatch):
    # Every node's watch brings the ahead record at every commit; only a new coordinator's
    # tally reads it. It was decoded (JSON and checks) per event and dropped.
    from elasticd.coordination import records
    store, jobs = MemoryStore(), {"job": JobState()}
    writer, k = MemoryCoordinator(store), KEYS.replication("job")
    part, _, _, errors = prefix(store, jobs)
    part.watch("job")
    decoded: list[str] = []
    real = records.decode
    monkeypatch.setattr(records, "decode",
                        lambda raw, kind, *a, **kw: (decoded.append(kind),
                                                     real(raw, kind, *a, **kw))[1])
    for step in (4, 5, 6):
        writer.put(k.commit_ahead, encode_ahead((0, step)))
    assert decoded == [] and not errors
    assert jobs["job"].ahead == (0, 6) and len(decoded) == 1  # checked when read
    from elasticd.replication.commit import AHEAD_KIND
    writer.put(k.commit_ahead, records.encode(AHEAD_KIND, {"version": [0, -1], "at": 0.0}))
    assert jobs["job"].ahead is None  # a malformed record is still refused before use
    writer.put(k.commit_ahead, b"not json")
    assert jobs["job"].ahead is None
    writer.delete(k.commit_ahead)
    assert jobs["job"].ahead is None and jobs["job"].ahead_record is None


def test_a_listing_read_before_a_watch_event_does_not_undo_it():
    """A reread lists the prefix; the watch may bring a newer event before the listing is
    taken. Seen: the new coordinator's election key arrived by the watch, then the listing
    read just before it said the key was absent, and the node waited on a coordinator that
    never came (the one in office waited on its report)."""
    store, jobs = MemoryStore(), {"job": JobState()}
    writer, k = MemoryCoordinator(store), KEYS.replication("job")
    part, reporter, _, _ = prefix(store, jobs)
    part.watch("job")
    assert reporter.ships == [None]
    listed = part.coord.get_prefix

    def get_prefix(key):  # the listing is read, then the election's put lands first
        found = listed(key)
        writer.put(k.coordinator, encode_election("n2", 7, 0.0))
        return found

    part.coord.get_prefix = get_prefix
    part.reread("job")
    assert [s.node if s else None for s in reporter.ships] == [None, "n2"]
    part.coord.get_prefix = listed
    part.reread("job")  # a listing begun after the event takes the key as listed
    writer.delete(k.coordinator)
    assert [s.node if s else None for s in reporter.ships] == [None, "n2", "n2", None]


def test_keys_anyone_writes_under_the_prefix_are_not_counted():
    """The watch counts its events per key for the listings; only the prefix's four keys are
    counted, so keys a hostile etcd writer makes under it cannot grow that count's table."""
    store, jobs = MemoryStore(), {"job": JobState()}
    writer, k = MemoryCoordinator(store), KEYS.replication("job")
    part, _, _, _ = prefix(store, jobs)
    part.watch("job")
    for i in range(50):
        writer.put(k.committed + b"/junk-%d" % i, b"x")
    writer.put(k.commit_grid, encode_grid(Grid(4, (0, 3))))
    assert part._events == {("job", k.commit_grid): 1}
