"""The learned hang timeout on a fake clock: what it learns, what it leaves out (first steps),
the floor, the window, doubling after a restart, and the tracker's decisions with it."""

from __future__ import annotations

import random

import pytest

from elasticd.cluster.learned_timeout import LearnedTimeout, SlidingMax, StepHistory
from elasticd.agent.progress import ProgressTracker
from elasticd.testing.clock import FakeClock

JOB = "job-1"


@pytest.mark.parametrize("size", [1, 2, 7, 50])
def test_sliding_max_is_the_max_of_the_last_values(size):
    rnd = random.Random(size)
    sm, seen = SlidingMax(size), []
    assert sm.max() is None and len(sm) == 0
    for _ in range(500):
        v = rnd.choice([rnd.random(), 0.5, rnd.random() * 10])
        sm.add(v)
        seen.append(v)
        assert sm.max() == max(seen[-size:])
        assert len(sm) == min(len(seen), size)


@pytest.mark.parametrize("kwargs, match", [
    ({"floor": 0}, "floor must be positive"),
    ({"first_step": -1}, "first_step must be positive"),
    ({"first_step": float("inf")}, "first_step must be positive"),
])
def test_settings_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LearnedTimeout(**kwargs)
    with pytest.raises(ValueError, match="window size"):
        SlidingMax(0)


def test_the_rule_floor_factor_window_and_doublings():
    rule = LearnedTimeout(floor=10.0, first_step=100.0)  # FACTOR 5, WINDOW 1000, MAX_DOUBLINGS 4
    h = StepHistory()
    assert (rule.timeout(h), rule.source(h)) == (10.0, "floor")  # nothing learned yet
    assert rule.warmup_timeout(h) == 100.0
    h.observe(0, 1.0)
    assert (rule.timeout(h), rule.source(h)) == (10.0, "floor")  # 5 x 1 s is under the floor
    h.observe(1, 4.0)  # another rank's long step counts too
    assert (rule.timeout(h), rule.source(h)) == (20.0, "learned")
    for _ in range(1000):  # rank 1's window forgets its long step
        h.observe(1, 2.5)
    assert rule.timeout(h) == 12.5
    h.observe(2, float("nan"))  # nonsense is not learned
    h.observe(2, -1.0)
    assert rule.timeout(h) == 12.5 and h.learned == 1002
    rule.fired(h)
    assert rule.timeout(h) == 25.0 and rule.warmup_timeout(h) == 100.0
    for _ in range(5):
        rule.fired(h)
    assert rule.timeout(h) == 200.0 and h.doublings == 4  # capped
    assert rule.warmup_timeout(h) == 200.0
    rule.fired(h)
    assert rule.status(h) == {"floor_seconds": 10.0, "first_step_seconds": 100.0,
                              "factor": 5.0, "window": 1000, "longest_step_seconds": 2.5,
                              "steps_learned": 1002, "doublings": 4}


@pytest.fixture
def clock():
    return FakeClock()


def steps(tracker, clock, ranks, intervals, start=0):
    """Every rank reports steps start+1... each ``intervals[i]`` seconds apart."""
    step = start
    for dt in intervals:
        clock.advance(dt)
        step += 1
        for rank in ranks:
            tracker.report(JOB, rank, step, pid=100 + rank)
        assert tracker.check(JOB) is None, (step, dt)
    return step


