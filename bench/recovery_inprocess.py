"""``bench_recovery.py --mode in-process,restart``: kill -9 of a node, in-process re-formation
against the restart path, interleaved in one run (issue 31's benchmark).

Each run starts 3 elasticd daemons on one etcd (replication on, lease TTL ``--ttl``), submits
examples/train_in_process.py (DDP, gloo, 2 ranks per node, ``--nnodes 2:3``, a snapshot every
step) with ``--in-process`` or without it (the same script: the decorated function runs once,
a failure restarts every worker), waits until all 6 ranks train, a step is committed and the
snapshot grid is 1 (a snapshot every step), kills one node (rotating n1, n2, n3) at a random
moment 1.0-2.5 s later, and measures from the workers' step logs (one JSON line per step, wall
time):

* ``seconds``: the kill -> all 4 ranks of the new world logged a step (each its first);
* ``after_detection_seconds``: the node's ``failed`` event (the daemons' record of the failure,
  etcd) -> the same moment; negative when the survivors trained again before the daemons
  recorded it (the agents' round closed when the dead agent's rendezvous lease expired, which
  is kept alive apart from its daemon's); ``detection_seconds``: the kill -> that event;
* ``phases`` (in-process): where the seconds after the ``failed`` event went, from the
  moments the survivors report on their first step (:data:`MOMENTS`, ``elasticd.Round.times``;
  for each moment the slowest rank's; they add up to ``after_detection_seconds``, and a moment
  that came before the event makes its phase negative); ``median_phases`` per mode;
* ``steps_lost``: the newest step any rank logged at world 6 minus the step the new world
  resumed from (its first step minus one); ``steps_lost_vs_all_held``: the same against the
  newest step every survivor logged at world 6 (a step some survivors completed and others did
  not, whose collective failed on them, is not one training reached everywhere);
  ``steps_not_snapshotted``: that newest step minus the newest every survivor snapshotted (the
  daemon skips a snapshot while both of a rank's slots hold copies its commit needs), and
  each survivor's last snapshot (``last_snapshot_per_survivor``: a rank's slots hold the
  committed step and its newest, so survivors whose newest differ share only the committed);
* ``kept_pids``: how many of the 4 ranks at world 4 are processes that trained at world 6.

``--fault kill-worker`` SIGKILLs one worker process of the victim node instead (its agent and
daemon alive; :func:`_kill_worker` says what it measures): the world stays 6, the victim's
node restarts its workers, and in in-process mode the other nodes' workers re-form in-process.

``--fault rejoin`` kills a node as above and, once the survivors train, starts it again: the
survivors' pause for its return (:func:`_rejoin`; issue 31's "each rejoin stops the survivors
<= 0.3 s"; in-process, the newcomer is staged: elasticd/agent/in_process_agent.py);
``--setup-seconds S`` makes the script sleep S before it asks for its first round, as a real
script builds its model and data loaders::

    .venv/bin/python bench/bench_recovery.py --mode in-process,restart --fault rejoin --runs 5 \
        --out bench/results/recovery_inprocess_rejoin.json

``--fault freeze`` (SIGSTOP of every process of the node) and ``--fault partition`` (every
packet of its processes dropped, both ways: tests/chaos/partition.py, root) send no reset:
in-process, the survivors' pending collectives end at their agent's abort once the failure is
recorded (the lease TTL), or at their learned collective timeout
(elasticd/worker/collective_timeout.py) when that comes first; ``collective_timeout_seconds``
is the one gloo reported in the survivors' ``left`` lines (None: none timed out). The struck
node is SIGKILLed once measured. Results committed from::

    .venv/bin/python bench/bench_recovery.py --mode in-process,restart --fault freeze --runs 3 \
        --keep DIR --out bench/results/recovery_inprocess_freeze.json  # again with --append
    .venv/bin/python bench/bench_recovery.py --mode in-process,restart --fault partition \
        --runs 3 --keep DIR --out bench/results/recovery_inprocess_partition.json

(each run's ``logs`` key: ``bench/results/recovery_inprocess_logs.py DIR --into FILE``).

``--compile BACKEND`` and ``--loader-workers N`` run the job as a usual torch script (its model
compiled, its input through a DataLoader with worker processes, both built before the first
round: what a restarted worker pays again and an in-process survivor keeps); the result's
``job`` says so (:func:`job_text`)::

    .venv/bin/python bench/bench_recovery.py --mode in-process,restart --runs 20 \
        --compile aot_eager --loader-workers 2 --budget-minutes 10 \
        --out bench/results/recovery_inprocess_compiled.json  # then --append for the rest

Mode ``fallback``: in-process, with the worker of first-round rank 0 made to hang instead of
leaving its group (examples/train_in_process.py ``--hang-rank 0``, as the chaos test), and the
node of rank 5 killed (rank 0's other ring neighbour: a live one would wait on the hung rank's
open sockets); rank 0's node falls back to a restart at its agent's deadline
(``fallback_wait_seconds``: the collective timeout, or the job's reform deadline when shorter,
from its log line). Issue 31's bar: each fallback run's ``seconds`` within the restart mode's
p95 (``p95_seconds``, same run) plus the collective timeout (20 + 20 runs fit one 15-minute
hold of the CPU lock: a fallback run ~17 s, a restart run ~12 s, medians of ``wall_seconds``)::

    .venv/bin/python bench/bench_recovery.py --mode fallback,restart --runs 20 \
        --budget-minutes 14 --keep DIR --out bench/results/recovery_inprocess_fallback.json
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from elasticd.launcher import JOB_USER, LocalCluster, job_writable
from elasticd.replication.commit import decode_grid
from tests.chaos.test_in_process import new_group  # the same rule as the chaos test

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train_in_process.py")
MODES = ("in-process", "restart", "fallback")
#: The in-process path's moments, in order (:attr:`elasticd.Round.times`, then the example's
#: ``restored`` and ``ddp_built``, then the first step's own time).
MOMENTS = ("learned", "rendezvous_returned", "round_closed", "all_left", "assigned",
           "group_made", "discovered", "agreed", "fetched", "loaded", "restored", "ddp_built",
           "first_step")


def phases(failed_at: float | None, first: dict[int, dict]) -> dict[str, float] | None:
    """Where the seconds after detection went on the in-process path: for each moment, the
    slowest rank's time of it; each phase runs from the moment before (the first from the
    ``failed`` event) to it, so the phases add up to ``after_detection_seconds``. None when a
    rank reported no moments (it took the restart path)."""
    rows = list(first.values())
    if failed_at is None or not rows or not all(isinstance(r.get("times"), dict) for r in rows):
        return None
    out, before = {}, failed_at
    for name in MOMENTS:
        values = [r["t"] if name == "first_step" else r["times"].get(name) for r in rows]
        if any(v is None for v in values):
            continue
        at = max(values)
        out[f"to_{name}"] = round(at - before, 4)
        before = at
    return out


def rank_moments(failed_at: float | None, first: dict[int, dict]) -> dict[str, dict] | None:
    """Each new rank's own moments (its agent's and its own, :data:`MOMENTS` and ``left``),
    seconds after the ``failed`` event: where one rank waited on another."""
    if failed_at is None:
        return None
    out = {}
    for rank, row in sorted(first.items()):
        times = {**(row.get("times") or {}), "first_step": row["t"]}
        out[str(rank)] = {k: round(v - failed_at, 4) for k, v in
                          sorted(times.items(), key=lambda kv: kv[1])}
    return out


def _rows(logdir: str) -> list[dict]:
    rows = []
    for path in glob.glob(os.path.join(logdir, "steps-*.jsonl")):
        with open(path) as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if "step" in row:
                    rows.append(row)
    return rows


def _first_at(rows: list[dict], world: int, since: float) -> dict[int, dict]:
    """rank -> its first step row at ``world`` after ``since``."""
    first: dict[int, dict] = {}
    for row in sorted(rows, key=lambda r: r["t"]):
        if row["world"] == world and row["t"] > since and row["rank"] not in first:
            first[row["rank"]] = row
    return first


def run(mode: str, victim: str, ttl: int, timeout: float, workdir: str,
        fault: str = "kill", setup: float = 0.0, job_args: tuple[str, ...] = ()) -> dict:
    """One run of ``mode`` (see the module doc); the cluster is stopped before it returns.
    ``job_args``: more of the script's arguments (:func:`job_text` says what they make)."""
    logdir = job_writable(os.path.join(workdir, "steps"))
    c = LocalCluster(["n1", "n2", "n3"], workdir=os.path.join(workdir, "cluster"),
                     lease_ttl=ttl, replication=True)
    began = time.monotonic()
    # Where the run's own wall time went (seconds from its start): what a hold pays per run.
    wall: dict[str, float] = {}

    def mark(name: str) -> None:
        wall[name] = round(time.monotonic() - began, 3)

    out: dict = {"mode": mode, "victim": victim, "fault": fault, "recovered": False,
                 "wall_seconds": wall}
    cuts: dict = {}
    try:
        # Each daemon goes into its cgroup before it opens a socket (as the chaos harness and
        # bench_recovery's own partition do): a socket keeps the cgroup it was made in, and a
        # daemon enclosed once registered kept its etcd connection, and its lease, through the
        # cut (the lease never expired; the failure was recorded by a peer's probe ~8 s later).
        c.start(wait=False)
        cuts = _cgroups(c, fault)
        c.wait_for(lambda: all(c.registered(n) for n in c.nodes), 30, "every node registered")
        mark("registered")
        env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
        subprocess.run(
            [sys.executable, "-m", "elasticd.cli.main", "submit", "job",
             *(["--in-process"] if mode != "restart" else []),
             "--nnodes", "2:3", "--nproc-per-node", "2", "--user", JOB_USER,
             "--max-restarts", "100", "--", TRAIN, "--log", logdir, "--steps", "1000000",
             "--step-time", "0.02", *(["--hang-rank", "0"] if mode == "fallback" else []),
             *(["--setup-seconds", str(setup)] if setup else []), *job_args],
            env=env, check=True, capture_output=True, timeout=60)
        coord = c.coordinator()
        grid = c.keys.replication("job").commit_grid
        try:
            c.wait_for(lambda: len(_first_at(_rows(logdir), 6, 0)) == 6, 120, "6 ranks")
            mark("six_ranks")
            c.wait_for(lambda: coord.get(c.keys.replication("job").committed) is not None
                       and ((kv := coord.get(grid)) is None
                            or decode_grid(kv.value).grid == 1), 60, "grid 1")
        except TimeoutError as exc:
            return {**out, "error": str(exc)}
        mark("grid_1")
        time.sleep(random.uniform(1.0, 2.5))
        if fault == "kill-worker":
            return {**out, **_kill_worker(c, victim, logdir, timeout)}
        pids6 = {r["pid"] for r in _rows(logdir) if r["world"] == 6}
        if mode == "fallback":  # rank 5's node (see the module doc)
            five = next(r["pid"] for r in _rows(logdir) if r["world"] == 6 and r["rank"] == 5)
            victim = next(n for n in c.nodes if five in c.nodes[n].tagged())
            out["victim"] = victim
        victims = set(c.nodes[victim].tagged())
        t_kill = _strike(c, victim, fault, cuts)
        mark("struck")
        try:
            at4 = c.wait_for(lambda: (f := _first_at(_rows(logdir), 4, t_kill))
                             and len(f) == 4 and f, timeout, "world 4", interval=0.02)
        except TimeoutError:
            return out
        if fault == "rejoin":
            return {**out, **_rejoin(c, victim, logdir, timeout, t_kill, pids6 - victims)}
        back = max(r["t"] for r in at4.values())
        # The survivors may train again before any daemon recorded the failure (the agents'
        # round closed when the dead agent's lease expired, before its daemon's did): wait for
        # the record (after_detection_seconds is then negative) instead of leaving it out.
        failed: list[float] = []
        with contextlib.suppress(TimeoutError):
            c.wait_for(lambda: failed.extend(
                e["at"] for e in c.events() if e["kind"] == "failed" and e["node"] == victim)
                or failed, ttl + 3, "the failed event", interval=0.1)
        mark("measured")
        rows = _rows(logdir)
        old = [r for r in rows if r["world"] == 6]
        survivors = pids6 - victims
        held = min((max((r["step"] for r in old if r["pid"] == p), default=0)
                    for p in survivors), default=0)
        last_saved = sorted(max((r["step"] for r in old if r["pid"] == p and r.get("saved")),
                                default=0) for p in survivors)
        snapshotted = min(last_saved, default=0)
        resumed = min(r["step"] for r in at4.values()) - 1
        newest = max(r["step"] for r in old)
        return {**out, "recovered": True, "seconds": round(back - t_kill, 3),
                "detection_seconds": round(min(failed) - t_kill, 3) if failed else None,
                "phases": phases(min(failed) if failed else None, at4),
                "rank_moments": rank_moments(min(failed) if failed else None, at4),
                "after_detection_seconds": round(back - min(failed), 3) if failed else None,
                "killed_at_step": newest, "resumed_step": resumed,
                "steps_lost": newest - resumed, "steps_lost_vs_all_held": held - resumed,
                "newest_all_snapshotted": snapshotted, "steps_not_snapshotted": held - snapshotted,
                "last_snapshot_per_survivor": last_saved,
                "kept_pids": len({r["pid"] for r in at4.values()} & survivors),
                "paths": sorted({r["path"] for r in at4.values()}),
                # Which path each new rank took: "in-process" (its process kept) or "first"
                # (a process its node restarted: the fallback, or the restart mode).
                "rank_paths": {str(k): at4[k]["path"] for k in sorted(at4)},
                **_agent_logs(c, victim)}
    finally:
        if fault in ("freeze", "partition"):
            c.nodes[victim].kill()  # the struck node's processes: never thawed or healed
        c.stop()
        for cut in cuts.values():
            cut.remove()
        mark("stopped")


