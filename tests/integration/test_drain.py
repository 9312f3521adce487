"""``elasticctl drain`` on a real replicated job, and every elasticctl command's JSON.

Three training nodes and a standby (``--nnodes 3:3``), m=2, snapshots every step: draining a
training node hands its replicas off (the committed step keeps m copies without it), stops its
workers, the standby takes its place, restoring from a peer; ``placement`` shows the new holders.
Then every command runs with ``--format json`` against the same cluster and its output is
checked against the keys documented in docs/elasticctl.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from elasticd.launcher import JOB_USER, LocalCluster
from elasticd.replication.commit import read_committed

pytestmark = [pytest.mark.etcd]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")
DOC = os.path.join(REPO, "docs", "elasticctl.md")
STEP_RE = re.compile(r"step (\d+) world (\d+) rank (\d+) restart")
RESTORED_RE = re.compile(r"restored step (\d+) from (\w+) in [\d.]+ s, steps lost (\d+)")
STEPS = 400


def agent_log(c, node, job="job"):
    p = os.path.join(c.workdir, node, "jobs", job, "agent.log")
    return open(p, errors="replace").read() if os.path.exists(p) else ""


def steps(text, world, after=0):
    return [int(m.group(1)) for m in STEP_RE.finditer(text, after) if int(m.group(2)) == world]


def ctl(c, *args, timeout=150):
    env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
    return subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def committed(c, job="job"):
    # Holders derive from the placement stored beside the record (schema 2).
    return read_committed(c.coordinator(), c.keys, job)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(["n1", "n2", "n3", "n4"], workdir=str(tmp_path_factory.mktemp("drain")),
                     lease_ttl=2, replication=True)
    try:
        c.start()
        res = ctl(c, "submit", "job", "--nnodes", "3:3", "--nproc-per-node", "1", "--user",
                  JOB_USER, "--", TRAIN, "--steps", str(STEPS), "--step-time", "0.05")
        assert res.returncode == 0, res.stderr
        yield c
    finally:
        c.stop()


def training_nodes(c):
    out = {}
    for n in c.nodes:
        st = c.nodes[n].http("/status")
        if st["job"].get("ranks"):
            out[n] = st["job"]["ranks"]
    return out


@pytest.mark.timeout(300)
def test_drain_hands_off_replicas_then_the_standby_takes_over(cluster):
    c = cluster
    c.wait_for(lambda: len(training_nodes(c)) == 3 and all(
        len(steps(agent_log(c, n), 3)) > 30 for n in training_nodes(c)), 150,
        "30 steps at world size 3")
    c.wait_for(lambda: committed(c), 60, "a committed step")
    ranks = training_nodes(c)
    standby = next(n for n in c.nodes if n not in ranks)
    victim = max(ranks, key=lambda n: ranks[n])  # not rank 0's node: nothing special about it
    marks = {n: len(agent_log(c, n)) for n in c.nodes}

    res = ctl(c, "drain", victim, "--timeout", "60")  # a script without --force: refused
    assert res.returncode == 2 and "--force" in res.stderr, (res.returncode, res.stderr)
    assert c.coordinator().get(c.keys.drain(victim)) is None

    res = ctl(c, "drain", victim, "--force", "--timeout", "60", "--format", "json")
    assert res.returncode == 0, (res.stdout, res.stderr)
    drained_at = len(agent_log(c, victim))  # its workers are stopped once the drain returns
    doc = json.loads(res.stdout)
    print(res.stderr)
    assert doc["state"] == "drained" and doc["node"] == victim
    assert doc["copies_failed"] == 0 and doc["copies_done"] == doc["copies_planned"] > 0
    # progress was shown while it ran: each phase, then the outcome
    for phase in ("snapshot", "replicas", "stopping"):
        assert f"{victim}: draining / {phase}:" in res.stderr, res.stderr
    assert "handed off" in res.stderr and f"{victim}: drained" in res.stderr

    # the committed step has m copies without the drained node
    after = committed(c)
    assert after is not None
    for rank in after.ranks:
        others = [h for h in after.holders[rank] if h != victim]
        assert len(others) >= 2, (rank, after.holders)
    # the drained node left the job (its workers stopped) but stays alive, out of jobs
    st = c.nodes[victim].http("/status")
    assert st["drain"] == "drained" and st["job"]["state"] == "drained", st["job"]
    assert c.registered(victim)
    # the standby took the free slot, restored the committed step (the drained node's shard
    # from a peer's RAM) like everyone else, and the job finished at world size 3
    c.wait_for(lambda: steps(agent_log(c, standby), 3, marks[standby]), 120,
               "the standby training")
    going_on = [*[n for n in ranks if n != victim], standby]
    restores = {n: RESTORED_RE.search(agent_log(c, n), marks[n]) for n in going_on}
    assert all(restores.values()), restores
    got = {n: (int(m.group(1)), m.group(2)) for n, m in restores.items()}
    print("restores after the drain:", got)
    assert len({s for s, _ in got.values()}) == 1 and got[standby][0] >= doc_step(doc), got
    assert got[standby][1] == "peer", got
    assert not steps(agent_log(c, victim), 3, drained_at)
    # (That the job then finishes, every sample once, is tests/chaos/test_drain.py's: not
    # waited for here, ~20 s of the suite.)
    events = [e for e in c.events() if e["kind"] == "drained"]
    assert [e["node"] for e in events] == [victim]
    res = ctl(c, "history", "--kind", "recovered", "--format", "json")
    assert res.returncode == 0, res.stderr
    rec = [e for e in json.loads(res.stdout) if e["node"] == standby]
    assert rec and rec[-1]["source"] == "peer" and rec[-1]["recovery_seconds"] is not None, rec

    def placement():
        res = ctl(c, "placement", "--format", "json")
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    # The job trains on: the standby's first copies may still be on their way.
    c.wait_for(lambda: placement()["under_replicated_ranks"] == [], 60,
               "every rank replicated again")
    pl = placement()
    assert victim not in pl["nodes"] and standby in pl["nodes"], pl
    assert all(victim not in r["holders"] for r in pl["ranks"])


def doc_step(doc):
    """The committed step the drain handed off (every job's, here one)."""
    return min(j["version"][1] for j in doc["jobs"].values())


def documented_keys():
    """command -> the JSON keys docs/elasticctl.md lists for it ("### name" + "keys:" line)."""
    text = open(DOC).read()
    out = {}
    for m in re.finditer(r"^### `elasticctl (\w+)[^`]*`.*?^JSON keys: ([^\n]+)$", text,
                         re.M | re.S):
        out[m.group(1)] = [k.strip(" `") for k in m.group(2).split(",")]
    return out


@pytest.mark.timeout(240)
def test_every_command_prints_valid_json_with_the_documented_keys(cluster, tmp_path):
    c = cluster
    c.wait_for(lambda: committed(c), 120, "a committed step")
    keys = documented_keys()
    node = "n1"
    runs = {
        "nodes": ["nodes"], "status": ["status"], "history": ["history"], "jobs": ["jobs"],
        "logs": ["logs", "job"], "placement": ["placement", "job"],
        "checkpoints": ["checkpoints", "job"], "drain": ["drain", node, "--status"],
        "submit": ["submit", "other", "--nnodes", "1", "--nproc-per-node", "1", "--user",
                   JOB_USER, "--", TRAIN, "--steps", "1"],
        "stop": ["stop", "other", "--force"],
    }
    assert set(runs) | {"drain"} >= set(keys) and set(keys) >= set(runs), (
        "every command is documented and tested", sorted(keys), sorted(runs))
    for command, args in runs.items():
        res = ctl(c, args[0], "--format", "json", *args[1:])
        assert res.returncode == 0, (command, res.stderr)
        doc = json.loads(res.stdout)
        items = doc if isinstance(doc, list) else [doc]
        assert items, f"{command}: empty output"
        for item in items:
            missing = [k for k in keys[command] if k not in item]
            assert not missing, (command, missing, item)
    # exit codes scripts rely on
    assert ctl(c, "placement", "no-such-job").returncode == 1
    assert ctl(c, "drain", "bad name!", "--force").returncode == 2
    assert ctl(c, "history", "--etcd", "127.0.0.1:9").returncode == 3
    assert ctl(c, "stop", "job", "--watch", "1").returncode == 2
