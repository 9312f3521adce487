"""In-process re-formation keeps a compiled module's graphs (issue 31): a DDP job of 2 ranks per
node on 3 real daemons, its inner module compiled once per process (``torch.compile``,
``aot_eager``: the same dynamo front end as inductor, without a C compiler), kill -9 of a node,
then the node back: the survivors train at world 4 and then at world 6 again in their own
processes, and dynamo compiled nothing more in any of them (its own counter, logged with each
step by ``examples/train_in_process.py --compile``).

The same rejoin shows the newcomer staged: its workers reached their training function (the
script's ``ready-<pid>.json``) before any survivor's agent began the re-formation that let it
in (``reform_started``), so the survivors did not stand still while the newcomer started,
imported and built its model.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from elasticd.launcher import JOB_USER, LocalCluster, job_writable
from tests.chaos.test_in_process import TRAIN, _first_at, _rows, _wait

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(180)]


def shrink_and_rejoin(workdir: str, backend: str, model: str = "ddp") -> dict:
    """Runs the scenario (the job compiled with ``backend``; ``model``: the example's
    ``--model``: bench/spikes/inprocess/fsdp_recompiles.py runs FSDP2), stops every process
    it started, and returns what it saw: the survivors' and the newcomers' rows by pid, the
    kill and the node's return (``t_kill``, ``t_back``)."""
    logdir = job_writable(os.path.join(workdir, "steps"))
    cluster = LocalCluster(["n1", "n2", "n3"], workdir=os.path.join(workdir, "cluster"),
                           lease_ttl=2, replication=True)
    try:
        cluster.start()
        env = {**os.environ, "ELASTICD_ETCD": cluster.etcd, "ELASTICD_PREFIX": cluster.prefix}
        out = subprocess.run(
            [sys.executable, "-m", "elasticd.cli.main", "submit", "job", "--in-process",
             "--nnodes", "2:3", "--nproc-per-node", "2", "--user", JOB_USER,
             "--max-restarts", "100", "--", TRAIN, "--log", logdir, "--steps", "100000",
             "--step-time", "0.05", "--compile", backend, "--model", model],
            env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        first6 = _wait(lambda: (f := _first_at(_rows(logdir), 6, 0)) and len(f) == 6 and f,
                       300, "6 ranks training", cluster)
        time.sleep(1.0)
        workers = set(first6)
        tagged = {n: set(cluster.nodes[n].tagged()) for n in ("n1", "n2", "n3")}
        # Not rank 0's node: the survivors' round keeps its store where it was.
        zero = next(pid for pid, row in first6.items() if row["rank"] == 0)
        victim = next(n for n in ("n1", "n2", "n3") if workers & tagged[n]
                      and zero not in tagged[n])
        survivors = workers - tagged[victim]
        assert len(survivors) == 4
        t_kill = time.time()
        cluster.nodes[victim].kill()
        at4 = _wait(lambda: (f := _first_at(_rows(logdir), 4, t_kill)) and len(f) == 4 and f,
                    60, "4 ranks training at world 4", cluster)
        assert set(at4) == survivors
        t_back = time.time()
        cluster.start_node(victim)
        again = _wait(lambda: (f := _first_at(_rows(logdir), 6, t_back)) and len(f) == 6 and f,
                      300, "6 ranks training again", cluster)
        # A few steps in the grown world, so that a recompile (a guard failing on the new
        # group or DDP) would have happened.
        _wait(lambda: all(sum(1 for r in _rows(logdir) if r.get("pid") == p
                              and r.get("world") == 6 and r["t"] > t_back) >= 5
                          for p in survivors), 60, "5 steps at world 6", cluster)
    finally:
        # The nodes stop one after another: survivors may re-form around the first ones
        # stopped and log steps at a smaller world before their own node stops.
        t_stop = time.time()
        cluster.stop()
    rows = [r for r in _rows(logdir) if "step" in r]
    assert survivors <= set(again) and {again[p]["path"] for p in survivors} == {"in-process"}
    fresh = set(again) - survivors
    assert len(fresh) == 2  # the node that came back: new processes
    by_pid = {p: sorted((r for r in rows if r["pid"] == p), key=lambda r: r["t"])
              for p in survivors | fresh}
    ready = {}
    for path in glob.glob(os.path.join(logdir, "ready-*.json")):
        with open(path) as fh:
            row = json.load(fh)
        ready[row["pid"]] = row["t"]
    return {"survivors": {p: by_pid[p] for p in survivors},
            "newcomers": {p: by_pid[p] for p in fresh}, "t_kill": t_kill, "t_back": t_back,
            "t_stop": t_stop, "ready": ready, "back_at_6": {p: again[p]["t"] for p in again}}


@pytest.fixture(scope="module")
def rejoin(tmp_path_factory):
    """One shrink and rejoin (aot_eager), read by both tests."""
    return shrink_and_rejoin(str(tmp_path_factory.mktemp("rejoin")), "aot_eager")


def test_survivors_compile_nothing_more_across_a_shrink_and_a_rejoin(rejoin):
    seen = rejoin
    for pid, mine in seen["survivors"].items():
        counts = sorted({r["compiles"] for r in mine})
        worlds = [r["world"] for r in mine if r["t"] < seen["t_stop"]]
        assert 4 in worlds and worlds[-1] == 6
        # Compiled on its first step, never again: across the shrink and the rejoin.
        assert counts == [counts[0]] and counts[0] >= 1, (pid, counts)
    graphs = {r["compiles"] for rows in seen["survivors"].values() for r in rows}
    fresh = {r["compiles"] for rows in seen["newcomers"].values() for r in rows}
    print(f"\nsurvivors {sorted(seen['survivors'])}: compiled graphs per process "
          f"{sorted(graphs)} through worlds 6 -> 4 -> 6 (newcomers: {sorted(fresh)})")


def test_a_newcomers_workers_are_ready_before_the_survivors_stop_for_it(rejoin):
    seen = rejoin
    # When each survivor's agent started re-forming for the newcomer (its abort: the survivor
    # left at the step boundary after it), from the survivor's first step at world 6.
    began = {}
    for pid, rows in seen["survivors"].items():
        first6 = next(r for r in rows if r["world"] == 6 and r["t"] >= seen["back_at_6"][pid])
        began[pid] = (first6.get("times") or {}).get("reform_started")
    assert None not in began.values(), began
    ready = {p: seen["ready"].get(p) for p in seen["newcomers"]}
    assert None not in ready.values(), ready
    # Staged: started, imported and built before the node joined the round, so before any
    # survivor's agent stopped it (before: the node joined first and its workers started
    # after the round, while the survivors waited).
    assert max(ready.values()) < min(began.values()), (ready, began)
    for pid, rows in seen["newcomers"].items():
        times = rows[0].get("times") or {}
        assert times.get("ready", 0) <= times.get("assigned", -1), (pid, times)
    stopped = {p: max(r["t"] for r in rows if r["world"] == 4 and r["t"] < seen["back_at_6"][p])
               for p, rows in seen["survivors"].items()}
    print(f"\nnewcomers ready {min(began.values()) - max(ready.values()):.3f} s before the "
          f"first survivor's agent re-formed; survivors stood "
          f"{max(seen['back_at_6'][p] - stopped[p] for p in stopped):.3f} s at most")
