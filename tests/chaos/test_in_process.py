"""In-process re-formation on a real cluster (issue 31): 3 elasticd daemons on a real etcd, a DDP
job of 2 ranks per node submitted with ``--in-process`` (``examples/train_in_process.py``,
``@elasticd.in_process``), kill -9 of a node.

* The survivors keep their processes: the pids that train at world 4 are the 4 survivors' own,
  they re-entered the function (path ``in-process``), resumed from the last step every one of
  them completed (each from its own slot, the rank it was: 0 steps lost), and the job finishes.
* The fallback: a survivor that hangs instead of leaving its group is restarted the old way by
  its agent at the deadline (its node's workers are new processes), the other node's stay; the
  new processes offer their old ranks' slots (their node's RAM), so the round resumes at the
  newest step any survivor completed (0 lost), and the job finishes.
* A frozen node (SIGSTOP of its daemon, agent and workers: no reset reaches anyone): the
  survivors' pending collectives end when their agents learn that the node failed (the
  agent's ``abort`` shuts the old group's connections down: elasticd/worker/group_sockets.py),
  not at their collective timeout (learned from their steps, 5 s here: the backstop), and
  they re-form in-process.
* FSDP2 (``--model fsdp``): the survivors keep their processes as well (each leave empties
  DTensor's caches, which kept a process's first FSDP2 round's group alive).
* A worker killed alone (its node alive): its node restarts its workers, the other nodes' stay
  in-process (a mixed round at the same world size), every rank resumes from one step.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from elasticd.agent.supervisor import signal_all
from elasticd.launcher import JOB_USER, LocalCluster, job_writable
from elasticd.replication.commit import decode_committed, decode_grid

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(150)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train_in_process.py")


#: The job's length: the fault comes ~15 steps in (once a step is committed at grid 1), and
#: what follows it must fit (a fallback restart takes ~130 steps more: STEPS + 100 there).
STEPS = 200

def _rows(logdir: str) -> list[dict]:
    rows = []
    for path in glob.glob(os.path.join(logdir, "steps-*.jsonl")):
        with open(path) as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue  # a line being written (read while the worker writes it)
    return rows


def _wait(cond, timeout: float, what: str, cluster: LocalCluster):
    try:
        return cluster.wait_for(cond, timeout, what, interval=0.1)
    except TimeoutError as exc:
        logs = {n: open(p).read()[-3000:] for n in cluster.nodes
                for p in glob.glob(os.path.join(cluster.workdir, n, "jobs", "*", "agent.log"))}
        raise TimeoutError(f"{exc}\n{logs}") from None


def _first_at(rows: list[dict], world: int, since: float) -> dict[int, dict]:
    """pid -> its first step row at ``world`` after ``since``."""
    first: dict[int, dict] = {}
    for row in sorted((r for r in rows if "step" in r), key=lambda r: r["t"]):
        if row["world"] == world and row["t"] > since and row["pid"] not in first:
            first[row["pid"]] = row
    return first


def new_group(rows: list[dict], rounds: dict[int, int], since: float) -> dict[int, dict]:
    """rank -> its first step row in a group made after ``since`` (the world size stays): a
    row of a process that did not train before (``rounds``: pid -> its round then), or of one
    that did, in a later round (bench/recovery_inprocess.py's rule)."""
    first: dict[int, dict] = {}
    for row in sorted(rows, key=lambda r: r["t"]):
        pid = row["pid"]
        if row["t"] > since and row["rank"] not in first and (
                pid not in rounds or row["round"] > rounds[pid]):
            first[row["rank"]] = row
    return first


def _newest_all_held(rows: list[dict], survivors: set[int]) -> int:
    """The newest step every survivor held at the kill: each survivor's last step in the old
    world (not its last step logged before the kill's timestamp: a step whose collective
    finished before the kill may be logged just after it), their minimum."""
    return min(_last_steps(rows, survivors).values())


def _last_steps(rows: list[dict], survivors: set[int], saved: bool = False) -> dict[int, int]:
    """pid -> its last step in the old world; ``saved``: its last step snapshotted (the daemon
    skips a snapshot while both of a rank's slots hold copies its commit needs: the committed
    one and a newer one acknowledged, not yet committed)."""
    return {pid: max(r["step"] for r in rows if r.get("pid") == pid and "step" in r
                     and r["world"] == 6 and (r.get("saved") or not saved))
            for pid in survivors}


def _submit(cluster: LocalCluster, logdir: str, steps: int, hang_rank: int = -1,
            extra: tuple[str, ...] = (), train_args: tuple[str, ...] = (),
            in_process: bool = True) -> None:
    """Submits the in-process job (``extra``: more submit options; ``train_args``: more of the
    script's; ``in_process=False``: the same job on the restart path, as bench/soak.py's
    baseline) and waits until its 6 ranks train, a step is committed and the snapshot grid
    is 1."""
    env = {**os.environ, "ELASTICD_ETCD": cluster.etcd, "ELASTICD_PREFIX": cluster.prefix}
    out = subprocess.run(
        [sys.executable, "-m", "elasticd.cli.main", "submit", "job",
         *(["--in-process"] if in_process else []), "--nnodes", "2:3", "--nproc-per-node",
         "2", "--user", JOB_USER, "--max-restarts", "100", *extra, "--", TRAIN, "--log",
         logdir, "--steps", str(steps), "--step-time", "0.05", "--hang-rank", str(hang_rank),
         *train_args],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    _wait(lambda: len(_first_at(_rows(logdir), 6, 0)) == 6, 90, "6 ranks training",
          cluster)
    # The snapshot grid settled at every step (it widens when the nodes' first snapshots
    # miss each other and halves as commits keep up): a step off the grid is in nobody's
    # slot, and this test is about what in-process adds, not the grid.
    coord = cluster.coordinator()
    grid_key = cluster.keys.replication("job").commit_grid
    _wait(lambda: coord.get(cluster.keys.replication("job").committed) is not None
          and ((kv := coord.get(grid_key)) is None or decode_grid(kv.value).grid == 1),
          60, "a committed step and the snapshot grid at 1", cluster)
    time.sleep(1.0)


def _run(tmp_path, steps: int, hang_rank: int = -1, extra: tuple[str, ...] = (),
         fault: str = "kill", train_args: tuple[str, ...] = ()):
    logdir = job_writable(str(tmp_path / "steps"))
    # Peer replication on, as in production (a fallback node's fresh workers restore from
    # their old ranks' slots in their node's RAM: no peer copy is needed, nor used).
    cluster = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path / "cluster"), lease_ttl=2,
                           replication=True)
    try:
        cluster.start()
        _submit(cluster, logdir, steps, hang_rank, extra, train_args)
        coord = cluster.coordinator()
        before = {n: set(cluster.nodes[n].tagged()) for n in ("n1", "n2", "n3")}
        first6 = _first_at(_rows(logdir), 6, 0)
        workers = set(first6)
        if hang_rank < 0:
            # Rank 2's node: rank 0 survives, and the ranks above the dead ones move down.
            two = next(pid for pid, row in first6.items() if row["rank"] == 2)
            victim = next(n for n in ("n1", "n2", "n3") if two in before[n])
        else:
            # The hung rank's other ring neighbour (the last rank) dies with the victim: a
            # live neighbour would wait on the hung rank's open sockets until its collective
            # timeout, and its node fall back too (the hung rank's own node is the one tested).
            last = next(pid for pid, row in first6.items() if row["rank"] == 5)
            victim = next(n for n in ("n1", "n2", "n3") if last in before[n])
        survivors = workers - before[victim]
        assert len(survivors) == 4 and len(workers & before[victim]) == 2
        kv = coord.get(cluster.keys.replication("job").committed)
        committed = decode_committed(kv.value).step if kv is not None else 0
        t_kill = time.time()
        if fault == "freeze":  # every process of the node, as tests/chaos/faults.py does
            node = cluster.nodes[victim]
            node.signal(signal.SIGSTOP, group=True)
            frozen = sorted(set(before[victim]) | set(node.tagged()))
            signal_all(frozen, signal.SIGSTOP)
        else:
            cluster.nodes[victim].kill()
        at4 = _wait(lambda: (f := _first_at(_rows(logdir), 4, t_kill)) and len(f) == 4 and f,
                    60, "4 ranks training at world 4", cluster)
        if fault == "freeze":  # never thawed (its return is the rejoin's business)
            node.kill()
        _wait(lambda: sum(1 for r in _rows(logdir) if "done" in r) >= 4, 60,
              "the job finishing", cluster)
        return logdir, survivors, t_kill, at4, cluster.workdir, committed
    finally:
        cluster.stop()


