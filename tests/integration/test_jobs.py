"""Jobs on real daemons: submit validation, a 3-node elastic job surviving kill -9 of a node,
rejoin, stop. Real etcd, real torchrun agents, real gloo workers on CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from elasticd.cluster.jobspec import NodeJobStatus
from elasticd.agent.supervisor import process_runs
from elasticd.launcher import JOB_USER, LocalCluster

pytestmark = [pytest.mark.etcd]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")
TTL = 2


def ctl(etcd, prefix, *args, check=False):
    env = {**os.environ, "ELASTICD_ETCD": etcd, "ELASTICD_PREFIX": prefix}
    res = subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=60)
    if check:
        assert res.returncode == 0, res.stderr
    return res


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "3:2", "--nproc-per-node", "1", "--", TRAIN], "--nnodes '3:2'"),
    (["--nnodes", "x", "--nproc-per-node", "1", "--", TRAIN], "expected N or MIN:MAX"),
    (["--nnodes", "2", "--nproc-per-node", "1", "--", "/nonexistent/train.py"], "no such file"),
    (["--nnodes", "2", "--nproc-per-node", "1", "--user", "no-such-user-x", "--", TRAIN],
     "no such user"),
    (["--nnodes", "2", "--nproc-per-node", "1", "--bogus-option", "1", "--", TRAIN],
     "unrecognized arguments"),
    (["--nnodes", "2", "--nproc-per-node", "1", "--env", "RANK=3", "--", TRAIN],
     "set by elasticd or torchrun"),
])
def test_malformed_job_spec_is_refused_and_nothing_written(etcd, etcd_client, prefix, args,
                                                           needle):
    res = ctl(etcd.endpoints, prefix, "submit", "bad", "--user", JOB_USER, *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert needle in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3  # argparse prints usage + error
    kvs, _ = etcd_client.get_prefix(prefix.encode())
    assert kvs == []


@pytest.mark.timeout(60)
def test_submit_as_root_needs_explicit_user(etcd, etcd_client, prefix):
    if os.getuid() != 0:
        pytest.skip("only meaningful as root")
    res = ctl(etcd.endpoints, prefix, "submit", "j", "--nnodes", "1", "--nproc-per-node", "1",
              "--", TRAIN)
    assert res.returncode == 2 and "--user" in res.stderr
    assert etcd_client.get_prefix(prefix.encode())[0] == []


def agent_log(cluster, node, job):
    path = os.path.join(cluster.workdir, node, "jobs", job, "agent.log")
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


STEP_RE = re.compile(r"step (\d+) world (\d+) rank (\d+) restart (\d+)")


def steps_at_world(text, world, after=0):
    """(offset, step) of step lines at ``world`` found after byte offset ``after``."""
    return [(m.start(), int(m.group(1))) for m in STEP_RE.finditer(text, after)
            if int(m.group(2)) == world]


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path), lease_ttl=TTL)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["n1", "n3"])
def test_kill9_node_survivors_train_at_world_2_then_rejoin_at_3(cluster, victim):
    ctl(cluster.etcd, cluster.prefix, "submit", "job", "--nnodes", "2:3", "--nproc-per-node",
        "1", "--user", JOB_USER, "--", TRAIN, "--steps", "100000", "--step-time", "0.02",
        check=True)
    cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 3)
                                 for n in cluster.nodes), 60, "training at world size 3")
    survivors = [n for n in cluster.nodes if n != victim]
    marks = {n: len(agent_log(cluster, n, "job")) for n in survivors}
    dead = cluster.nodes[victim]
    tagged_before = dead.tagged()
    assert len(tagged_before) >= 2  # agent and worker
    killed = time.monotonic()
    dead.kill()
    cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 2, marks[n])
                                 for n in survivors), 90, "survivors training at world size 2")
    recovery = time.monotonic() - killed
    print(f"kill -9 {victim}: survivors training at world size 2 after {recovery:.1f} s")
    assert not dead.tagged(), "a process of the dead node is still running"
    # Dead, if maybe not yet reaped (a zombie until init collects it).
    assert not any(process_runs(p) for p in tagged_before)

    # The node comes back: it rejoins and the job returns to world size 3.
    marks = {n: len(agent_log(cluster, n, "job")) for n in cluster.nodes}
    cluster.start_node(victim)
    cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 3, marks[n])
                                 for n in cluster.nodes), 90, "back at world size 3")

    jobs = json.loads(ctl(cluster.etcd, cluster.prefix, "jobs", "--format", "json",
                          check=True).stdout)
    assert jobs[0]["job"] == "job" and jobs[0]["desired"] == "running"
    assert set(jobs[0]["nodes"]) == {"n1", "n2", "n3"}
    logs = json.loads(ctl(cluster.etcd, cluster.prefix, "logs", "job", "--format", "json",
                          check=True).stdout)
    assert {row["node"] for row in logs} == {"n1", "n2", "n3"}
    assert all(os.path.exists(row["log"]) for row in logs)

    res = ctl(cluster.etcd, cluster.prefix, "stop", "job", "--force", "--wait", "30")
    assert res.returncode == 0, res.stderr
    for n in cluster.nodes.values():
        assert not n.tagged(), f"{n.node_id} still runs processes of the stopped job"


def job_status(cluster, node):
    return cluster.nodes[node].http("/status")["job"]


def agent_pid(cluster, node, job="job"):
    """The agent's pid, from the node's record in etcd (/status over HTTP leaves it out)."""
    kv = cluster.coordinator().get(cluster.keys.job_keys(job).node(node))
    return NodeJobStatus.decode(kv.value, kv.key).agent_pid


@pytest.mark.timeout(180)
def test_kill9_of_the_agent_alone_takes_its_workers_and_the_job_recovers(cluster):
    ctl(cluster.etcd, cluster.prefix, "submit", "job", "--nnodes", "2:3", "--nproc-per-node",
        "1", "--user", JOB_USER, "--", TRAIN, "--steps", "100000", "--step-time", "0.02",
        check=True)
    cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 3)
                                 for n in cluster.nodes), 60, "training at world size 3")
    pid = agent_pid(cluster, "n2")
    workers = [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    assert workers
    marks = {n: len(agent_log(cluster, n, "job")) for n in cluster.nodes}
    os.kill(pid, 9)
    cluster.wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in workers), 10,
                     "the dead agent's workers gone")
    cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 3, marks[n])
                                 for n in cluster.nodes), 90, "training again at world size 3")
    assert job_status(cluster, "n2")["agent_starts"] >= 1
    assert "elasticd_worker_restarts_total{reason=\"agent_died\"} 1.0" in \
        cluster.nodes["n2"].http("/metrics")


@pytest.mark.timeout(180)
def test_hang_is_detected_and_the_job_restarted(tmp_path):
    c = LocalCluster(["n1", "n2"], workdir=str(tmp_path), lease_ttl=TTL)
    try:
        c.start()
        ctl(c.etcd, c.prefix, "submit", "hang", "--nnodes", "2", "--nproc-per-node", "1",
            "--user", JOB_USER, "--hang-timeout", "4", "--", TRAIN, "--steps", "60",
            "--step-time", "0.02", "--hang-rank", "1", "--hang-at-step", "20", check=True)

        def restarted_and_progressing():
            logs = [agent_log(c, n, "hang") for n in c.nodes]
            return all(re.search(r"restart [1-9]\d* loss", t) for t in logs)

        c.wait_for(restarted_and_progressing, 90, "workers restarted after the hang")
        hangs = sum(float(line.split()[-1]) for n in c.nodes.values()
                    for line in n.http("/metrics").splitlines()
                    if line.startswith("elasticd_hangs_detected_total"))
        assert hangs >= 1
        assert any("hangs at step 20" in agent_log(c, n, "hang") for n in c.nodes)
        c.wait_for(lambda: all("done rank" in agent_log(c, n, "hang") for n in c.nodes), 60,
                   "the job finished after the restart")
    finally:
        c.stop()


@pytest.mark.timeout(240)
def test_frozen_node_is_aborted_around_then_fences_and_rejoins(cluster):
    """SIGSTOP of a whole node (daemon, agent, workers) looks like a partition or a hung
    machine: no TCP reset reaches the peers, whose all_reduce would wait for gloo's timeout.
    The survivors' daemons see the lease expire and restart their workers at once."""
    ctl(cluster.etcd, cluster.prefix, "submit", "job", "--nnodes", "2:3", "--nproc-per-node",
        "1", "--user", JOB_USER, "--", TRAIN, "--steps", "100000", "--step-time", "0.02",
        check=True)
    cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 3)
                                 for n in cluster.nodes), 60, "training at world size 3")
    frozen = cluster.nodes["n2"]
    pids = [frozen.pid] + frozen.tagged()
    marks = {n: len(agent_log(cluster, n, "job")) for n in ("n1", "n3")}
    stopped = time.monotonic()
    for p in pids:
        os.kill(p, 19)  # SIGSTOP
    try:
        cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 2, marks[n])
                                     for n in ("n1", "n3")), 90,
                         "survivors training at world size 2")
        print(f"frozen n2: survivors training at world size 2 after "
              f"{time.monotonic() - stopped:.1f} s")
    finally:
        for p in pids:
            try:
                os.kill(p, 18)  # SIGCONT
            except ProcessLookupError:
                pass
    cluster.wait_for(lambda: [e for e in cluster.events()
                              if e["kind"] == "fenced" and e["node"] == "n2"], 30, "n2 fenced")
    def described(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return f"{stat.split(')')[1].split()[0]} {fh.read()[:120]!r}"
        except OSError:
            return ""

    # A zombie runs nothing (its parent reaps it); tagged_pids() skips them too.
    left = {p: described(p) for p in pids[1:] if described(p) and not described(p).startswith("Z")}
    assert not left, f"fenced node's job survived: {left}"
    marks = {n: len(agent_log(cluster, n, "job")) for n in cluster.nodes}
    cluster.wait_for(lambda: all(steps_at_world(agent_log(cluster, n, "job"), 3, marks[n])
                                 for n in cluster.nodes), 90, "back at world size 3")


RESTORED_RE = re.compile(r"restored step (\d+) from (\w+) in [\d.]+ s, steps lost (\d+)")


@pytest.mark.timeout(180)
def test_worker_crash_restores_from_the_daemons_ram(cluster):
    """kill -9 of one worker: torchrun restarts the group at the same world size and every rank
    restores the newest step all ranks hold from its daemon's shared memory."""
    ctl(cluster.etcd, cluster.prefix, "submit", "job", "--nnodes", "3", "--nproc-per-node",
        "1", "--user", JOB_USER, "--", TRAIN, "--steps", "100000", "--step-time", "0.02",
        check=True)
    cluster.wait_for(lambda: all(len(steps_at_world(agent_log(cluster, n, "job"), 3)) > 30
                                 for n in cluster.nodes), 90, "30 steps at world size 3")
    pid = agent_pid(cluster, "n2")
    worker = int(open(f"/proc/{pid}/task/{pid}/children").read().split()[0])
    marks = {n: len(agent_log(cluster, n, "job")) for n in cluster.nodes}
    last = max(s for _, s in steps_at_world(agent_log(cluster, "n2", "job"), 3))
    os.kill(worker, 9)

    def restored():
        found = [RESTORED_RE.search(agent_log(cluster, n, "job"), marks[n]) for n in cluster.nodes]
        return all(found) and found

    found = cluster.wait_for(restored, 90, "every rank restored")
    steps = {int(m.group(1)) for m in found}
    assert len(steps) == 1, "ranks restored different steps"
    step = steps.pop()
    assert step >= last - 1  # at most the step in flight is lost
    assert {m.group(2) for m in found} == {"local"}
    metrics = cluster.nodes["n1"].http("/metrics")
    assert 'elasticd_restores_total{source="local"} 1.0' in metrics
    assert float(re.search(r"^elasticd_snapshots_total (\S+)", metrics, re.M).group(1)) > 30
