"""SIGTERM to a daemon running a job: the workers stop only after their snapshot in flight is
sealed (new ones are refused meanwhile), the node leaves with its lease revoked (a ``left``
event, its record gone at once rather than after a TTL), and the daemon exits 0 with no
process of the job left.

Limit: with the pause before the stop removed, this test failed only 1 run in 9 here (a torn
slot): torchrun's own SIGTERM handling usually outlasts a 0.1 s copy. It checks the property
end to end; the pause itself (refuse new snapshots, wait for the one in flight) is pinned by
tests/unit/test_drainer.py::test_quiesce_refuses_new_snapshots_and_waits_for_the_one_in_flight."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from elasticd.store.shm import SlotStore
from elasticd.launcher import JOB_USER, LocalCluster

pytestmark = [pytest.mark.etcd]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "big_state.py")
STEP_RE = re.compile(r"step (\d+) saved (\d)")


def agent_log(c, node):
    p = os.path.join(c.workdir, node, "jobs", "big", "agent.log")
    return open(p, errors="replace").read() if os.path.exists(p) else ""


@pytest.mark.timeout(180)
def test_sigterm_stops_workers_after_their_snapshot_and_revokes_the_lease(tmp_path):
    c = LocalCluster(["g1"], workdir=str(tmp_path), lease_ttl=5)
    try:
        c.start()
        env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
        subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "big", "--nnodes",
                        "1", "--nproc-per-node", "1", "--user", JOB_USER, "--", WORKER, "160"],
                       env=env, check=True, capture_output=True, timeout=60)
        c.wait_for(lambda: len(STEP_RE.findall(agent_log(c, "g1"))) > 20, 120, "20 steps")
        node = c.nodes["g1"]
        # SIGTERM right after a worker started a snapshot: its copy is in flight (~0.1 s for
        # 160 MiB), the moment a stop that does not wait would tear it
        seen = len(STEP_RE.findall(agent_log(c, "g1")))
        c.wait_for(lambda: STEP_RE.findall(agent_log(c, "g1"))[seen:] and
                   STEP_RE.findall(agent_log(c, "g1"))[-1][1] == "1", 30,
                   "a snapshot started", interval=0.002)
        node.signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0
        assert node.tagged() == [], "processes of the job outlived the daemon"
        # lease revoked: the record is gone now, not a TTL (5 s) later, and peers read why
        assert c.coordinator().get(c.keys.node("g1")) is None
        assert [e["kind"] for e in c.events() if e["node"] == "g1"][-1] == "left"

        started = [int(s) for s, ok in STEP_RE.findall(agent_log(c, "g1")) if ok == "1"]
        store = SlotStore(node.shm_dir)
        found = store.scan()
        store.close(unlink=True)
        assert found.removed == [], f"torn or unverifiable snapshots left: {found.removed}"
        newest = max(step for _, _, _, step in found.kept)
        # the last snapshot a worker started is the newest sealed one: it was not cut short
        assert newest == started[-1], (newest, started[-5:])
    finally:
        c.stop()