def _cgroups(c: LocalCluster, fault: str) -> dict:
    """``--fault partition``: each node's cgroup (its daemon added as soon as started, before
    it opens a socket; its agent and workers inherit it)."""
    if fault != "partition":
        return {}
    from tests.chaos.partition import Partition, available

    why = available()
    if why:
        raise SystemExit(f"--fault partition needs cgroup v2 and eBPF: {why}")
    cuts = {}
    for name, node in c.nodes.items():
        cuts[name] = Partition(f"inproc-{name}")
        cuts[name].add(node.pid)
    return cuts


def _strike(c: LocalCluster, victim: str, fault: str, cuts: dict) -> float:
    """Strikes; returns the fault's wall time: after the scan for the node's processes (75-160
    ms here), which was counted in ``seconds`` when the clock was read before it."""
    node = c.nodes[victim]
    if fault == "freeze":  # the daemon's group, then its agent and workers (their sessions)
        pids = node.tagged()
        at = time.time()
        node.signal(signal.SIGSTOP, group=True)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return at
    if fault == "partition":
        at = time.time()
        cuts[victim].cut()
        return at
    killed_at = node.kill()
    assert killed_at is not None, "the victim was never started"
    return killed_at


#: A survivor's ``left`` line when gloo timed its collective out; an agent's fallback line.
TIMED_OUT = re.compile(r"left round \d+ \(RuntimeError: [^)]*Timed out waiting (\d+)ms")
FELL_BACK = re.compile(r"falling back to a restart into round \d+ \((?:the workers' collective "
                       r"timeout|the job's reform deadline) ([\d.]+) s\)")