def test_steady_but_uneven_steps_are_never_a_hang_and_a_stall_is_caught(clock):
    """Steps varying 3x (1-3 s) for 5000 steps: never a hang; the timeout learned is 5x the
    longest step; a stall is caught at exactly that timeout, not before."""
    tracker = ProgressTracker(LearnedTimeout(floor=2.0, first_step=60.0), clock)
    rnd = random.Random(7)
    intervals = [rnd.uniform(1.0, 3.0) for _ in range(5000)]
    step = steps(tracker, clock, [0, 1], [0.0, 30.0, 20.0, *intervals])
    longest = max(intervals[-1000:])
    timeout, source = tracker.timeout(JOB)
    assert source == "learned" and timeout == pytest.approx(5 * longest)
    assert 14.0 < timeout <= 15.0
    clock.advance(1.0)
    tracker.report(JOB, 0, step + 1, pid=100)  # rank 1 stalls
    clock.advance(timeout - 1.01)
    assert tracker.check(JOB) is None
    clock.advance(0.01)
    hang = tracker.check(JOB)
    assert hang.learned
    assert [r.rank for r in hang.ranks] == [1]
    assert hang.reason == f"no progress for {timeout:.3g} s (learned hang timeout)"


def test_first_steps_of_each_process_get_the_allowance_and_are_not_learned(clock):
    tracker = ProgressTracker(LearnedTimeout(floor=2.0, first_step=60.0), clock)
    # A compile-long first step and a slow second one: the allowance, not the floor.
    step = steps(tracker, clock, [0], [0.0, 59.0, 59.0])
    # Neither was learned; until a step is, the allowance holds (not the bare floor).
    assert tracker.timeout(JOB) == (60.0, "first_step")
    assert tracker.status(JOB)["ranks"][0]["timeout_seconds"] == 60.0
    step = steps(tracker, clock, [0], [59.0], start=step)
    assert tracker.timeout(JOB) == (295.0, "learned")  # a slow third step is learned
    tracker = ProgressTracker(LearnedTimeout(floor=2.0, first_step=60.0), clock)
    step = steps(tracker, clock, [0], [0.0, 59.0, 59.0, 0.2])
    assert tracker.timeout(JOB) == (2.0, "floor")  # 5 x 0.2 s is under the floor
    steps(tracker, clock, [0], [1.0] * 10, start=step)
    assert tracker.timeout(JOB) == (5.0, "learned")
    # A new process (the worker restarted): its first steps warm up again.
    clock.advance(1.0)
    tracker.report(JOB, 0, 3, pid=999)
    clock.advance(59.0)
    assert tracker.check(JOB) is None
    clock.advance(1.0)
    hang = tracker.check(JOB)
    assert hang is not None and hang.reason == ("no progress for 60 s (learned hang timeout, "
                                                "first steps)")


def test_learning_survives_a_restart_and_a_restart_for_it_doubles_it(clock):
    tracker = ProgressTracker(LearnedTimeout(floor=1.0, first_step=30.0), clock)
    steps(tracker, clock, [0], [0.0, 1.0, 1.0] + [2.0] * 20)
    assert tracker.timeout(JOB) == (10.0, "learned")
    clock.advance(10.0)
    hang = tracker.check(JOB)
    assert hang is not None
    tracker.restarted_for(hang)
    tracker.reset(JOB)
    assert tracker.timeout(JOB) == (20.0, "learned")
    # A set timeout's hang doubles nothing.
    fixed = ProgressTracker(5.0, clock)
    fixed.report(JOB, 0, 1, pid=1)
    clock.advance(5.0)
    fixed.restarted_for(fixed.check(JOB))
    assert fixed.timeout(JOB) == (5.0, "set")


def test_nothing_is_decided_before_a_groups_first_report(clock):
    """A restarted group may wait in its rendezvous for nodes for as long as it must."""
    tracker = ProgressTracker(LearnedTimeout(floor=1.0, first_step=30.0), clock)
    tracker.reset(JOB)
    clock.advance(10_000.0)
    assert tracker.check(JOB) is None  # a job that never reports is never called hung
    steps(tracker, clock, [0], [0.0, 1.0, 1.0, 1.0])
    tracker.reset(JOB)
    clock.advance(10_000.0)
    assert tracker.check(JOB) is None
    assert tracker.status(JOB)["startup_timeout_seconds"] is None


