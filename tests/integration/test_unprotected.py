"""Loud protection state, end to end on a real etcd: for each reason a job is unprotected
(snapshots failing, no placement, commit lag) it shows in ``elasticctl jobs`` and
``elasticctl checkpoints``, in ``/status``, and in ``elasticd_jobs_unprotected{reason}``, and
it clears. (The alert rule on that metric is tested by promtool with each reason firing and
clearing: grafana/prometheus/elasticd.rules.test.yml.)

One daemon runs in-process with its real checkpoint service (a real, capped slot store), its
HTTP server and the local API's handlers; a worker's calls are made through those handlers, and
the replication view the service reads is a stand-in whose placement and commit the test sets.
The job's agent is stood in for too (``jobs.job`` set, as in the JobManager unit tests): what is
under test is what the daemon reports, not torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.clock import FakeClock
from elasticd.cluster.jobspec import JobControl, JobSpec
from elasticd.config import Settings
from elasticd.coordination.keys import Keyspace
from elasticd.daemon.daemon import Daemon
from elasticd.daemon.http import StatusServer
from elasticd.testing.transport import InProcessTransport
from tests.conftest import connect
from tests.unit.test_store_service import write_snapshot
from tests.unit.test_protection import FakeReplicator

pytestmark = [pytest.mark.etcd]


class StandInAgent:
    """What the JobManager asks of a running agent."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir, self.log_path, self.pid, self.starts = log_dir, "", 0, 1

    def poll(self):
        return None

    def stop(self, grace: float = 0.0):
        return 0

    def restart_workers(self, reason: str) -> int:
        return 0


@pytest.fixture
def node(etcd, prefix, tmp_path):
    coord = connect(etcd)
    keys = Keyspace(prefix)
    spec = JobSpec(name="j", nnodes_min=1, nnodes_max=1, nproc_per_node=1,
                   script=sys.executable, args=[], script_sha256="0" * 64, user="root",
                   cwd=str(tmp_path))
    coord.put(keys.job_keys("j").spec, spec.encode())
    coord.put(keys.job_keys("j").control, JobControl("running", 0.0, "test").encode())
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root, cap_bytes=64 << 10)
    clock = FakeClock()
    rep = FakeReplicator()
    service = CheckpointService(store, "n1", clock=clock, replicator=rep, lag_limit=10,
                                grace=5)
    daemon = None
    server = StatusServer(("127.0.0.1", 0), registry=None, status=lambda: daemon.status(),
                          healthy=lambda: True)
    settings = Settings(node_id="n1", etcd=etcd.endpoints, prefix=prefix, lease_ttl=5,
                        loop_interval=0.25, state_dir=str(tmp_path / "state"))
    daemon = Daemon(settings, coord, checkpoints=service)
    daemon.registration.http_address = server.address
    server._registry = daemon.metrics.registry
    server.start()
    daemon.join()
    # As if its agent ran the job here.
    group = daemon.jobs.group
    group.job, group.supervisor = "j", StandInAgent(str(tmp_path / "agent"))
    daemon.jobs.board.set("running", "agent started", about="j", agent_starts=1)
    try:
        yield daemon, InProcessTransport(daemon.channel.handlers()), clock, rep, server
    finally:
        daemon.jobs.group.job = daemon.jobs.group.supervisor = None
        daemon.close()
        server.stop()
        store.close()
        shutil.rmtree(root, ignore_errors=True)
        coord.close()


def ctl(daemon, *args):
    env = {**os.environ, "ELASTICD_ETCD": daemon.settings.etcd,
           "ELASTICD_PREFIX": daemon.settings.prefix}
    res = subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def seen(daemon, server) -> dict:
    """What each place says after two daemon cycles (the verdict, then its publication)."""
    daemon.cycle()
    daemon.cycle()
    import urllib.request

    with urllib.request.urlopen(f"http://{server.address}/status", timeout=5) as r:
        status = json.loads(r.read())
    with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    jobs = json.loads(ctl(daemon, "jobs", "--format", "json"))[0]
    return {
        "metric": {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^elasticd_jobs_unprotected\{reason="(\w+)"\} (\S+)$', metrics, re.M)},
        "status": status["job"]["unprotected"],
        "status_kind": status["checkpoints"]["j"]["unprotected_kind"],
        "jobs": jobs["protection"],
        "jobs_pretty": ctl(daemon, "jobs"),
        "checkpoints": ctl(daemon, "checkpoints", "j"),
    }


def assert_unprotected(view, reason, needle):
    assert view["metric"][reason] == 1, view["metric"]
    assert sum(view["metric"].values()) == 1, view["metric"]
    assert view["status"].startswith("UNPROTECTED: ") and needle in view["status"]
    assert view["status_kind"] == reason
    assert view["jobs"].startswith("UNPROTECTED: n1: ") and needle in view["jobs"]
    assert "UNPROTECTED: n1: " in view["jobs_pretty"]
    assert "UNPROTECTED on n1: " in view["checkpoints"] and needle in view["checkpoints"]


def assert_protected(view):
    assert set(view["metric"].values()) == {0.0}, view["metric"]
    assert view["status"] == "" and view["status_kind"] == ""
    assert view["jobs"] == "ok"
    assert "UNPROTECTED" not in view["jobs_pretty"] + view["checkpoints"]


@pytest.mark.timeout(120)
def test_each_reason_shows_everywhere_and_clears(node):
    daemon, t, clock, rep, server = node
    t.call("register", job="j", rank=0, world_size=1, local_rank=0, restart=0)
    assert daemon.jobs.board.status.ranks == [0]  # placement learns the rank from the Checkpointer
    write_snapshot(t, "j", 0, 1, world=1)
    assert_protected(seen(daemon, server))  # a young job: placement is being formed

    clock.advance(6)  # no placement past the grace
    assert_unprotected(seen(daemon, server), "no_placement", "no replica placement")
    rep.jobs["j"] = {"placement": "n1 -> n2", "committed": [0, 1], "sync_lag": 0}
    assert_protected(seen(daemon, server))

    rep.jobs["j"]["sync_lag"] = 40  # replication falls behind
    assert_unprotected(seen(daemon, server), "commit_lag", "40 steps behind")
    rep.jobs["j"]["sync_lag"] = 1
    assert_protected(seen(daemon, server))

    reply, _ = write_snapshot(t, "j", 0, 2, world=1, n=100_000)  # over the memory cap
    assert reply["skip"] and reply["unprotected"].startswith("UNPROTECTED: snapshots failing")
    assert_unprotected(seen(daemon, server), "snapshots_failing", "over the memory cap")
    write_snapshot(t, "j", 0, 3, world=1)  # fits again
    assert_protected(seen(daemon, server))