def _agent_logs(c: LocalCluster, victim: str) -> dict:
    """What the surviving agents' logs say of the recovery: the collective timeout gloo
    reported in the survivors' ``left`` lines, and the fallback's wait. The struck node's log
    is left out: a partitioned node's own workers time out too, at the same value, and counted
    they made a survivor ended by its agent's abort look timed out."""
    text = ""
    for path in glob.glob(os.path.join(c.workdir, "*", "jobs", "*", "agent.log")):
        if os.path.relpath(path, c.workdir).split(os.sep)[0] == victim:
            continue
        with open(path, errors="replace") as fh:
            text += fh.read()
    waited = sorted({int(m) / 1000 for m in TIMED_OUT.findall(text)})
    fell = sorted({float(m) for m in FELL_BACK.findall(text)})
    return {"collective_timeout_seconds": waited or None, "fallback_wait_seconds": fell or None}


def _kill_worker(c: LocalCluster, victim: str, logdir: str, timeout: float) -> dict:
    """``--fault kill-worker``: SIGKILL of one worker of ``victim`` (its lowest rank), its
    agent and daemon alive; measured until all 6 ranks trained in the group made after it.
    ``seconds``: the kill -> every rank's first step there; ``steps_lost``: the newest step
    any rank logged before minus the step the new group resumed from; ``same_step``: every
    rank resumed from that one step; ``kept_pids``: the other nodes' workers (4) that train
    in the new group in the same process; ``phases``: as :func:`phases`, from the kill, over
    the kept ranks' reported moments."""
    rows = _rows(logdir)
    rounds = {r["pid"]: r["round"] for r in rows}
    mine = set(c.nodes[victim].tagged())
    target = min((r for r in rows if r["pid"] in mine), key=lambda r: r["rank"], default=None)
    if target is None:
        return {"error": f"no worker of {victim} logged a step"}
    others = set(rounds) - mine
    t_kill = time.time()
    os.kill(target["pid"], signal.SIGKILL)
    try:
        at6 = c.wait_for(lambda: (f := new_group(_rows(logdir), rounds, t_kill))
                         and len(f) == 6 and f, timeout, "6 ranks in a new group",
                         interval=0.02)
    except TimeoutError:
        return {"killed_rank": target["rank"]}
    back = max(r["t"] for r in at6.values())
    old = [r for r in _rows(logdir) if r["pid"] in rounds and r["round"] == rounds[r["pid"]]
           and r["t"] <= back]
    newest = max(r["step"] for r in old)
    resumed = {r["step"] - 1 for r in at6.values()}
    kept = {r["rank"]: r for r in at6.values() if r["pid"] in others}
    return {"recovered": True, "killed_rank": target["rank"],
            "seconds": round(back - t_kill, 3), "killed_at_step": newest,
            "resumed_step": min(resumed), "same_step": len(resumed) == 1,
            "steps_lost": newest - min(resumed),
            "kept_pids": len(kept), "phases": phases(t_kill, kept),
            "paths": sorted({r["path"] for r in at6.values()})}


