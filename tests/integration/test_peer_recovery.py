"""The heart of the product: kill -9 a whole node (its RAM deleted with it) and the survivors
restore the last committed step, the dead node's ranks from a peer's RAM."""

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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")
STEP_RE = re.compile(r"step (\d+) world (\d+) rank (\d+) restart")
RESTORED_RE = re.compile(r"restored step (\d+) from (\w+) in [\d.]+ s, steps lost (\d+)")


def agent_log(c, node):
    p = os.path.join(c.workdir, node, "jobs", "job", "agent.log")
    return open(p, errors="replace").read() if os.path.exists(p) else ""


def steps(text, world, after=0):
    return [int(m.group(1)) for m in STEP_RE.finditer(text, after) if int(m.group(2)) == world]


@pytest.mark.timeout(240)
def test_kill9_node_survivors_restore_from_peer_ram(tmp_path):
    c = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path), lease_ttl=2, replication=True)
    try:
        c.start()
        env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
        subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "job", "--nnodes",
                        "2:3", "--nproc-per-node", "1", "--user", JOB_USER, "--", TRAIN,
                        "--steps", "100000", "--step-time", "0.05"], env=env, check=True,
                       capture_output=True, timeout=60)
        c.wait_for(lambda: all(len(steps(agent_log(c, n), 3)) > 40 for n in c.nodes), 120,
                   "40 steps at world size 3")
        committed = c.wait_for(lambda: c.coordinator().get(
            c.keys.replication("job").committed), 60, "a committed step")
        assert committed is not None
        # Kill the node holding rank 0: after the shrink to 2 ranks, new rank r loads old rank
        # r's shard, so old rank 0's shard can only come from its replica in a peer's RAM.
        victim = next(n for n in c.nodes if c.nodes[n].http("/status")["job"]["ranks"] == [0])
        survivors = [n for n in c.nodes if n != victim]
        marks = {n: len(agent_log(c, n)) for n in survivors}
        committed = c.coordinator().get(c.keys.replication("job").committed)
        killed = time.time()
        c.nodes[victim].kill()
        assert not os.path.exists(c.nodes[victim].shm_dir)

        def restored():
            found = [RESTORED_RE.search(agent_log(c, n), marks[n]) for n in survivors]
            return all(found) and found

        found = c.wait_for(restored, 120, "survivors restored")
        got = {(int(m.group(1)), m.group(2), int(m.group(3))) for m in found}
        print("restores:", got)
        assert len({s for s, _, _ in got}) == 1, "ranks restored different steps"
        step = next(iter(got))[0]
        # The step committed when the node died (or a newer one committed before the
        # survivors noticed): a busy machine lets the commit lag more than 10 steps behind.
        assert step >= json.loads(committed.value)["step"] > 0, \
            "restored from scratch instead of the committed step"
        assert any(src == "peer" for _, src, _ in got), got
        c.wait_for(lambda: all(steps(agent_log(c, n), 2, marks[n]) for n in survivors), 60,
                   "training again at world size 2")
        trained = time.time()
        check_timeline(c, victim, killed, trained, step)
        metrics = "".join(c.nodes[n].http("/metrics") for n in survivors)
        assert re.search(r'elasticd_restores_total\{source="peer"\} [1-9]', metrics)
    finally:
        c.stop()


def check_timeline(c, victim, killed, trained, step):
    """The recovery's timeline (elasticd.cluster.timeline): one record, written by one
    survivor, its moments in order and its end the first step after the restore."""
    from elasticd.cluster import timeline

    def records():
        return [e for e in c.events() if e["kind"] == timeline.KIND]

    try:
        [event] = c.wait_for(records, 15, "the recovery's timeline in etcd")
    except TimeoutError:
        for n in c.nodes:
            print(n, [line for line in c.nodes[n].log_text().splitlines()
                      if "timeline" in line or "aborted" in line or "first step" in line])
        raise
    assert event["node"] == victim and event["instance"] == "job", event
    t = timeline.decode(event["data"])
    print("timeline:", t.describe(), "kill -> training again seen by the test:",
          round(trained - killed, 2))
    marks = t.marks()
    assert None not in marks, t  # every moment was seen
    assert marks == sorted(marks), t
    assert t.failed == [victim] and t.step == step and "peer" in t.restore_source, t
    assert t.ranks_restored == 2 and t.restore_bytes > 0, t
    # The failure is placed within a TTL-ish of the kill; the first step is the one the test
    # saw (it polls every 0.05 s), after the restores ended.
    assert abs(t.failure_at - killed) < 1.0, (t.failure_at - killed, t)
    assert t.restore_finished_at <= t.first_step_at <= trained + 0.05, t
    assert trained - t.first_step_at < 1.0, (trained - t.first_step_at, t)
    assert t.total == pytest.approx(sum(t.phases().values()), abs=0.01)
    time.sleep(1.5)  # every survivor's loop has seen the first step: still one record
    assert len(records()) == 1
    env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
    shown = subprocess.run([sys.executable, "-m", "elasticd.cli.main", "history", "--kind",
                            "failed,recovered,timeline"], env=env, capture_output=True,
                           text=True, timeout=30)
    print("elasticctl history:\n" + shown.stdout + shown.stderr)
    assert shown.returncode == 0 and "recoveries (seconds per phase" in shown.stdout
