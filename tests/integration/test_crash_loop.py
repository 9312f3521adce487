"""Crash-loop detection on real daemons, agents and workers: a worker that raises the same
exception at step 30 every time stops the job as ``failed`` on every node, with that exception
as the reason (elasticctl jobs, /status, an event, a metric), after crash_loop_restarts
restarts in a row without a new committed step, within a bounded time, leaving nothing
running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from elasticd.launcher import JOB_USER, LocalCluster

pytestmark = [pytest.mark.etcd]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "crash_at_step.py")
REASON = "RuntimeError: boom at step 30"


def ctl(c: LocalCluster, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
    return subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(180)
def test_the_same_exception_every_time_fails_the_job_everywhere_with_its_reason(tmp_path):
    c = LocalCluster(["n1", "n2"], workdir=str(tmp_path), lease_ttl=2, replication=True)
    try:
        c.start()
        res = ctl(c, "submit", "loop", "--nnodes", "2", "--nproc-per-node", "1", "--user",
                  JOB_USER, "--crash-loop-restarts", "2", "--", WORKER, "30")
        assert res.returncode == 0, res.stderr
        started = time.monotonic()

        def failed_everywhere():
            jobs = json.loads(ctl(c, "jobs", "--format", "json").stdout)
            nodes = jobs[0]["nodes"] if jobs else {}
            return (jobs and jobs[0]["desired"] == "failed" and len(nodes) == 2
                    and all(st["state"] == "failed" for st in nodes.values()) and jobs[0])

        job = c.wait_for(failed_everywhere, 150, "the job failed on both nodes", interval=0.5)
        took = time.monotonic() - started
        print(f"failed after {took:.1f} s: {job['reason']}")
        # At least the limit: torchrun may restart a group that fails at once again before
        # the daemon's next cycle counts (CI saw 3 at a limit of 2, on both nodes at once).
        counted = re.match(r"crash loop: (\d+) worker group restarts in a row", job["reason"])
        assert counted and int(counted.group(1)) >= 2, job["reason"]
        assert job["reason"].endswith(REASON), job["reason"]
        assert job["protection"] == job["reason"]
        assert all(REASON in st["detail"] for st in job["nodes"].values()), job["nodes"]
        pretty = ctl(c, "jobs").stdout
        assert "failed" in pretty and REASON in pretty, pretty

        events = [e for e in c.events() if e["kind"] == "job_failed"]
        assert events and REASON in events[0]["detail"]
        decided = events[0]["node"]
        metrics = c.nodes[decided].http("/metrics")
        assert re.search(r"^elasticd_crash_loops_total 1\.0$", metrics, re.M)
        for n in c.nodes.values():
            st = n.http("/status")["job"]
            assert st["state"] == "failed" and REASON in st["detail"]
        # Nothing left running, and no attempt beyond the few the limit allows.
        c.wait_for(lambda: not any(n.tagged() for n in c.nodes.values()), 30,
                   "no process of the job left")
        attempts = []
        for node in c.nodes:
            base = os.path.join(str(tmp_path), node, "jobs", "loop", "torchrun")
            attempts += [a for run in os.listdir(base) for a in os.listdir(os.path.join(base, run))]
        # torchrun restarts a group that fails at once several times a second, faster than
        # the daemon's cycle sees and stops them: a few more than the limit, never unbounded.
        assert len(attempts) <= 2 * 10, attempts
    finally:
        c.stop()