def _rejoin(c: LocalCluster, victim: str, logdir: str, timeout: float, t_kill: float,
            survivors: set[int]) -> dict:
    """``--fault rejoin``: once the 4 survivors train, ``victim`` (killed) is started again
    1.0-2.0 s later; measured until all 6 ranks trained at world 6, from the step logs and the
    example's ``ready-<pid>.json`` (its script reached the function, next it asks for its
    round):

    * ``pause_seconds``, ``pause_per_survivor``, ``step_seconds``, ``kept_pids``: how long the
      survivors stood still for the rejoin, from world 4 to world 6 (:func:`rejoin_pause`);
    * ``return_seconds``: the node's start -> all 6 ranks training;
    * ``ready_before_reform_seconds``: the first survivor agent's start of the re-formation
      (``reform_started``, its abort) minus the newcomers' latest ready moment (positive:
      staged, ready before any survivor was stopped for them);
    * ``newcomer_moments``: a newcomer's moments (``elasticd.Round.times``) after the node's
      start, the slowest newcomer's each.
    """
    time.sleep(random.uniform(1.0, 2.0))
    t_back = time.time()
    c.start_node(victim)
    try:
        at6 = c.wait_for(lambda: (f := _first_at(_rows(logdir), 6, t_back)) and len(f) == 6
                         and f, timeout, "world 6 again", interval=0.02)
    except TimeoutError:
        return {"error": "not back at world 6"}
    pause = rejoin_pause(_rows(logdir), at6, 4, t_kill, survivors)
    if pause is None:
        return {"error": "no step at world 4 before world 6"}
    first6 = {r["pid"]: r["t"] for r in at6.values()}
    kept = set(first6) & survivors
    newcomers = set(first6) - set(pause.pop("old_world_pids"))
    ready = {}
    for path in glob.glob(os.path.join(logdir, "ready-*.json")):
        with contextlib.suppress(ValueError, OSError), open(path) as fh:
            row = json.load(fh)
            ready[row["pid"]] = row["t"]
    newest_ready = max((ready[p] for p in newcomers if p in ready), default=None)
    began = min(((r.get("times") or {}).get("reform_started") or float("inf")
                 for r in at6.values() if r["pid"] in kept), default=float("inf"))
    moments: dict[str, float] = {}
    for r in at6.values():
        if r["pid"] in newcomers and kept:
            for name, at in {**(r.get("times") or {}), "first_step": r["t"]}.items():
                moments[name] = max(moments.get(name, at - t_back), round(at - t_back, 4))
    return {"recovered": True, **pause,
            "return_seconds": round(max(first6.values()) - t_back, 3),
            "ready_before_reform_seconds": (round(began - newest_ready, 3)
                                            if newest_ready is not None and began < float("inf")
                                            else None),
            "newcomer_moments": dict(sorted(moments.items(), key=lambda kv: kv[1])) or None,
            "paths": sorted({r["path"] for r in at6.values()})}