def test_kill9_of_a_node_the_survivors_keep_their_processes(tmp_path):
    logdir, survivors, t_kill, at4, workdir, committed = _run(tmp_path, steps=STEPS)
    rows = _rows(logdir)
    assert set(at4) == survivors  # the same 4 processes train at world 4
    assert {r["path"] for r in at4.values()} == {"in-process"}
    # Every survivor restored (the Checkpointer) one step, each from its own slot (own shard
    # first): the last step every survivor completed. Each survivor snapshotted every step it
    # completed, a pending commit notwithstanding (the newest pair of an in-process job:
    # store/shm.py), so that step is in every survivor's slots and 0 steps are lost. (Before
    # it, a snapshot was skipped while a commit was pending, survivors on different nodes held
    # different newest steps, and they resumed from an older common one.)
    held = _newest_all_held(rows, survivors)
    last_saved = _last_steps(rows, survivors, saved=True)
    assert last_saved == _last_steps(rows, survivors), (last_saved, held)
    snapshotted = min(last_saved.values())
    resumed = {r["step"] - 1 for r in at4.values()}
    assert resumed == {held}, (resumed, committed, last_saved, held)
    # ... each the shard of the rank it was (its own slot), not its new rank's: the restore
    # says which old rank's snapshot it loaded, under its new rank (or, its memory already
    # that step, which old rank's snapshot in its own slot it is: elasticd/worker/held_state.py).
    was = {at4[pid]["rank"]: _first_at(rows, 6, 0)[pid]["rank"] for pid in survivors}
    logs = "".join(open(p).read() for p in glob.glob(os.path.join(
        workdir, "*", "jobs", "*", "agent.log")))
    loaded = {int(m[1]): int(m[2]) for m in re.finditer(
        r"rank (\d+) restored step \(\d+, \d+\) saved by 6 ranks into a world of 4 "
        r"\(old rank (\d+)'s snapshot", logs)}
    assert loaded == was, (loaded, was)
    done = {r["pid"]: r["done"] for r in rows if "done" in r}
    assert set(done) == survivors and set(done.values()) == {STEPS}
    # The survivors' broken collectives had their daemons probe the victim's daemon, whose
    # port refused: its lease was revoked, not waited out (elasticd/daemon/peer_probe.py).
    daemons = "".join(open(p).read() for p in glob.glob(os.path.join(workdir, "n*.log")))
    assert "daemon refuses connections" in daemons
    # Each survivor's restore said it was kept in-process (the timeline's per-rank path).
    assert len(re.findall(r"job rank \d \(kept in-process\) restored from", daemons)) == 4
    # Every snapshot was taken, after the re-formation too (a new generation, accepted), also
    # by the survivors whose rank changed (a new connection for the new rank).
    moved = {pid for pid in survivors if at4[pid]["rank"] != _first_at(rows, 6, 0)[pid]["rank"]}
    assert all(r["failed"] == 0 and r["saves"] >= 200 for r in rows if "done" in r), [
        r for r in rows if "done" in r]
    took = max(r["t"] for r in at4.values()) - t_kill
    print(f"\nkill -> all 4 survivors training at world 4: {took:.2f} s; survivor pids "
          f"{sorted(survivors)} kept ({len(moved)} with a new rank); resumed from step "
          f"{min(resumed)}, the newest all snapshotted {snapshotted}, all held {held}, "
          f"committed {committed}")


