"""A rank's compute time outside collectives (the worker's ComputeTimer, on a fake clock) and
what the daemon keeps of it (the progress tracker and its local API handler)."""

from __future__ import annotations

import pytest

from elasticd.agent.progress import ProgressTracker, progress_handler
from elasticd.testing.clock import FakeClock
from elasticd.local.wire import RequestError
from elasticd.worker.compute_time import ComputeTimer

JOB = "job-1"


def test_the_wait_for_the_other_ranks_is_not_compute():
    clock = FakeClock()
    timer = ComputeTimer(clock)
    assert timer.stop() is None  # no step started
    timer.start()
    clock.advance(0.3)  # data, forward, backward: the first buckets are ready on the way
    timer.bucket_ready()
    clock.advance(0.2)
    timer.bucket_ready()  # the last bucket: this rank's backward is done
    clock.advance(0.1)
    timer.reduced()
    clock.advance(2.0)  # waiting for a slow peer
    timer.reduced()
    clock.advance(0.05)  # the optimizer step
    assert timer.stop() == pytest.approx(0.55)
    timer.start()  # no DDP: the script brackets its own collectives
    clock.advance(0.4)
    with timer.waiting():
        clock.advance(1.5)
    clock.advance(0.1)
    assert timer.stop() == pytest.approx(0.5)


def test_the_tracker_keeps_each_ranks_median_and_the_nodes():
    clock = FakeClock()
    tracker = ProgressTracker(30.0, clock)
    handle = progress_handler(tracker, default_job=JOB)
    for step, (a, b) in enumerate([(0.1, 0.5), (0.1, 0.6), (9.0, 0.5)]):  # one slow step
        handle({"step": step, "rank": 0, "compute_seconds": a, "_peer": {"pid": 1}})
        handle({"step": step, "rank": 1, "compute_seconds": b, "_peer": {"pid": 2}})
        handle({"step": step, "rank": 2, "_peer": {"pid": 3}})  # does not measure it
    st = tracker.status(JOB)
    assert [r["compute_seconds"] for r in st["ranks"]] == [0.1, 0.5, None]
    assert st["compute_seconds"] == tracker.compute_seconds(JOB) == pytest.approx(0.3)
    assert tracker.compute_seconds("other") is None
    for bad in (-1.0, float("nan"), "0.1", True):
        with pytest.raises(RequestError, match="compute_seconds"):
            handle({"step": 9, "rank": 0, "compute_seconds": bad})
