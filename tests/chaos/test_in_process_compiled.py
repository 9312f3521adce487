"""In-process re-formation keeps a compiled module's graphs (issue 31): a DDP job of 2 ranks per
node on 3 real daemons, its inner module compiled once per process (``torch.compile``,
``aot_eager``: the same dynamo front end as inductor, without a C compiler), kill -9 of a node,
then the node back: the survivors train at world 4 and then at world 6 again in their own
processes, and dynamo compiled nothing more in any of them (its own counter, logged with each
step by ``examples/train_in_process.py --compile``).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time

import pytest

from elasticd.launcher import JOB_USER, LocalCluster, job_writable
from tests.chaos.test_in_process import TRAIN, _first_at, _rows, _wait

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(180)]


def shrink_and_rejoin(workdir: str, backend: str, train_args: tuple[str, ...] = (),
                      kill_rank: int = -1) -> dict:
    """Runs the scenario (the job compiled with ``backend``; ``train_args``: more of the
    script's; ``kill_rank``: the node killed is that rank's, not rank 0's), stops every process it started, and returns what it saw: the survivors' and the
    newcomers' rows by pid, the kill and the node's return (``t_kill``, ``t_back``), and the
    agents' logs (``logs``)."""
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
             "--step-time", "0.05", "--compile", backend, *train_args],
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
                      and zero not in tagged[n] and (kill_rank < 0 or any(
                          first6[p]["rank"] == kill_rank for p in workers & tagged[n])))
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
        logs = "".join(open(p).read() for p in glob.glob(os.path.join(
            cluster.workdir, "*", "jobs", "*", "agent.log")))
    finally:
        cluster.stop()
    rows = [r for r in _rows(logdir) if "step" in r]
    assert survivors <= set(again) and {again[p]["path"] for p in survivors} == {"in-process"}
    fresh = set(again) - survivors
    assert len(fresh) == 2  # the node that came back: new processes
    by_pid = {p: sorted((r for r in rows if r["pid"] == p), key=lambda r: r["t"])
              for p in survivors | fresh}
    return {"survivors": {p: by_pid[p] for p in survivors},
            "newcomers": {p: by_pid[p] for p in fresh}, "t_kill": t_kill, "t_back": t_back,
            "logs": logs}


def test_survivors_compile_nothing_more_across_a_shrink_and_a_rejoin(tmp_path):
    seen = shrink_and_rejoin(str(tmp_path), "aot_eager")
    for pid, mine in seen["survivors"].items():
        counts = sorted({r["compiles"] for r in mine})
        worlds = [r["world"] for r in mine]
        assert 4 in worlds and worlds[-1] == 6
        # Compiled on its first step, never again: across the shrink and the rejoin.
        assert counts == [counts[0]] and counts[0] >= 1, (pid, counts)
    graphs = {r["compiles"] for rows in seen["survivors"].values() for r in rows}
    fresh = {r["compiles"] for rows in seen["newcomers"].values() for r in rows}
    print(f"\nsurvivors {sorted(seen['survivors'])}: compiled graphs per process "
          f"{sorted(graphs)} through worlds 6 -> 4 -> 6 (newcomers: {sorted(fresh)})")


@pytest.mark.skip(reason="FSDP2 survivors fall back to a restart at their process's first "
                  "re-formation: torch keeps the first round's group alive after fully_shard "
                  "(its sockets stay open, from no Python reference: docs/jobs.md, 'Sharded "
                  "state'); 72 s when run, failing at the pid check")
def test_fsdp2_survivors_reshard_in_process_from_their_own_slots(tmp_path):
    """FSDP2 (``--model fsdp``: uneven shards, each block's inner layers compiled): the
    survivors of the kill make the model again on the round's group (``fully_shard``), each
    reshards the committed step starting from the snapshot it wrote itself (its own node's
    RAM) plus the rows it lacks from the other old ranks', and trains on at world 4 and again
    at world 6 in its own process. The compiled graphs are reported, not asserted."""
    seen = shrink_and_rejoin(str(tmp_path), "aot_eager", ("--model", "fsdp"), kill_rank=2)
    first = {p: rows[0]["rank"] for p, rows in seen["survivors"].items()}
    at4 = {p: next(r["rank"] for r in rows if r["world"] == 4)
           for p, rows in seen["survivors"].items()}
    # The restore says which old rank's snapshot each new rank started from: the rank the
    # survivor was (before, new rank r took old rank r's, a peer's for a moved survivor).
    loaded = {int(m[1]): int(m[2]) for m in re.finditer(
        r"rank (\d+) restored step \(\d+, \d+\) saved by 6 ranks into a world of 4 "
        r"\(old rank (\d+)'s snapshot and \d+ more: resharded", seen["logs"])}
    assert loaded == {at4[p]: first[p] for p in first}, (loaded, at4, first)
    assert any(at4[p] != first[p] for p in first)  # some survivor moved (rank 2 or 3 died)
    counts = {p: [rows[0]["compiles"], max(r["compiles"] for r in rows if r["world"] == 6
                                           and r["t"] < seen["t_kill"]),
                  max(r["compiles"] for r in rows if r["world"] == 4),
                  rows[-1]["compiles"]] for p, rows in seen["survivors"].items()}
    print(f"\nFSDP2 survivors' compiled graphs (first step, world 6 before the kill, world 4, "
          f"world 6 again): {counts}; newcomers: "
          f"{sorted({r['compiles'] for rows in seen['newcomers'].values() for r in rows})}")