def test_kill9_of_a_node_fsdp2_survivors_keep_their_processes(tmp_path):
    # Before the leave emptied DTensor's caches (elasticd/worker/dtensor_caches.py), they kept
    # each survivor's first FSDP2 round's group alive, its sockets open: every survivor said
    # it could not leave cleanly and its node fell back to a restart (paths "first").
    logdir, survivors, t_kill, at4, workdir, committed = _run(
        tmp_path, steps=STEPS, train_args=("--model", "fsdp"))
    assert set(at4) == survivors, (at4, survivors)  # the same 4 processes train at world 4
    assert {r["path"] for r in at4.values()} == {"in-process"}
    logs = "".join(open(p).read() for p in glob.glob(os.path.join(
        workdir, "*", "jobs", "*", "agent.log")))
    assert "sockets are still open" not in logs and "falling back" not in logs
    # A sharded state resumes from the committed step or newer (jobs.md, FSDP2), one for all.
    resumed = {r["step"] - 1 for r in at4.values()}
    assert len(resumed) == 1 and committed <= min(resumed), (resumed, committed)
    done = {r["pid"]: r["done"] for r in _rows(logdir) if "done" in r}
    assert set(done) == survivors and set(done.values()) == {STEPS}
    assert all(r["failed"] == 0 for r in _rows(logdir) if "done" in r)
    took = max(r["t"] for r in at4.values()) - t_kill
    print(f"\nFSDP2: kill -> all 4 survivors training at world 4 in-process: {took:.2f} s; "
          f"pids {sorted(survivors)} kept; resumed from step {min(resumed)} "
          f"(committed {committed})")