def rejoin_pause(rows: list[dict], first_new: dict[int, dict], old_world: int, since: float,
                 survivors: set[int]) -> dict | None:
    """How long a rejoin stopped the survivors, from the step rows (:func:`_rejoin`; the soak's
    in-process mode measures each of its rejoins with it too): ``first_new`` is each rank's
    first step row at the new world, ``since`` a moment before the world ``old_world`` began
    (its shrink's kill), ``survivors`` the pids that trained before it. None when no rank
    logged a step at ``old_world`` after ``since`` and before the new world's first step.

    * ``pause_seconds``: the first survivor's last step at ``old_world`` -> the last rank's
      first step at the new world (the restart path's survivors are new processes: their
      ranks' steps);
    * ``pause_per_survivor``: each kept survivor's own last step at the old world -> its first
      at the new one;
    * ``step_seconds``: the median time between two steps of a rank at ``old_world`` (what a
      step costs without a rejoin: the pause includes one);
    * ``kept_pids``: the survivors' processes among the new world's ranks;
    * ``old_world_pids``: the processes that stepped at ``old_world`` then.
    """
    first = {r["pid"]: r["t"] for r in first_new.values()}
    old: dict[int, list[float]] = {}
    for r in sorted(rows, key=lambda r: r["t"]):
        if r.get("world") == old_world and since < r["t"] < min(first.values()):
            old.setdefault(r["pid"], []).append(r["t"])
    if not old:
        return None
    stopped = min(ts[-1] for ts in old.values())
    gaps = [b - a for ts in old.values() for a, b in zip(ts, ts[1:])]
    kept = set(first) & survivors
    return {"pause_seconds": round(max(first.values()) - stopped, 3),
            "pause_per_survivor": sorted(round(first[p] - old[p][-1], 3) for p in kept
                                         if p in old),
            "step_seconds": round(statistics.median(gaps), 4) if gaps else None,
            "kept_pids": len(kept), "old_world_pids": sorted(old)}


