"""Crash-loop detection's pure decisions (elasticd.agent.crashloop), alone."""

from __future__ import annotations

import os

import pytest

from elasticd.agent import crashloop
from elasticd.agent.crashloop import LoopState, after_restart, verdict


def run(history, limit):
    """Feeds (committed, failure) restarts in order; returns the first verdict and when."""
    state = LoopState()
    for i, (committed, failure) in enumerate(history, 1):
        state = after_restart(state, committed, failure)
        why = verdict(state, limit)
        if why:
            return i, why
    return None, None


def test_the_same_failure_at_the_same_step_stops_after_limit_restarts_without_progress():
    boom = "RuntimeError: boom at step 30"
    # The first attempt committed step 29 (progress); then three attempts commit nothing new.
    at, why = run([((0, 29), boom)] * 6, limit=3)
    assert at == 4
    assert why.startswith("crash loop: 3 worker group restarts in a row")
    assert "last committed: step 29" in why and why.endswith("last failure: " + boom)


def test_progress_between_failures_resets_the_count():
    history = [((0, 10 * i), f"failure {i}") for i in range(1, 20)]  # each attempt commits more
    assert run(history, limit=2) == (None, None)
    stuck = [((0, 10), "a"), ((0, 10), "b"), ((0, 20), "c"), ((0, 20), "d"), ((0, 20), "e")]
    at, why = run(stuck, limit=2)
    assert at == 5 and why.endswith("last failure: e")


def test_crash_during_set_up_counts_with_nothing_ever_committed():
    at, why = run([(None, "ImportError: no module named x")] * 5, limit=3)
    assert at == 3 and "last committed: nothing" in why


def test_a_new_generation_counts_as_progress_and_limit_zero_is_off():
    assert run([((0, 50), "x"), ((1, 40), "x"), ((1, 40), "x")], limit=2) == (None, None)
    assert run([(None, "x")] * 50, limit=0) == (None, None)


@pytest.mark.parametrize("text,want", [
    ("step 29\nTraceback (most recent call last):\n  File \"t.py\", line 9, in <module>\n"
     "    raise RuntimeError('boom at step 30')\nRuntimeError: boom at step 30\n"
     "[W] torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1)\n",
     "RuntimeError: boom at step 30"),
    # torchrun's own ChildFailedError traceback after the worker's is not the failure
    ("Traceback (most recent call last):\n  File \"t.py\"\nValueError: bad batch\n"
     "Traceback (most recent call last):\n  File \"run.py\"\n"
     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
     "ValueError: bad batch"),
    ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"t.py\"\n"
     "[rank0]: KeyError: 'x'\n", "KeyError: 'x'"),
    ("just some output\nno traceback here\n", ""),
])
def test_failure_summary_is_the_workers_last_exception_line(text, want):
    assert crashloop.failure_summary(text) == want


def test_attempts_reads_the_newest_agents_restart_count(tmp_path):
    d = str(tmp_path)
    assert crashloop.attempts(d, set()) == -1
    os.makedirs(os.path.join(d, "job_old1", "attempt_7"))
    known = crashloop.runs(d)
    assert crashloop.attempts(d, known) == -1  # an earlier agent's run does not count
    os.makedirs(os.path.join(d, "job_new2", "attempt_0", "0"))
    assert crashloop.attempts(d, known) == 0
    os.makedirs(os.path.join(d, "job_new2", "attempt_2", "0"))
    assert crashloop.attempts(d, known) == 2
    assert crashloop.attempts(os.path.join(d, "missing"), set()) == -1


def test_a_job_that_gives_no_step_counts_only_short_attempts():
    state = LoopState()
    for _ in range(4):
        state = after_restart(state, None, "x", seconds=crashloop.BLIND_ATTEMPT_SECONDS + 1)
    assert state.restarts == 0 and verdict(state, 3) is None
    for _ in range(3):
        state = after_restart(state, None, "x", seconds=5)
    assert verdict(state, 3) is not None


def test_a_node_that_saw_no_traceback_waits_one_restart_for_the_node_that_did():
    from elasticd.agent import crashloop

    silent = crashloop.LoopState(best=(0, 29), restarts=2, failure=crashloop.NO_TRACEBACK)
    assert crashloop.verdict(silent, 2) is None  # the peer whose worker raised decides first
    silent = crashloop.LoopState(best=(0, 29), restarts=3, failure=crashloop.NO_TRACEBACK)
    assert "without a Python traceback" in crashloop.verdict(silent, 2)
    raised = crashloop.LoopState(best=(0, 29), restarts=2, failure="RuntimeError: boom")
    assert crashloop.verdict(raised, 2).endswith("last failure: RuntimeError: boom")
