"""JobManager decisions on an in-memory etcd: a job that succeeded on a peer is over here too."""

from __future__ import annotations

import os
import sys

import pytest

from elasticd.agent import safe_open
from elasticd.agent.manager import JobManager
from elasticd.testing.clock import FakeClock
from elasticd.cluster.jobspec import JobControl, JobSpec, NodeJobStatus
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.metrics import Metrics


@pytest.fixture
def env(tmp_path):
    coord = MemoryCoordinator()
    keys = Keyspace("/t")
    lease = coord.grant_lease(10)
    spec = JobSpec(name="job", nnodes_min=2, nnodes_max=3, nproc_per_node=1,
                   script=sys.executable, args=[], script_sha256="0" * 64, user="root",
                   cwd=str(tmp_path))
    coord.put(keys.job_keys("job").spec, spec.encode())
    mgr = JobManager("n1", coord, keys, etcd="127.0.0.1:1", state_dir=str(tmp_path),
                     metrics=Metrics(), lease=lambda: lease, clock=FakeClock())
    mgr.records.start_watch()
    yield coord, keys, mgr, lease
    mgr.records.close()


def _peer(coord, keys, lease, node: str, state: str) -> None:
    coord.put(keys.job_keys("job").node(node), NodeJobStatus(node, state).encode(), lease)


def test_a_job_is_wanted_until_a_peer_reports_it_succeeded(env):
    coord, keys, mgr, lease = env
    _peer(coord, keys, lease, "n2", "running")
    mgr.records.refresh()
    assert mgr.wanted() == "job"
    _peer(coord, keys, lease, "n2", "succeeded")
    mgr.records.refresh()
    assert mgr.records.succeeded_on("job", "n1") == ["n2"]
    assert mgr.wanted() is None


def test_a_node_restarting_its_agent_records_the_peers_success_instead(env):
    coord, keys, mgr, lease = env
    ended: list[str] = []
    mgr.on_job_end.append(ended.append)
    # As after _check_agent saw the agent exit non-zero and scheduled a restart.
    mgr.board.set("restarting", "agent exited with 1", about="job", agent_starts=2)
    _peer(coord, keys, lease, "n3", "succeeded")
    mgr.step()
    assert mgr.job is None and mgr.supervisor is None
    assert mgr.board.status.state == "succeeded" and "n3" in mgr.board.status.detail
    assert ended == ["job"]
    kvs, _ = coord.get_prefix(keys.job_keys("job").node("n1"))
    assert NodeJobStatus.decode(kvs[0].value).state == "succeeded"
    mgr.step()  # and stays finished: nothing is started again
    assert mgr.job is None and ended == ["job"]


def test_a_running_agent_is_not_stopped_because_a_peer_finished_first(env):
    coord, keys, mgr, lease = env
    mgr.group.job = "job"  # as if this node's agent were running the job
    _peer(coord, keys, lease, "n2", "succeeded")
    mgr.records.refresh()
    assert mgr.wanted() == "job"


class StandInAgent:
    """A running agent as the manager sees it: its log and torchrun's attempt directories."""

    def __init__(self, log_dir):
        self.log_dir = str(log_dir)
        self.log_path = os.path.join(self.log_dir, "agent.log")
        self.pid, self.starts, self.stopped = 0, 1, False
        os.makedirs(os.path.join(self.log_dir, "torchrun", "job_x1", "attempt_0"))
        open(self.log_path, "w").close()
        self.log_fd = os.open(self.log_path, os.O_RDONLY)  # as the supervisor keeps it

    def log_size(self):
        return os.fstat(self.log_fd).st_size

    def log_tail(self, start, limit=65536):
        return safe_open.read_tail(self.log_fd, start, limit).decode(errors="replace")

    def poll(self):
        return 0 if self.stopped else None

    def stop(self, grace=0.0):
        self.stopped = True
        return 0

    def tell_peer_failed(self):
        self.told = getattr(self, "told", 0) + 1

    def fail_attempt(self, n, line):
        with open(self.log_path, "a") as fh:
            fh.write(f"Traceback (most recent call last):\n  File \"t.py\"\n{line}\n")
        os.makedirs(os.path.join(self.log_dir, "torchrun", "job_x1", f"attempt_{n}"))