def test_a_survivor_stuck_in_its_re_formation_is_restarted_the_old_way(tmp_path):
    # The deadline is the job's (a spec field): 4 s here, against the default 10 s.
    logdir, survivors, t_kill, at4, workdir, committed = _run(
        tmp_path, steps=STEPS + 100, hang_rank=0, extra=("--reform-deadline", "4"))
    rows = _rows(logdir)
    hung = {r["pid"] for r in rows if r.get("rank") == 0 and r.get("round") is not None
            and r.get("world") == 6}
    # Rank 0's node (its 2 workers) fell back: new processes; the other survivors' stayed.
    assert hung and hung <= survivors
    fresh = set(at4) - survivors
    assert len(fresh) == 2 and not hung & set(at4)
    kept = set(at4) & survivors
    assert len(kept) == 2 and {at4[p]["path"] for p in kept} == {"in-process"}
    assert {at4[p]["path"] for p in fresh} == {"first"}
    # Nothing lost: the fallback node's fresh workers offered the snapshots of the ranks they
    # were (their agent said which; their node's RAM holds them), so the mixed round resumed at
    # the newest step any survivor completed, as a round of survivors only does (one step
    # past what some held: handed over). Before, a round with a restarted rank took the
    # committed step: 1-4 steps lost in 3 of 5 bench runs.
    held = _newest_all_held(rows, survivors)
    newest = max(_last_steps(rows, survivors).values())
    resumed = {r["step"] - 1 for r in at4.values()}
    assert resumed == {newest}, (resumed, newest, held, committed)
    took = max(r["t"] for r in at4.values()) - t_kill
    assert took >= 4  # the agent waited its deadline
    logs = "".join(open(p).read() for p in glob.glob(os.path.join(workdir, "*", "jobs", "*",
                                                                  "agent.log")))
    assert "falling back to a restart into round" in logs
    assert "(the job's reform deadline 4 s)" in logs  # the job's, not the 10 s default
    done = {r["pid"]: r["done"] for r in rows if "done" in r}
    assert set(done) == set(at4) and set(done.values()) == {STEPS + 100}
    assert all(r["failed"] == 0 for r in rows if "done" in r), [r for r in rows if "done" in r]
    print(f"\nfallback: kill -> world 4 training {took:.2f} s; kept {sorted(kept)}, "
          f"restarted {sorted(hung & survivors)} as {sorted(fresh)}; all resumed from step "
          f"{min(resumed)}, the newest any survivor held {newest}, all held {held}, "
          f"committed {committed}")


def test_a_frozen_nodes_survivors_leave_when_their_agents_learn_it_failed_in_process(tmp_path):
    # Before the learned collective timeout the survivors' groups had the decorator's 30 s,
    # their agents fell back at the 10 s reform deadline, and new processes trained at world 4;
    # then they left at the learned timeout (5 s), gloo's "Timed out waiting 5000ms".
    logdir, survivors, t_freeze, at4, workdir, committed = _run(tmp_path, steps=STEPS,
                                                                fault="freeze")
    assert set(at4) == survivors  # the same 4 processes train at world 4
    assert {r["path"] for r in at4.values()} == {"in-process"}
    logs = "".join(open(p).read() for p in glob.glob(os.path.join(
        workdir, "*", "jobs", "*", "agent.log")))
    assert "falling back" not in logs
    # Nothing reset their connections: the agents' abort shut them down (a survivor blocked
    # in a collective on the frozen ranks raises "Connection closed"; one between two steps
    # leaves at its next check), none waited for its collective timeout.
    left = re.findall(r"left round \d+ \((\w+): ([^\n]*)\)", logs)
    assert len(left) >= 4, logs[-3000:]
    assert all(kind == "Reformation" or "Connection closed" in why for kind, why in left), left
    assert not any("Timed out" in why for _, why in left), left
    # Every survivor resumed from one step, none from before the committed one.
    resumed = {r["step"] - 1 for r in at4.values()}
    assert len(resumed) == 1 and committed <= min(resumed), (resumed, committed)
    done = {r["pid"]: r["done"] for r in _rows(logdir) if "done" in r}
    assert survivors <= set(done) and set(done.values()) == {STEPS}
    took = max(r["t"] for r in at4.values()) - t_freeze
    print(f"\nfreeze -> all 4 survivors training at world 4 in-process: {took:.2f} s; "
          f"left: {sorted({kind if kind == 'Reformation' else why[:60] for kind, why in left})}; "
          f"resumed from step {min(resumed)} (committed {committed})")


