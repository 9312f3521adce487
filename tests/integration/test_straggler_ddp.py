"""Straggler detection on real daemons, torchrun and DDP over gloo: three nodes train, one of
them slowed on purpose (a sleep in its workers' forward). Every rank steps at the slow node's
pace, so step times name nobody; each node's compute time outside the all-reduce does. The slow
node, and only it, names itself a straggler within 50 steps, on every surface (its metric and
/status, any node's /status, `elasticctl jobs`, the event history), and with --straggler-drain
it is drained: the job goes on at the other two, at their own pace."""

from __future__ import annotations

import json
import os
import re
import statistics

import pytest

from elasticd.launcher import JOB_USER, LocalCluster
from tests.integration.test_jobs import agent_log, ctl

pytestmark = [pytest.mark.etcd]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                      "ddp_straggler.py")
STEP = re.compile(r"^step (\d+) world (\d+) node \S+ t=([\d.]+)$", re.M)


def straggler_metric(node) -> float:
    return sum(float(line.split()[-1]) for line in node.http("/metrics").splitlines()
               if line.startswith("elasticd_straggler "))


def step_times(log: str, world: int) -> list[float]:
    """Intervals between consecutive steps of one attempt at ``world``."""
    rows = [(int(s), float(t)) for s, w, t in STEP.findall(log) if int(w) == world]
    return [b[1] - a[1] for a, b in zip(rows, rows[1:]) if b[0] == a[0] + 1]


@pytest.mark.timeout(240)
def test_the_slow_node_alone_is_named_a_straggler_and_drained_and_the_job_speeds_up(tmp_path):
    c = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path), lease_ttl=2)
    try:
        c.start()
        n1, n2, n3 = (c.nodes[n] for n in ("n1", "n2", "n3"))
        ctl(c.etcd, c.prefix, "submit", "slow", "--nnodes", "2:3", "--nproc-per-node", "1",
            "--user", JOB_USER, "--straggler-steps", "10", "--straggler-drain", "--",
            WORKER, "--steps", "250", "--slow-node", "n2", "--slow", "0.1", check=True)
        c.wait_for(lambda: straggler_metric(n2) == 1, 150, "n2 named a straggler",
                   interval=0.25)
        mine = n2.http("/status")["job"]
        assert mine["straggler"].startswith("STRAGGLER: compute "), mine
        assert mine["straggler_detection"] == "on", mine
        # Any node's /status shows every published verdict: n2's alone.
        c.wait_for(lambda: list(n1.http("/status")["job"].get("stragglers") or {}) == ["n2"],
                   10, "n1's /status names n2")
        jobs = json.loads(ctl(c.etcd, c.prefix, "jobs", "--format", "json", check=True).stdout)
        assert jobs[0]["stragglers"].startswith("n2 (compute "), jobs[0]
        assert [n for n, st in jobs[0]["nodes"].items() if st["straggler"]] == ["n2"]
        assert jobs[0]["nodes"]["n1"]["compute_seconds"] > 0
        assert straggler_metric(n1) == 0 and straggler_metric(n3) == 0
        hist = json.loads(ctl(c.etcd, c.prefix, "history", "--kind", "straggler", "--format",
                              "json", check=True).stdout)
        assert [e["node"] for e in hist] == ["n2"], hist
        named_at = hist[0]["data"]["step"]
        print(f"n2 named a straggler at step {named_at}: {mine['straggler']}")
        assert named_at <= 50 and hist[0]["data"]["drain"] is True

        # Drained: the job goes on at n1 and n3 (a new attempt at world 2) to its end.
        c.wait_for(lambda: "done node n1 world 2" in agent_log(c, "n1", "slow"), 150,
                   "the job finished at world 2")
        log = agent_log(c, "n1", "slow")
        slow, fast = statistics.median(step_times(log, 3)), statistics.median(step_times(log, 2))
        print(f"median step time with n2: {slow:.3f} s, without it: {fast:.3f} s")
        assert slow >= 0.1 and fast < slow / 2
        jobs = json.loads(ctl(c.etcd, c.prefix, "jobs", "--format", "json", check=True).stdout)
        assert jobs[0]["nodes"]["n2"]["state"] == "drained", jobs[0]["nodes"]["n2"]
        assert jobs[0]["nodes"]["n2"]["straggler"]  # why it was drained stays said
    finally:
        c.stop()