def test_status_says_what_is_in_force(clock):
    tracker = ProgressTracker(LearnedTimeout(floor=1.0, first_step=30.0), clock)
    steps(tracker, clock, [0], [0.0, 1.0, 1.0, 0.5, 0.25])
    st = tracker.status(JOB)
    assert st["hang_timeout_seconds"] == 2.5 and st["hang_timeout_source"] == "learned"
    assert st["learned"] == {"floor_seconds": 1.0, "first_step_seconds": 30.0, "factor": 5.0,
                             "window": 1000, "longest_step_seconds": 0.5, "steps_learned": 2,
                             "doublings": 0}


def test_the_elasticctl_jobs_cell():
    import dataclasses

    from elasticd.cli.jobs import _hang_timeout
    from elasticd.cluster.jobspec import JobSpec

    spec = JobSpec(name="j", nnodes_min=1, nnodes_max=2, nproc_per_node=1, script="/x",
                   args=[], script_sha256="0" * 64, user="u", cwd="/")
    assert spec.hang_timeout is None  # learned unless set
    assert _hang_timeout(spec, []) == "learned"
    assert _hang_timeout(dataclasses.replace(spec, hang_timeout=300.0), []) == "set 300 s"
    assert _hang_timeout(dataclasses.replace(spec, hang_timeout=0.0), []) == "off"
    node = {"hang_timeout": 7.5, "hang_timeout_source": "learned"}
    assert _hang_timeout(spec, [node]) == "learned 7.5 s"
    assert _hang_timeout(spec, [node, {**node, "hang_timeout": 8.0}]) == "learned 7.5-8 s"
    assert _hang_timeout(spec, [{"hang_timeout": 0.0, "hang_timeout_source": ""}]) == "learned"


def test_a_rank_whose_process_is_gone_is_restarting_not_stalled(clock):
    """torchrun restarts a group whose worker died (or that a joining node re-forms); the
    rendezvous and restore after it may outlast any timeout learned from steps."""
    import os
    import subprocess
    import sys

    from elasticd.agent.supervisor import process_runs

    gone = {101}
    tracker = ProgressTracker(LearnedTimeout(floor=1.0, first_step=30.0), clock,
                              alive=lambda pid: pid not in gone)
    steps(tracker, clock, [0, 1], [0.0, 1.0, 1.0, 1.0])
    clock.advance(10_000.0)
    hang = tracker.check(JOB)
    assert [r.rank for r in hang.ranks] == [0]  # rank 1's process (pid 101) is gone
    gone.add(100)
    assert tracker.check(JOB) is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_runs(os.getpid()) and not process_runs(child.pid)


def test_job_specs_learned_set_old_and_hostile():
    import json

    from elasticd.cluster.jobspec import JobSpec
    from elasticd.coordination import records

    spec = JobSpec(name="j", nnodes_min=1, nnodes_max=2, nproc_per_node=1, script="/x",
                   args=[], script_sha256="0" * 64, user="u", cwd="/")
    raw = spec.encode()
    body = json.loads(raw)
    # Learned: no field (an older daemon reads its own default, 300 s, and runs the job).
    assert "hang_timeout" not in body and body["hang_timeout_floor"] == 60.0
    assert JobSpec.decode(raw, job="j") == spec
    old = {k: v for k, v in body.items() if not k.startswith("hang_")}
    old["hang_timeout"] = 300.0  # as submitted before the learned rule: kept as set
    assert JobSpec.decode(json.dumps(old).encode(), job="j").hang_timeout == 300.0
    assert JobSpec.decode(json.dumps({**body, "hang_timeout": None}).encode()).hang_timeout \
        is None
    for field, value, match in [("hang_timeout_floor", 0, "--hang-timeout-floor"),
                                ("hang_first_step", -5, "--hang-first-step"),
                                ("hang_timeout_floor", "60", "expected a finite number")]:
        with pytest.raises(records.CorruptRecord, match=match):
            JobSpec.decode(json.dumps({**body, field: value}).encode())