def running(mgr, tmp_path) -> StandInAgent:
    """``mgr`` as with its agent running the job, at step 29 committed."""
    mgr.committed = lambda job: (0, 29)
    mgr.records.refresh()
    mgr.group.job, mgr.group.supervisor = "job", StandInAgent(tmp_path / "agent")
    agent = mgr.supervisor
    mgr.group.restarts.runs_known = set()
    mgr.board.set("running", "agent started", about="job")
    return agent


def test_restarts_without_a_new_commit_fail_the_job_with_the_workers_exception(env, tmp_path):
    coord, keys, mgr, lease = env
    events = []
    mgr.record_event = lambda kind, detail, data: events.append((kind, detail))
    agent = running(mgr, tmp_path)
    limit = mgr.records.specs["job"][1].crash_loop_restarts
    for attempt in range(1, limit + 2):
        agent.fail_attempt(attempt, "RuntimeError: boom at step 30")
        mgr.step()
        if mgr.job is None:
            break
    # The first restart followed progress (step 29 committed); `limit` more did not.
    assert attempt == limit + 1
    control = JobControl.decode(coord.get(keys.job_keys("job").control).value)
    assert control.desired == "failed" and control.by == "n1"
    assert control.reason.endswith("last failure: RuntimeError: boom at step 30")
    assert events and events[0][0] == "job_failed"
    assert mgr.metrics.jobs.crash_loops._value.get() == 1
    mgr._stopping.join(5)
    assert mgr.board.status.state == "failed" and "boom at step 30" in mgr.board.status.detail


def test_restarts_seen_together_all_carry_the_exception_the_log_shows(env, tmp_path):
    """torchrun may restart a group that fails at once twice between two looks of the daemon:
    both restarts count with the exception in the log, not the second as a failure with no
    traceback (which kept the job's reason from naming the exception)."""
    coord, keys, mgr, lease = env
    agent = running(mgr, tmp_path)
    limit = mgr.records.specs["job"][1].crash_loop_restarts
    agent.fail_attempt(1, "RuntimeError: boom at step 30")
    mgr.step()  # the first restart follows progress (step 29 committed)
    for attempt in range(2, limit + 2):  # the rest between two looks
        agent.fail_attempt(attempt, "RuntimeError: boom at step 30")
    mgr.step()
    assert mgr.job is None
    control = JobControl.decode(coord.get(keys.job_keys("job").control).value)
    assert control.reason.startswith(f"crash loop: {limit} worker group restarts")
    assert control.reason.endswith("last failure: RuntimeError: boom at step 30")
    mgr._stopping.join(5)


def test_a_job_failed_elsewhere_stops_here_as_failed(env, tmp_path):
    coord, keys, mgr, lease = env
    mgr.records.refresh()
    mgr.group.job, mgr.group.supervisor = "job", StandInAgent(tmp_path / "agent")
    mgr.board.about = "job"
    mgr.group.restarts.runs_known = set()
    coord.put(keys.job_keys("job").control,
              JobControl("failed", 0.0, "n2", "crash loop: x").encode())
    mgr.records.refresh()
    mgr.step()
    mgr._stopping.join(5)
    assert mgr.board.status.state == "failed" and "crash loop: x" in mgr.board.status.detail
    assert mgr.wanted() is None


class HangAgent(StandInAgent):
    """A running agent whose workers the manager may restart (counted)."""

    def __init__(self, log_dir, spec):
        super().__init__(log_dir)
        self.spec, self.restarts = spec, []

    def restart_workers(self, why):
        self.restarts.append(why)
        return 1


