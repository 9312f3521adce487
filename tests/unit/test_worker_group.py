"""The worker group alone (elasticd/agent/worker_group.py) and the straggler watch it asks
(StragglerWatch, in the same module): no manager, no etcd; a stand-in agent, a fake clock."""

from __future__ import annotations

import sys

import pytest

from elasticd.agent.job_status import JobStatusBoard
from elasticd.agent.worker_group import StragglerWatch, WorkerGroup, show_seconds
from elasticd.cluster.jobspec import JobSpec, JobState, NodeJobStatus
from elasticd.coordination.api import CoordinationError
from elasticd.coordination.keys import Keyspace
from elasticd.metrics import Metrics
from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator


def spec(**changes) -> JobSpec:
    return JobSpec(**{"name": "job", "nnodes_min": 2, "nnodes_max": 3, "nproc_per_node": 1,
                      "script": sys.executable, "args": [], "script_sha256": "0" * 64,
                      "user": "root", "cwd": "/", **changes})


class Agent:
    """What the group asks of a running agent."""

    def __init__(self, spec):
        self.spec, self.restarts = spec, []

    def restart_workers(self, why):
        self.restarts.append(why)
        return 2


class Parts:
    def __init__(self):
        self.clock, self.metrics = FakeClock(), Metrics()
        self.board = JobStatusBoard("n1", MemoryCoordinator(), Keyspace("/t"), lambda: 0,
                                    self.clock)
        self.events, self.notes, self.drains = [], [], []
        self.drain_fails = False

        def drain():
            if self.drain_fails:
                raise CoordinationError("etcd down")
            self.drains.append(1)

        self.stragglers = StragglerWatch(self.board, self.metrics, drain,
                                         lambda *e: self.events.append(e), self.notes.append)
        self.group = WorkerGroup(self.board, self.metrics, self.clock, self.stragglers)


@pytest.fixture
def parts():
    return Parts()


def gauge(metric):
    return metric._value.get()


def test_a_new_group_empties_the_ranks_and_hang_detection_follows_the_spec(parts):
    g, board = parts.group, parts.board
    board.set(JobState.RUNNING, "agent started", about="job", ranks=[3])
    g.attach("job", Agent(spec(hang_timeout=300.0)))
    assert board.status.ranks == [] and g.tracker is not None
    assert g.tracker.timeout("job") == (300.0, "set")
    tracker = g.tracker
    g.detach()  # the agent died: what hang detection learned stays for its restart
    g.attach("job", Agent(spec(hang_timeout=300.0)))
    assert g.tracker is tracker
    g.detach(job_over=True)
    g.attach("job", Agent(spec(hang_timeout=0.0)))
    assert g.tracker is None and g.progress_status() == {}


def test_progress_builds_the_ranks_and_a_new_world_or_group_starts_them_over(parts):
    g, board = parts.group, parts.board
    g.attach("job", Agent(spec()))
    g.on_progress({"job": "other", "rank": 9, "step": 1})  # not our job
    assert board.status.ranks == []
    g.on_progress({"job": "job", "rank": 1, "world_size": 4, "restart": 0, "step": 5})
    g.on_progress({"job": "job", "rank": 0, "world_size": 4, "restart": 0, "step": 5})
    assert (board.status.ranks, board.status.world_size, board.status.last_step) == (
        [0, 1], 4, 5)
    assert gauge(parts.metrics.rendezvous.round) == 1  # the first report of a generation
    g.on_progress({"job": "job", "rank": 0, "world_size": 4, "restart": 1})  # its agent
    assert board.status.ranks == [0]  # restarted the group: ranks may have moved
    g.on_progress({"job": "job", "rank": 2, "world_size": 2, "restart": 1})
    assert (board.status.ranks, board.status.world_size) == ([2], 2)
    g.detach()
    g.on_progress({"job": "job", "rank": 3, "step": 9})  # no agent: ignored
    assert board.status.ranks == [2] and board.status.last_step == 5


def test_a_hung_group_is_restarted_and_the_restart_counted_as_a_hang(parts, monkeypatch):
    from elasticd.agent import worker_group

    g, clock = parts.group, parts.clock
    agent = Agent(spec(hang_timeout=5.0))
    monkeypatch.setattr(worker_group, "process_runs", lambda pid: True)
    g.attach("job", agent)
    g.on_progress({"job": "job", "rank": 0, "step": 1, "_peer": {"pid": 7}})
    assert g.restart_if_hung() is None
    clock.advance(6.0)
    note = g.restart_if_hung()
    assert note is not None and note.startswith("restarted 2 workers of job: hang (")
    assert len(agent.restarts) == 1 and agent.restarts[0].startswith("hang: ")
    assert g.restarts.cause == agent.restarts[0]  # the crash-loop count names it
    assert gauge(parts.metrics.jobs.hangs) == 1
    assert g.restart_if_hung() is None  # a new generation: nobody reported yet


def test_the_hang_timeout_in_force_goes_to_the_status_and_the_metric(parts):
    g, board = parts.group, parts.board
    g.attach("job", Agent(spec(hang_timeout=123.0)))
    g.tick(spec(), {})
    assert (board.status.hang_timeout, board.status.hang_timeout_source) == (120.0, "set")
    assert gauge(parts.metrics.jobs.hang_timeout_seconds) == 123.0  # exact; published: 2 digits
    g.detach(job_over=True)
    g.tick(None, {})
    assert (board.status.hang_timeout, gauge(parts.metrics.jobs.hang_timeout_seconds)) == (0.0, 0.0)
    assert show_seconds(0.123456) == 0.12 and show_seconds(-1) == 0.0


def peers(*compute):
    return {f"n{i + 2}": NodeJobStatus(f"n{i + 2}", "running", compute_seconds=c)
            for i, c in enumerate(compute)}


def judge(parts, s, others, steps=12, compute=0.3):
    parts.board.set(JobState.RUNNING, "x", about="job")
    for step in range(steps):
        parts.board.edit(lambda st: {"last_step": step})
        parts.stragglers.observe("job", s, compute, others)


def test_a_straggler_is_named_once_and_drains_when_its_job_asks(parts):
    s = spec(straggler_factor=1.5, straggler_steps=10, straggler_drain=True, nnodes_min=2)
    judge(parts, s, peers(0.1, 0.11))
    assert parts.board.status.straggler.startswith("STRAGGLER: compute 0.3 s/step")
    assert gauge(parts.metrics.jobs.straggler) == 1
    assert [e[0] for e in parts.events] == ["straggler"] and parts.events[0][2]["drain"]
    assert parts.drains == [1] and len(parts.notes) == 1


def test_a_straggler_is_not_drained_below_the_minimum_nor_when_etcd_refuses(parts):
    s = spec(straggler_steps=3, straggler_drain=True, nnodes_min=2)
    judge(parts, s, peers(0.1))
    assert parts.board.status.straggler and parts.drains == []
    assert parts.events[0][2]["drain"] is False
    other = Parts()
    other.drain_fails = True
    judge(other, s, peers(0.1, 0.1))
    assert other.events[0][2]["drain"] is False


def test_without_a_running_job_no_judge_and_the_metric_follows_the_status(parts):
    judge(parts, spec(straggler_steps=3), peers(0.1, 0.1))
    assert gauge(parts.metrics.jobs.straggler) == 1
    parts.board.set(JobState.STOPPED, "x")
    parts.stragglers.observe(None, None, None, {})
    assert gauge(parts.metrics.jobs.straggler) == 0