def test_kill9_of_a_worker_alone_the_other_nodes_keep_their_processes(tmp_path):
    """A worker killed alone (its node's agent and daemon alive): its node restarts its own
    workers (torch's agent restarts its whole local group), the other nodes' workers re-form
    in-process around them at the same world size (a mixed round), and every rank resumes
    from one step, a step every rank holds (the committed one or newer), each rank its own
    rank's shard."""
    logdir = job_writable(str(tmp_path / "steps"))
    cluster = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path / "cluster"), lease_ttl=2,
                           replication=True)
    try:
        cluster.start()
        _submit(cluster, logdir, steps=STEPS)
        coord = cluster.coordinator()
        rows = _rows(logdir)
        rounds = {r["pid"]: r["round"] for r in rows if "step" in r}
        first6 = _first_at(rows, 6, 0)
        two = next(pid for pid, row in first6.items() if row["rank"] == 2)
        victim = next(n for n in cluster.nodes if two in cluster.nodes[n].tagged())
        theirs = set(rounds) - set(cluster.nodes[victim].tagged())
        assert len(theirs) == 4
        kv = coord.get(cluster.keys.replication("job").committed)
        committed = decode_committed(kv.value).step if kv is not None else 0
        t_kill = time.time()
        os.kill(two, 9)
        at6 = _wait(lambda: (f := new_group([r for r in _rows(logdir) if "step" in r],
                                            rounds, t_kill)) and len(f) == 6 and f,
                    60, "6 ranks training in a new group", cluster)
        _wait(lambda: sum(1 for r in _rows(logdir) if "done" in r) >= 6, 60,
              "the job finishing", cluster)
        workdir = cluster.workdir
    finally:
        cluster.stop()
    rows = [r for r in _rows(logdir) if "step" in r]
    kept = {r["pid"] for r in at6.values()} & theirs
    assert kept == theirs, (kept, theirs)  # the other nodes' 4 processes stay
    assert {at6[r]["path"] for r in at6 if at6[r]["pid"] in theirs} == {"in-process"}
    fresh = {r["pid"] for r in at6.values()} - theirs
    assert len(fresh) == 2 and not fresh & set(rounds)  # the victim's node: new processes
    assert {at6[r]["path"] for r in at6 if at6[r]["pid"] in fresh} == {"first"}
    # Every rank resumed from one step: at least the committed one, at most the newest step
    # every rank of the old group snapshotted (the killed worker's last snapshot may not
    # have completed: one step less).
    resumed = {r["step"] - 1 for r in at6.values()}
    assert len(resumed) == 1, resumed
    old = [r for r in rows if r["pid"] in rounds and r["round"] == rounds[r["pid"]]]
    saved = {pid: max((r["step"] for r in old if r["pid"] == pid and r["saved"]), default=0)
             for pid in rounds}
    newest_all = min(saved.values())
    assert committed <= min(resumed) <= newest_all, (resumed, committed, saved)
    # Steps trained again after the resume repeat the old group's losses bitwise (same world,
    # same rank, same state): nothing of the abandoned steps leaked into the resumed state.
    before = {(r["rank"], r["step"]): r["loss"] for r in old}
    again = [(r["rank"], r["step"], r["loss"]) for r in rows
             if r["pid"] not in rounds or r["round"] > rounds[r["pid"]]]
    redone = [(k, s, loss) for k, s, loss in again if (k, s) in before]
    assert all(before[(k, s)] == loss for k, s, loss in redone), redone
    logs = "".join(open(p).read() for p in glob.glob(os.path.join(workdir, "*", "jobs", "*",
                                                                  "agent.log")))
    assert "re-formed in-process" in logs
    done = {r["pid"]: r["done"] for r in _rows(logdir) if "done" in r}
    assert set(done) == {r["pid"] for r in at6.values()} and set(done.values()) == {STEPS}
    took = max(r["t"] for r in at6.values()) - t_kill
    print(f"\nkill -9 of worker pid {two} (rank 2, {victim}) -> 6 ranks in a new group: "
          f"{took:.2f} s; kept {sorted(kept)}, restarted as {sorted(fresh)}; all resumed from "
          f"step {min(resumed)} (committed {committed}, newest all snapshotted {newest_all}); "
          f"{len(redone)} steps trained again, losses equal")