def _running(mgr, tmp_path, **spec_changes):
    import dataclasses

    mgr.records.refresh()
    spec = dataclasses.replace(mgr.records.specs["job"][1], **spec_changes)
    agent = HangAgent(tmp_path / "agent", spec)
    mgr.board.set("running", "agent started", about="job")
    mgr.group.attach("job", agent)
    mgr.group.restarts.runs_known = set()
    return agent


def test_without_a_hang_timeout_the_learned_one_is_in_force_published_and_doubled(
        env, tmp_path, monkeypatch):
    from elasticd.agent import worker_group

    coord, keys, mgr, lease = env
    alive = {7: True}
    monkeypatch.setattr(worker_group, "process_runs", alive.__getitem__)
    agent = _running(mgr, tmp_path, hang_timeout_floor=1.0, hang_first_step=30.0)
    clock = mgr.clock
    mgr.step()
    assert (mgr.board.status.hang_timeout, mgr.board.status.hang_timeout_source) == (30.0, "first_step")
    for step in range(1, 30):
        mgr.group.on_progress({"job": "job", "rank": 0, "step": step, "_peer": {"pid": 7}})
        clock.advance(0.5 if step % 2 else 1.5)  # steps varying 3x
        mgr.step()
        assert agent.restarts == []
    assert (mgr.board.status.hang_timeout, mgr.board.status.hang_timeout_source) == (7.5, "learned")
    assert mgr.metrics.jobs.hang_timeout_seconds._value.get() == 7.5
    published = NodeJobStatus.decode(coord.get(keys.job_keys("job").node("n1")).value)
    assert (published.hang_timeout, published.hang_timeout_source) == (7.5, "learned")
    assert mgr.describe()["progress"]["hang_timeout_source"] == "learned"
    clock.advance(7.0)  # 7.5 s since the last step (0.5 s after it already passed)
    alive[7] = False  # the worker died: torchrun restarts the group, no hang
    mgr.step()
    assert agent.restarts == []
    alive[7] = True
    mgr.step()
    assert len(agent.restarts) == 1 and "learned hang timeout" in agent.restarts[0]
    assert mgr.metrics.jobs.hangs._value.get() == 1
    mgr.step()
    assert mgr.board.status.hang_timeout == 15.0  # what it learned stays; the restart doubled it


def test_a_set_hang_timeout_is_shown_as_set_and_zero_turns_it_off(env, tmp_path):
    coord, keys, mgr, lease = env
    _running(mgr, tmp_path, hang_timeout=300.0)
    mgr.step()
    assert (mgr.board.status.hang_timeout, mgr.board.status.hang_timeout_source) == (300.0, "set")
    mgr.group.detach(job_over=True)  # another job: what was learned goes
    _running(mgr, tmp_path / "b", hang_timeout=0.0)
    mgr.step()
    assert mgr.group.tracker is None
    assert (mgr.board.status.hang_timeout, mgr.board.status.hang_timeout_source) == (0.0, "")
    assert mgr.metrics.jobs.hang_timeout_seconds._value.get() == 0.0


def _round(coord, keys, *pids):
    from elasticd.rendezvous.records import RoundRecord, node_id

    members = tuple(node_id("10.0.0.%d" % i, pid, 1) for i, pid in enumerate(pids))
    coord.put(keys.rendezvous("job").round, RoundRecord(3, members).encode())


