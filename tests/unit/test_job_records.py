"""The job records a node follows (elasticd/agent/job_records.py) alone, on the in-memory
etcd: no manager."""

from __future__ import annotations

import logging
import sys

import pytest

from elasticd.agent.job_records import JobRecords
from elasticd.cluster.jobspec import JobControl, JobSpec, JobState, NodeJobStatus
from elasticd.coordination import records
from elasticd.coordination.keys import Keyspace
from elasticd.rendezvous.records import RoundRecord, node_id
from elasticd.testing.coordination import MemoryCoordinator

KEYS = Keyspace("/t")


def spec(name="job"):
    return JobSpec(name=name, nnodes_min=1, nnodes_max=2, nproc_per_node=1,
                   script=sys.executable, args=[], script_sha256="0" * 64, user="root", cwd="/")


@pytest.fixture
def env():
    coord = MemoryCoordinator()
    seen = {"resync": 0, "rounds": []}

    def resync():
        seen["resync"] += 1

    recs = JobRecords(coord, KEYS, resync, seen["rounds"].append,
                      records.Complaints(logging.getLogger("test")))
    yield coord, recs, seen
    recs.close()


def status(node, state):
    return NodeJobStatus(node, state).encode()


def test_the_records_are_listed_then_followed_and_reduced_for_the_rules(env):
    coord, recs, seen = env
    coord.put(KEYS.job_keys("a").spec, spec("a").encode())
    recs.start_watch()
    assert seen["resync"] == 1 and set(recs.specs) == {"a"}
    coord.put(KEYS.job_keys("b").spec, b"{not a spec")
    coord.put(KEYS.job_keys("a").control, JobControl(JobState.STOPPED, 1.0, "op", "why").encode())
    coord.put(KEYS.job_keys("a").node("n2"), status("n2", "succeeded"))
    coord.put(KEYS.job_keys("a").node("n3"), status("n3", "running"))
    coord.put(KEYS.job_keys("a").node("n1"), status("n1", "succeeded"))
    recs.refresh()
    assert seen["resync"] == 1  # followed, not listed again
    view = recs.view({"x"}, me="n1")
    assert view.created == {"a": recs.specs["a"][0], "b": recs.bad_specs["b"][0]}
    assert view.desired == {"a": JobState.STOPPED} and view.reasons == {"a": "why"}
    assert view.unreadable["b"].startswith("unreadable job spec")
    assert view.finished == {"x"} and view.succeeded_elsewhere == {"a"}
    assert recs.succeeded_on("a", "n1") == ["n2"]  # this node's own entry is not "elsewhere"
    assert recs.members["a"] == {"n3"}  # a live status only
    assert recs.refused() == {"b": view.unreadable["b"]}
    assert recs.of("a") == (recs.specs["a"][1], recs.controls["a"])
    assert recs.of("b") == (view.unreadable["b"], None)


def test_a_status_under_a_key_that_names_no_valid_node_is_no_record(env):
    coord, recs, _ = env
    recs.start_watch()
    coord.put(KEYS.job_keys("a").node("n2") + b"/x", status("n2", "running"))
    coord.put(KEYS.job_keys("a").node("n2"), status("n9", "running"))  # about another node
    recs.refresh()
    assert recs.statuses.get("a", {}) == {} and recs.members.get("a", set()) == set()


def test_a_round_record_is_noted_on_arrival(env):
    coord, recs, seen = env
    recs.start_watch()
    coord.put(KEYS.rendezvous("a").round, b"{}")
    coord.put(KEYS.rendezvous("a").prefix + b"native/nodes/x", b"{}")
    assert seen["rounds"] == ["a"]


def test_the_last_rounds_agent_pids_are_read_from_etcd(env):
    coord, recs, _ = env
    assert recs.round_pids("a") is None  # no round
    members = (node_id("10.0.0.1", 111, 1), node_id("10.0.0.2", 222, 1))
    coord.put(KEYS.rendezvous("a").round, RoundRecord(3, members).encode())
    assert recs.round_pids("a") == [111, 222]
    coord.put(KEYS.rendezvous("a").round, b"{not json")
    assert recs.round_pids("a") is None


def test_a_failed_job_is_written_into_its_control(env):
    coord, recs, _ = env
    recs.fail("a", JobControl(JobState.FAILED, 2.0, "n1", "crash loop"))
    control = JobControl.decode(coord.get(KEYS.job_keys("a").control).value)
    assert (control.desired, control.by, control.reason) == ("failed", "n1", "crash loop")


def test_after_a_data_loss_the_specs_and_controls_are_written_back_and_listed_again(env):
    coord, recs, seen = env
    coord.put(KEYS.job_keys("a").spec, spec("a").encode())
    coord.put(KEYS.job_keys("b").spec, spec("b").encode())
    coord.put(KEYS.job_keys("b").control, JobControl(JobState.STOPPED, 1.0, "op").encode())
    recs.start_watch()
    for key in (KEYS.job_keys("a").spec, KEYS.job_keys("b").spec, KEYS.job_keys("b").control):
        coord.delete(key)
    coord.put(KEYS.job_keys("a").spec, spec("a").encode())  # another node wrote it back first
    assert recs.republish() == 1  # b's only: create-if-absent
    assert JobControl.decode(coord.get(KEYS.job_keys("b").control).value).desired == "stopped"
    recs.refresh()
    assert seen["resync"] == 2 and set(recs.specs) == {"a", "b"}
