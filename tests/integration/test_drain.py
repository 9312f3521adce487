"""Every elasticctl command's JSON, on a real replicated job.

Three training nodes and a standby (``--nnodes 3:3``), m=2, snapshots every step: every command
runs with ``--format json`` and its output is checked against the keys documented in
docs/elasticctl.md; the exit codes scripts rely on, and a drain asked by a script without
``--force`` refused. (A drain itself, its report, progress, hand-off, the standby's takeover,
history and placement after it: tests/chaos/test_drain.py, on the chaos harness's cluster.)"""

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
STEPS = 400


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
    res = ctl(c, "drain", "n3", "--timeout", "60")  # a script without --force: refused
    assert res.returncode == 2 and "--force" in res.stderr, (res.returncode, res.stderr)
    assert c.coordinator().get(c.keys.drain("n3")) is None
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
