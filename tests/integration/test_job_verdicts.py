"""What ``elasticctl submit`` and ``jobs`` say of a job the nodes refuse, and of one that
finished: on real daemons (two nodes, real etcd, real torchrun agents).

Each node's policy decides whether it runs a job; before, a job every node refused was
"submitted": true with exit 0, and ``jobs`` showed it as wanted "running", protection "ok".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elasticd.launcher import JOB_USER, LocalCluster

pytestmark = [pytest.mark.etcd]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")


def ctl(c, *args):
    env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
    return subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def jobs(c) -> dict:
    res = ctl(c, "jobs", "--format", "json")
    assert res.returncode == 0, res.stderr
    return {j["job"]: j for j in json.loads(res.stdout)}


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(["n1", "n2"], workdir=str(tmp_path), lease_ttl=2)
    try:
        c.start()
        c.wait_for(lambda: all(c.registered(n) for n in c.nodes), 30, "both nodes registered")
        yield c
    finally:
        c.stop()


@pytest.mark.timeout(180)
def test_a_job_every_node_refuses_fails_submit_and_a_finished_job_shows_finished(cluster):
    c = cluster
    # The nodes' default policy runs no job as root.
    started = time.monotonic()
    res = ctl(c, "submit", "as-root", "--nnodes", "1:2", "--nproc-per-node", "1", "--user",
              "root", "--", TRAIN, "--steps", "1")
    waited = time.monotonic() - started
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("elasticctl: error: job 'as-root' will not run: refused on "
                               "n1, n2: runs as root, which this node refuses")
    # ...with the fix the node's reason names, and what to do next.
    assert "submit with --user NAME, or list root in the daemons' job_users" in lines[0]
    assert "submit it again under another name" in lines[0]
    assert waited < 30
    row = jobs(c)["as-root"]
    assert (row["state"], row["protection"]) == ("refused", "-")
    assert row["running_on"].startswith("refused on n1,n2")

    # A job that runs and ends: submit answers once both nodes run it; jobs says when it is over.
    res = ctl(c, "submit", "short", "--nnodes", "2", "--nproc-per-node", "1", "--user",
              JOB_USER, "--format", "json", "--", TRAIN, "--steps", "3")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["state"] == "running" and doc["refused"] == {}, doc
    c.wait_for(lambda: jobs(c)["short"]["state"] == "succeeded", 120, "the job finished")
    row = jobs(c)["short"]
    assert row["desired"] == "running"  # what was asked, unchanged; state says it is over
    assert row["state_detail"].startswith("finished: succeeded on")
    assert row["protection"] == "-"
    pretty = ctl(c, "jobs").stdout
    assert any(line.split()[:2] == ["short", "succeeded"] for line in pretty.splitlines())

    # --no-wait: stored, not waited for.
    res = ctl(c, "submit", "as-root-2", "--no-wait", "--nnodes", "1", "--nproc-per-node", "1",
              "--user", "root", "--", TRAIN)
    assert res.returncode == 0 and "not waited for" in res.stdout, (res.stdout, res.stderr)