def test_a_failed_peer_aborts_the_group_unless_the_last_round_already_left_it_out(env,
                                                                                   tmp_path):
    coord, keys, mgr, lease = env
    coord.put(keys.job_keys("job").node("n2"),
              NodeJobStatus("n2", "running", agent_pid=222).encode(), lease)
    coord.put(keys.job_keys("job").node("n3"),
              NodeJobStatus("n3", "running", agent_pid=333).encode(), lease)
    agent = _running(mgr, tmp_path)
    agent.pid = 111
    mgr.records.refresh()
    # No round yet, or a round that still has n2: the group may hang on it, abort.
    assert mgr.on_peer_failed("n2") == 1
    _round(coord, keys, 111, 222, 333)
    assert mgr.on_peer_failed("n2") == 1
    # The survivors re-formed without n2 before its lease expired here: leave them running.
    _round(coord, keys, 333, 111)
    assert mgr.on_peer_failed("n2") == 0
    assert len(agent.restarts) == 2 and "already went on without it" in mgr.notes[-1]
    # Its agent restarted the group for this failure: the restart is counted all the same.
    assert mgr.metrics.jobs.worker_restarts.labels("peer_failed")._value.get() == 3
    # A round this agent is not in is no evidence (ids it cannot read, another agent): abort.
    _round(coord, keys, 333, 444)
    assert mgr.on_peer_failed("n2") == 1
    coord.put(keys.rendezvous("job").round, b"{not json")
    assert mgr.on_peer_failed("n2") == 1
    assert len(agent.restarts) == 4


def test_a_straggler_names_itself_on_its_status_and_metric_and_drains_when_the_job_asks(
        env, tmp_path):
    from elasticd.cluster.drain_record import DrainRecord

    coord, keys, mgr, lease = env
    events = []
    mgr.record_event = lambda kind, detail, data: events.append((kind, detail, data))
    for node, compute in (("n2", 0.10), ("n3", 0.11)):
        coord.put(keys.job_keys("job").node(node),
                  NodeJobStatus(node, "running", compute_seconds=compute).encode(), lease)
    _running(mgr, tmp_path, straggler_factor=1.5, straggler_steps=10, straggler_drain=True,
             nnodes_min=2)
    mgr.records.specs["job"] = (mgr.records.specs["job"][0], mgr.supervisor.spec)
    for step in range(12):
        mgr.group.on_progress({"job": "job", "rank": 0, "step": step, "compute_seconds": 0.3,
                         "_peer": {"pid": 7}})
        mgr.step()
        assert (mgr.board.status.straggler != "") == (step >= 10), step
    published = NodeJobStatus.decode(coord.get(keys.job_keys("job").node("n1")).value)
    assert published.straggler.startswith("STRAGGLER: compute 0.3 s/step")
    assert published.compute_seconds == 0.3
    assert mgr.metrics.jobs.straggler._value.get() == 1
    assert [e[0] for e in events] == ["straggler"] and events[0][2]["drain"] is True
    assert DrainRecord.decode(coord.get(keys.drain("n1")).value).by == "straggler@n1"


def test_a_straggler_is_not_drained_below_the_jobs_minimum(env, tmp_path):
    coord, keys, mgr, lease = env
    coord.put(keys.job_keys("job").node("n2"),
              NodeJobStatus("n2", "running", compute_seconds=0.1).encode(), lease)
    _running(mgr, tmp_path, straggler_steps=3, straggler_drain=True, nnodes_min=2)
    mgr.records.specs["job"] = (mgr.records.specs["job"][0], mgr.supervisor.spec)
    for step in range(6):
        mgr.group.on_progress({"job": "job", "rank": 0, "step": step, "compute_seconds": 0.5,
                         "_peer": {"pid": 7}})
        mgr.step()
    assert mgr.board.status.straggler and coord.get(keys.drain("n1")) is None


def test_status_says_when_straggler_detection_is_off_for_want_of_compute_times(env, tmp_path):
    coord, keys, mgr, lease = env
    assert mgr.group.straggler_detection() == ""
    _running(mgr, tmp_path)
    mgr.step()
    assert mgr.describe()["straggler_detection"] == "waiting for the first step"
    for step in range(1, 4):  # a script written without ComputeTimer: steps, no compute time
        mgr.group.on_progress({"job": "job", "rank": 0, "step": step, "_peer": {"pid": 7}})
        mgr.step()
    assert mgr.describe()["straggler_detection"].startswith(
        "off: the training script reports no compute time")
    mgr.group.on_progress({"job": "job", "rank": 0, "step": 4, "compute_seconds": 0.2,
                     "_peer": {"pid": 7}})
    mgr.step()
    assert mgr.describe()["straggler_detection"] == "on"


