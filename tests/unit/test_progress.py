"""Hang detection on a fake clock: stalls, progress, restarts, the start-up rule, /status."""

from __future__ import annotations

import pytest

from elasticd.agent.progress import Hang, ProgressTracker, StalledRank, progress_handler
from elasticd.testing.clock import FakeClock
from elasticd.local.wire import RequestError

JOB = "job-1"


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def tracker(clock):
    return ProgressTracker(hang_timeout=30.0, clock=clock)


def test_no_hang_while_every_rank_progresses(tracker, clock):
    for step in range(10):
        for rank in range(3):
            tracker.report(JOB, rank, step, pid=100 + rank)
        clock.advance(20.0)
        assert tracker.check(JOB) is None


def test_a_rank_without_progress_for_the_timeout_is_a_hang(tracker, clock):
    for rank in range(3):
        tracker.report(JOB, rank, 5, pid=100 + rank)
    clock.advance(10.0)
    tracker.report(JOB, 0, 6, pid=100)
    tracker.report(JOB, 1, 6, pid=101)
    clock.advance(19.9)
    assert tracker.check(JOB) is None
    clock.advance(0.1)
    hang = tracker.check(JOB)
    assert hang == Hang(JOB, "no progress for 30 s",
                        (StalledRank(2, 5, 102, 30.0),))
    assert str(hang) == "job job-1: no progress for 30 s: rank 2 at step 5 for 30.0 s"
    assert tracker.check(JOB) == hang  # checking does not change anything


def test_repeating_the_same_step_is_not_progress(tracker, clock):
    tracker.report(JOB, 0, 7, pid=100)
    for _ in range(4):
        clock.advance(10.0)
        tracker.report(JOB, 0, 7, pid=100)
    hang = tracker.check(JOB)
    assert hang is not None and hang.ranks[0].seconds == 40.0
    assert tracker.status(JOB)["ranks"][0]["seconds_since_report"] == 0.0


def test_a_smaller_step_or_a_new_process_is_progress(tracker, clock):
    tracker.report(JOB, 0, 7, pid=100)
    clock.advance(25.0)
    tracker.report(JOB, 0, 0, pid=100)  # a per-epoch step counter starting over
    clock.advance(25.0)
    tracker.report(JOB, 0, 0, pid=200)  # a restarted worker at the same step
    clock.advance(25.0)
    assert tracker.check(JOB) is None


def test_every_stalled_rank_is_named_in_rank_order(tracker, clock):
    tracker.report(JOB, 2, 1, pid=12)
    clock.advance(5.0)
    tracker.report(JOB, 0, 1, pid=10)
    tracker.report(JOB, 1, 1, pid=11)
    clock.advance(1.0)
    tracker.report(JOB, 1, 2, pid=11)
    clock.advance(29.0)
    hang = tracker.check(JOB)
    assert [(r.rank, r.last_step, r.seconds) for r in hang.ranks] == [(0, 1, 30.0), (2, 1, 35.0)]


def test_reset_forgets_ranks_and_ignores_the_old_processes(tracker, clock):
    tracker.report(JOB, 0, 9, pid=100)
    clock.advance(31.0)
    assert tracker.check(JOB) is not None
    tracker.reset(JOB)
    assert tracker.check(JOB) is None
    assert tracker.status(JOB)["last_step"] is None
    # A report the killed worker left in the socket must not start the new generation's clock.
    assert tracker.report(JOB, 0, 10, pid=100) is False
    clock.advance(100.0)
    assert tracker.check(JOB) is None
    assert tracker.report(JOB, 0, 9, pid=300) is True
    assert tracker.status(JOB)["last_step"] == 9


def test_a_silent_start_is_not_a_hang(tracker, clock):
    tracker.reset(JOB)
    clock.advance(10_000.0)
    assert tracker.check(JOB) is None
    assert tracker.check("never-seen") is None


def test_jobs_are_independent(tracker, clock):
    tracker.report(JOB, 0, 1, pid=1)
    tracker.report("other", 0, 1, pid=2)
    clock.advance(20.0)
    tracker.report("other", 0, 2, pid=2)
    clock.advance(10.0)
    assert tracker.check(JOB) is not None and tracker.check("other") is None


def test_last_step_and_status(tracker, clock):
    tracker.reset(JOB)
    clock.advance(2.0)
    tracker.report(JOB, 1, 41, pid=11)
    tracker.report(JOB, 0, 42, pid=10)
    clock.advance(3.5)
    assert tracker.status(JOB)["last_step"] == 41
    assert tracker.status(JOB) == {
        "job": JOB,
        "ranks": [
            {"rank": 0, "step": 42, "pid": 10, "seconds_since_progress": 3.5,
             "seconds_since_report": 3.5, "timeout_seconds": 30.0,
             "compute_seconds": None},
            {"rank": 1, "step": 41, "pid": 11, "seconds_since_progress": 3.5,
             "seconds_since_report": 3.5, "timeout_seconds": 30.0,
             "compute_seconds": None},
        ],
        "last_step": 41,
        "seconds_since_progress": 3.5,
        "seconds_since_start": 5.5,
        "hang_timeout_seconds": 30.0,
        "hang_timeout_source": "set",
        "startup_timeout_seconds": None,
        "learned": None,
        "compute_seconds": None,
    }


@pytest.mark.parametrize("kwargs", [{"hang_timeout": 0}, {"hang_timeout": -1}])
def test_timeouts_are_validated(clock, kwargs):
    with pytest.raises(ValueError, match="must be positive"):
        ProgressTracker(clock=clock, **kwargs)


def test_handler_uses_the_kernels_pid_and_the_default_job(tracker, clock):
    handle = progress_handler(tracker, default_job=JOB)
    handle({"op": "progress", "step": 3, "rank": 0, "pid": 1, "job": None,
            "_peer": {"pid": 4242, "uid": 0, "gid": 0}})
    assert tracker.status(JOB)["ranks"][0]["pid"] == 4242
    tracker.reset(JOB)
    assert tracker.report(JOB, 0, 4, pid=4242) is False


@pytest.mark.parametrize("msg, match", [
    ({"step": 1, "rank": None, "job": JOB}, "integer rank"),
    ({"step": "1", "rank": 0, "job": JOB}, "integer step"),
    ({"step": True, "rank": 0, "job": JOB}, "integer step"),
    ({"step": 1, "rank": 0}, "without a job"),
])
def test_handler_rejects_bad_reports(tracker, msg, match):
    with pytest.raises(RequestError, match=match):
        progress_handler(tracker)(msg)
