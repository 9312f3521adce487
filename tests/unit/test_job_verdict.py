"""A job as a whole from its nodes' statuses (elasticd/cluster/job_verdict.py, pure)."""

from __future__ import annotations

import pytest

from elasticd.cluster import job_verdict as jv
from elasticd.cluster.jobspec import JobControl, JobState, NodeJobStatus

ROOT = "runs as root, which this node refuses: submit with --user NAME, or list root ..."


def st(node, state, detail=""):
    return NodeJobStatus(node, JobState(state), detail)


def control(desired, reason=""):
    return JobControl(JobState(desired), 1.0, "elasticctl", reason)


@pytest.mark.parametrize("min_nodes,ctl,statuses,live,state,why", [
    # refused everywhere: not "running", and the reason once for the nodes that share it
    (1, None, [st("n1", "refused", ROOT), st("n2", "refused", ROOT)], ["n1", "n2"],
     "refused", f"refused on n1, n2: {ROOT}; no node will run it"),
    # refused on one node of two, for a job that needs both: it will never start
    (2, None, [st("n1", "refused", "script differs")], ["n1", "n2"], "refused",
     "refused on n1: script differs; the 1 other node cannot run it alone (it needs 2)"),
    # refused on one node, the other may still run it: wait for its answer
    (1, None, [st("n1", "refused", "script differs")], ["n1", "n2"], "waiting",
     "no answer yet from n2"),
    (1, None, [st("n1", "refused", "x"), st("n2", "running")], ["n1", "n2"], "running",
     "running on n2"),
    # finished: one node's agent succeeded (the rendezvous is closed for all)
    (2, None, [st("n1", "succeeded"), st("n2", "stopped")], ["n1", "n2"], "succeeded",
     "finished: succeeded on n1"),
    (2, control("failed", "crash loop: 5 restarts"), [st("n1", "failed")], ["n1"], "failed",
     "crash loop: 5 restarts"),
    (2, control("stopped"), [st("n1", "running")], ["n1"], "stopping", "stopping on n1"),
    (2, control("stopped"), [st("n1", "stopped")], ["n1"], "stopped", "stopped by elasticctl"),
    # an agent that died too often on the only node
    (1, None, [st("n1", "failed", "agent exited 1 too often")], ["n1"], "failed",
     "failed on n1: agent exited 1 too often; no node will run it"),
    (1, None, [], [], "waiting", "waiting for nodes (it needs 1)"),
])
def test_judge(min_nodes, ctl, statuses, live, state, why):
    v = jv.judge(min_nodes, ctl, statuses, live)
    assert (v.state, v.why) == (state, why)


def test_settled_once_every_live_node_answered_or_the_job_cannot_run():
    assert not jv.judge(1, None, [st("n1", "running")], ["n1", "n2"]).settled
    assert jv.judge(1, None, [st("n1", "running"), st("n2", "refused", "x")],
                    ["n1", "n2"]).settled
    assert jv.judge(3, None, [st("n1", "refused", "x")], ["n1", "n2", "n3"]).settled
    assert jv.judge(1, None, [], []).settled  # no node alive: nothing to wait for


def test_refusals_group_nodes_by_reason():
    assert jv.refusals({"n3": "b", "n1": "a", "n2": "a"}) == "n1, n2: a; n3: b"


def test_a_node_waiting_for_the_jobs_files_says_so():
    """A script not deployed yet is not a refusal (docs/jobs.md): the job waits, naming where."""
    v = jv.judge(2, None, [st("n1", JobState.RUNNING),
                           st("n2", JobState.IDLE, "waiting: script '/x.py' is not on this node")],
                 ["n1", "n2"])
    assert v.state == jv.RUNNING  # one node runs it: the job as a whole runs
    v = jv.judge(2, None, [st("n1", JobState.IDLE, "waiting: script '/x.py' is not on this node"),
                           st("n2", JobState.IDLE, "waiting: script '/x.py' is not on this node")],
                 ["n1", "n2"])
    assert (v.state, v.why) == (jv.WAITING, "waiting on n1, n2: script '/x.py' is not on this node")