def test_an_in_process_job_is_not_killed_for_a_failed_peer_but_restarted_past_the_deadline(
        env, tmp_path):
    from elasticd.agent import job_rules
    from elasticd.cluster.jobspec import DEFAULT_REFORM_DEADLINE

    coord, keys, mgr, lease = env
    coord.put(keys.job_keys("job").node("n2"),
              NodeJobStatus("n2", "running", agent_pid=222).encode(), lease)
    agent = _running(mgr, tmp_path, in_process=True)
    agent.pid = 111
    mgr.records.refresh()
    assert mgr.on_peer_failed("n2") == 0 and agent.restarts == []
    assert "re-forms the workers in-process" in mgr.notes[-1]
    assert agent.told == 1  # the agent re-forms now, not when etcd's summary reaches it
    # The agent said it re-formed them: no restart later.
    mgr.reform.on_reformed({"job": "job", "path": "in_process"})
    mgr.clock.advance(DEFAULT_REFORM_DEADLINE + job_rules.REFORM_ROUND_ALLOWANCE + 1)
    mgr.step()
    assert agent.restarts == []
    assert mgr.metrics.rendezvous.recoveries.labels("in_process")._value.get() == 1
    # It never says so: the daemon restarts the workers at its deadline, as today.
    assert mgr.on_peer_failed("n2") == 0
    mgr.clock.advance(DEFAULT_REFORM_DEADLINE + job_rules.REFORM_ROUND_ALLOWANCE - 1)
    mgr.step()
    assert agent.restarts == []
    mgr.clock.advance(1)
    mgr.step()
    assert len(agent.restarts) == 1 and "did not re-form" in " ".join(mgr.notes)
    assert mgr.metrics.rendezvous.recoveries.labels("restart")._value.get() == 1


def test_the_daemons_backstop_follows_the_running_jobs_reform_deadline(env, tmp_path):
    """The job's ``reform_deadline`` (a spec field), not a constant: a job given 3 s is
    restarted 3 s + the round allowance after the failure (before the field: 10 s + it)."""
    from elasticd.agent import job_rules

    coord, keys, mgr, lease = env
    coord.put(keys.job_keys("job").node("n2"),
              NodeJobStatus("n2", "running", agent_pid=222).encode(), lease)
    agent = _running(mgr, tmp_path, in_process=True, reform_deadline=3.0)
    agent.pid = 111
    mgr.records.refresh()
    assert mgr.on_peer_failed("n2") == 0
    mgr.clock.advance(3.0 + job_rules.REFORM_ROUND_ALLOWANCE - 0.5)
    mgr.step()
    assert agent.restarts == []
    mgr.clock.advance(0.5)
    mgr.step()
    assert len(agent.restarts) == 1


def test_the_agents_word_ends_the_deadline_under_the_watchs_lock(env, tmp_path):
    """``reformed`` arrives on the local API's thread while the main loop starts and checks
    the deadline: ending it waits for the lock the loop's side holds."""
    import threading

    coord, keys, mgr, lease = env
    coord.put(keys.job_keys("job").node("n2"),
              NodeJobStatus("n2", "running", agent_pid=222).encode(), lease)
    _running(mgr, tmp_path, in_process=True).pid = 111
    mgr.records.refresh()
    mgr.on_peer_failed("n2")
    assert mgr.book.reform_by is not None
    with mgr.reform._lock:  # the main loop in the middle of its check
        said = threading.Thread(target=mgr.reform.on_reformed,
                                args=({"job": "job", "path": "in_process"},))
        said.start()
        said.join(0.3)
        assert said.is_alive() and mgr.book.reform_by is not None
    said.join(5)
    assert not said.is_alive() and mgr.book.reform_by is None
