"""This node's job status entry alone (elasticd/agent/job_status.py), on the in-memory etcd."""

from __future__ import annotations

import threading

from elasticd.agent.job_status import JobStatusBoard
from elasticd.cluster.jobspec import JobState, NodeJobStatus
from elasticd.coordination.keys import Keyspace
from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator

KEYS = Keyspace("/t")


def board(lease=None):
    coord = MemoryCoordinator()
    lease = coord.grant_lease(10) if lease is None else lease
    return coord, JobStatusBoard("n1", coord, KEYS, lambda: lease, FakeClock(5.0))


def published(coord, job="job"):
    kv = coord.get(KEYS.job_keys(job).node("n1"))
    return None if kv is None else NodeJobStatus.decode(kv.value)


def test_a_new_state_starts_the_status_over_and_names_its_job():
    coord, b = board()
    b.set(JobState.RUNNING, "agent started", about="job", agent_pid=7)
    b.edit(lambda st: {"ranks": [0], "last_step": 3})
    assert b.status.ranks == [0] and b.about == "job"
    b.set(JobState.RESTARTING, "agent exited with 1")
    assert (b.status.state, b.status.ranks, b.status.last_step) == ("restarting", [], -1)
    assert b.about == "job"  # not named: still about the same job


def test_publish_writes_a_change_under_the_lease_and_not_a_step_alone():
    coord, b = board()
    b.set(JobState.RUNNING, "agent started", about="job")
    b.publish()
    assert published(coord).state == "running"
    b.edit(lambda st: {"last_step": 50})
    b.publish()
    assert published(coord).last_step == -1  # a step alone is no etcd write
    b.edit(lambda st: {"ranks": [1]})
    b.publish()
    assert published(coord).ranks == [1] and published(coord).last_step == 50
    b.set(JobState.REFUSED, "no", about="other")
    b.publish("job")  # under the job asked for
    assert published(coord).state == "refused" and published(coord, "other") is None


def test_nothing_is_published_without_a_lease_or_a_job():
    coord, b = board(lease=0)
    b.set(JobState.RUNNING, "x", about="job")
    b.publish()
    assert published(coord) is None
    coord2, b2 = board()
    b2.publish()  # about no job yet
    assert coord2.get_prefix(KEYS.jobs)[0] == []


def test_a_lost_entry_is_written_again_and_a_withdrawn_one_deleted():
    coord, b = board()
    b.set(JobState.REFUSED, "no", about="job")
    b.publish()
    coord.delete(KEYS.job_keys("job").node("n1"))  # etcd lost its data
    b.publish()
    assert published(coord) is None  # unchanged: not written again...
    b.lost()
    b.publish()
    assert published(coord).state == "refused"  # ...until told it went
    b.withdraw("job")
    assert published(coord) is None


def test_edits_from_other_threads_are_not_lost():
    coord, b = board()
    b.set(JobState.RUNNING, "x", about="job")

    def add(rank):
        for _ in range(200):
            b.edit(lambda st: {"ranks": sorted({*st.ranks, rank})})

    threads = [threading.Thread(target=add, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.status.ranks == list(range(8))
    before = b.edit(lambda st: {})
    assert before is b.status  # no change: the same status