def summarize_rejoin(runs: list[dict]) -> dict:
    """``--fault rejoin``'s figures over ``runs`` (:func:`_rejoin`)."""
    ok = [r for r in runs if r.get("recovered")]
    pauses = [r["pause_seconds"] for r in ok]
    return {"runs": len(runs), "recovered": len(ok),
            "median_pause_seconds": round(statistics.median(pauses), 3) if ok else None,
            "max_pause_seconds": max(pauses, default=None),
            "runs_with_pause_at_most_0.3_s": sum(p <= 0.3 for p in pauses),
            "pause_seconds": pauses,
            "median_step_seconds": round(statistics.median(
                r["step_seconds"] for r in ok if r.get("step_seconds")), 4) if ok else None,
            "median_return_seconds": round(statistics.median(
                r["return_seconds"] for r in ok), 3) if ok else None,
            "ready_before_reform_seconds": [r.get("ready_before_reform_seconds") for r in ok],
            "kept_pids": [r.get("kept_pids") for r in ok]}


def summarize(runs: list[dict]) -> dict:
    if any("pause_seconds" in r for r in runs):
        return summarize_rejoin(runs)
    ok = [r for r in runs if r.get("recovered")]

    def med(key: str) -> float | None:
        values = [r[key] for r in ok if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    return {"runs": len(runs), "recovered": len(ok),
            "median_seconds": med("seconds"), "p95_seconds": p95([r["seconds"] for r in ok]),
            "median_after_detection_seconds": med("after_detection_seconds"),
            "max_seconds": max((r["seconds"] for r in ok), default=None),
            "steps_lost": [r["steps_lost"] for r in ok],
            "runs_with_0_steps_lost": sum(r["steps_lost"] == 0 for r in ok),
            "steps_lost_vs_all_held": [r.get("steps_lost_vs_all_held") for r in ok],
            "runs_with_0_steps_lost_vs_all_held": sum(r.get("steps_lost_vs_all_held") == 0
                                                      for r in ok),
            "steps_not_snapshotted": [r.get("steps_not_snapshotted") for r in ok],
            "runs_resumed_at_one_step": sum(r.get("same_step", True) for r in ok),
            "kept_pids": [r.get("kept_pids") for r in ok],
            "median_detection_seconds": med("detection_seconds"),
            "median_phases": median_phases(ok)}


def p95(values: list[float]) -> float | None:
    """The 95th percentile, interpolated between the sorted samples (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    at = 0.95 * (len(v) - 1)
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return round(v[lo] + (v[hi] - v[lo]) * (at - lo), 3)


def fallback_bar(results: dict[str, list[dict]]) -> dict | None:
    """Issue 31's fallback bar, when both ``fallback`` and ``restart`` ran: each fallback
    run's seconds against the restart path's p95 (same run) plus the collective timeout."""
    if "fallback" not in results or "restart" not in results:
        return None
    restart = p95([r["seconds"] for r in results["restart"] if r.get("recovered")])
    runs = results["fallback"]
    waits = {w for r in runs for w in (r.get("fallback_wait_seconds") or [])}
    if restart is None or not waits:
        return {"restart_p95_seconds": restart, "collective_timeout_seconds": None}
    bar = round(restart + max(waits), 3)
    return {"restart_p95_seconds": restart, "collective_timeout_seconds": max(waits),
            "bar_seconds": bar,
            "fallback_seconds": [r.get("seconds") for r in runs],
            "within": sum(1 for r in runs if r.get("recovered") and r["seconds"] <= bar),
            "runs": len(runs)}


def median_phases(ok: list[dict]) -> dict[str, float] | None:
    """Each phase's median over the runs that reported it (:func:`phases`)."""
    runs = [r["phases"] for r in ok if r.get("phases")]
    if not runs:
        return None
    names = [f"to_{m}" for m in MOMENTS]
    return {n: round(statistics.median(p[n] for p in runs if n in p), 4)
            for n in names if any(n in p for p in runs)}


def main(modes: list[str], runs: int, ttl: int, timeout: float, out_path: str,
         keep: str | None, append: bool = False, fault: str = "kill",
         setup: float = 0.0, budget: float | None = None,
         clock: Callable[[], float] = time.monotonic, job_args: tuple[str, ...] = ()) -> int:
    """``runs`` runs of each of ``modes``, interleaved (mode A, mode B, A, B, ...), victims
    rotating; writes ``out_path`` after each round of modes. ``append``: the runs already in
    ``out_path`` (same modes and TTL) are kept and these added after them, the victims'
    rotation going on (a long benchmark split across several sittings). ``budget``: seconds;
    no round of modes is begun that the slowest round so far would carry past it (a hold of
    the CPU lock ends with whole rounds, every cluster stopped, instead of a kill mid-run),
    and the file says how many rounds fitted."""
    results: dict[str, list[dict]] = {m: [] for m in modes}
    commands = []
    if append and os.path.exists(out_path):
        with open(out_path) as fh:
            old = json.load(fh)
        if old.get("lease_ttl_seconds") != ttl or not all(m in old for m in modes):
            raise SystemExit(f"--append: {out_path} holds other modes or another TTL")
        results = {m: list(old[m]["detail"]) for m in modes}
        commands = old.get("commands") or [old.get("command")]
    commands.append("bench/bench_recovery.py " + " ".join(sys.argv[1:]))
    if keep:
        os.makedirs(keep, exist_ok=True)
    done = min(len(v) for v in results.values())
    started, slowest = clock(), 0.0
    for i in range(done, done + runs):
        elapsed = clock() - started
        if budget is not None and elapsed + slowest > budget:
            print(f"budget: {budget:g} s; {i - done} rounds of {runs} fitted "
                  f"({elapsed:.0f} s, the slowest round {slowest:.0f} s)", flush=True)
            break
        victim = f"n{i % 3 + 1}"
        for mode in modes:
            d = tempfile.mkdtemp(prefix=f"inproc-bench-{mode}-", dir=keep)
            try:
                r = run(mode, victim, ttl, timeout, d, fault, setup, job_args)
            finally:
                if not keep:
                    shutil.rmtree(d, ignore_errors=True)
            results[mode].append(r)
            print(f"{mode} run {i + 1}: {fault} {victim}: {r}", flush=True)
        slowest = max(slowest, clock() - started - elapsed)
        _write(out_path, modes, results, ttl, commands, fault, setup,
               {"budget_seconds": budget, "rounds": i + 1 - done, "rounds_asked": runs,
                "seconds": round(clock() - started)} if budget is not None else None,
               job_args)
    print(json.dumps({**{m: summarize(results[m]) for m in modes},
                      "fallback_bar": fallback_bar(results)}, indent=2))
    return 0


def _write(out_path: str, modes: list[str], results: dict[str, list[dict]], ttl: int,
           commands: list[str], fault: str, setup: float = 0.0,
           hold: dict | None = None, job_args: tuple[str, ...] = ()) -> None:
    result = {
        "benchmark": "recovery_inprocess" + ("" if fault == "kill" else
                                             "_" + fault.replace("-", "_")),
        "fault": fault,
        "command": commands[0] if len(commands) == 1 else " && ".join(commands),
        "commands": commands,
        "job": "examples/train_in_process.py, 3 nodes x 2 ranks, --nnodes 2:3, gloo CPU, "
               "20 ms sleep per step, a snapshot every step, replication on"
               + (f", {setup:g} s of setup before the first round (--setup-seconds)"
                  if setup else "") + job_text(job_args),
        "lease_ttl_seconds": ttl, "runs_per_mode": min(len(v) for v in results.values()),
        "interleaved": True, "machine": {"cpus": os.cpu_count()},
        **{m: {**summarize(results[m]), "detail": results[m]} for m in modes},
        "fallback_bar": fallback_bar(results),
        **({"hold": hold} if hold else {}),
    }
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path + ".tmp", "w") as fh:
        json.dump(result, fh, indent=2)
    os.replace(out_path + ".tmp", out_path)


def job_text(job_args: tuple[str, ...]) -> str:
    """What ``job_args`` add to the job, for the result's ``job``: "" for the bare job."""
    opts = dict(zip(job_args[::2], job_args[1::2]))
    parts = []
    if "--compile" in opts:
        parts.append(f"the model torch.compile'd with backend {opts['--compile']} before the "
                     "first round (--compile; dynamo compiles at the first step of each new "
                     "process, and in-process survivors keep the graph)")
    if "--loader-workers" in opts:
        parts.append(f"the input drawn through a DataLoader with {opts['--loader-workers']} "
                     "persistent worker processes per rank, started before the first round "
                     "(--loader-workers; in-process survivors keep them)")
    return "".join(", " + p for p in parts)
