"""JobManager decisions on an in-memory etcd: a job that succeeded on a peer is over here too."""

from __future__ import annotations

import sys

import pytest

from elasticd.agent.manager import JobManager
from elasticd.agent.spec import JobSpec, NodeJobStatus
from elasticd.clock import FakeClock
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.memory import MemoryCoordinator
from elasticd.metrics import Metrics


@pytest.fixture
def env(tmp_path):
    coord = MemoryCoordinator()
    keys = Keyspace("/t")
    lease = coord.grant_lease(10)
    spec = JobSpec(name="job", nnodes_min=2, nnodes_max=3, nproc_per_node=1,
                   script=sys.executable, args=[], script_sha256="0" * 64, user="root",
                   cwd=str(tmp_path))
    coord.put(keys.job_spec("job"), spec.encode())
    mgr = JobManager("n1", coord, keys, etcd="127.0.0.1:1", state_dir=str(tmp_path),
                     metrics=Metrics(), lease=lambda: lease, clock=FakeClock())
    mgr.start_watch()
    yield coord, keys, mgr, lease
    mgr.close()


def _peer(coord, keys, lease, node: str, state: str) -> None:
    coord.put(keys.job_node("job", node), NodeJobStatus(node, state).encode(), lease)


def test_a_job_is_wanted_until_a_peer_reports_it_succeeded(env):
    coord, keys, mgr, lease = env
    _peer(coord, keys, lease, "n2", "running")
    mgr._drain()
    assert mgr.wanted() == "job"
    _peer(coord, keys, lease, "n2", "succeeded")
    mgr._drain()
    assert mgr.succeeded_on("job") == ["n2"]
    assert mgr.wanted() is None


def test_a_node_restarting_its_agent_records_the_peers_success_instead(env):
    coord, keys, mgr, lease = env
    ended: list[str] = []
    mgr.on_job_end.append(ended.append)
    # As after _check_agent saw the agent exit non-zero and scheduled a restart.
    mgr._status_job = "job"
    mgr.status = NodeJobStatus("n1", "restarting", "agent exited with 1", agent_starts=2)
    _peer(coord, keys, lease, "n3", "succeeded")
    mgr.step()
    assert mgr.job is None and mgr.supervisor is None
    assert mgr.status.state == "succeeded" and "n3" in mgr.status.detail
    assert ended == ["job"]
    kvs, _ = coord.get_prefix(keys.job_node("job", "n1"))
    assert NodeJobStatus.decode(kvs[0].value).state == "succeeded"
    mgr.step()  # and stays finished: nothing is started again
    assert mgr.job is None and ended == ["job"]


def test_a_running_agent_is_not_stopped_because_a_peer_finished_first(env):
    coord, keys, mgr, lease = env
    mgr.job = "job"  # as if this node's agent were running the job
    _peer(coord, keys, lease, "n2", "succeeded")
    mgr._drain()
    assert mgr.wanted() == "job"
