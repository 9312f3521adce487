"""Recovery from kill -9 of a whole node: elasticd vs tuned plain torchrun, same job, same host.

Each run starts 3 "nodes" on this host training examples/train.py (DDP, gloo, 1 worker per
node, ``--nnodes 2:3``), waits until all train at world size 3, kills one node's every process
with SIGKILL (rotating n1, n2, n3: n1 is the first started, the c10d store host for plain
torchrun), and measures the time until every survivor logs a training step at world size 2,
and the steps lost: the last step logged before the kill minus the step the survivors resumed
from (read from their restarted workers' ``start ... restored step S`` lines).

* elasticd: 3 daemons on one etcd, replication on (m=2; ``--no-replication`` turns it off), the
  job submitted with elasticctl; examples/train.py snapshots every step. The steps lost the
  restore itself reported are recorded beside the measured ones.
* plain torchrun (the baseline): c10d rendezvous on the first node, tuned as in docs/facts.md
  (``last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3``, worker store sharing
  off with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), ``--max-restarts 100``, training
  bench/train_disk.py: the same model and data with a torch.save checkpoint every
  ``--disk-every`` steps. The kill comes at a random point between checkpoints.

    .venv/bin/python bench/bench_recovery.py --runs 20 --cold-runs 6 --baseline-runs 9 \\
        --out bench/results/recovery.json

``--fault`` measures the faults that send no TCP reset, with the same clock and the same
bound: ``freeze`` SIGSTOPs every process of the node (daemon, agent, workers: a hung machine,
or one cut off the network — nothing it holds answers and no connection is closed), and
``stop-daemon`` SIGSTOPs its daemon alone (its agent and workers keep running), and
``partition`` drops every packet of the node's processes, both ways (cgroup v2 + eBPF, as the
chaos suite's partition: root only; the local API's Unix socket keeps working). The frozen or
cut-off processes are SIGKILLed once the run is measured. Results committed from::

    .venv/bin/python bench/bench_recovery.py --fault freeze --runs 9 --baseline-runs 3 \\
        --out bench/results/recovery_freeze.json
    .venv/bin/python bench/bench_recovery.py --fault stop-daemon --runs 9 --baseline-runs 0 \\
        --out bench/results/recovery_stop_daemon.json
    .venv/bin/python bench/bench_recovery.py --fault partition --runs 9 --baseline-runs 0 \\
        --out bench/results/recovery_partition.json

``--mode in-process,restart`` is issue 31's benchmark instead (bench/recovery_inprocess.py: 2
ranks per node, examples/train_in_process.py with and without ``--in-process``, ``--runs``
runs of each mode, interleaved)::

    .venv/bin/python bench/bench_recovery.py --mode in-process,restart --runs 20 \\
        --out bench/results/recovery_inprocess.json

With ``--fault kill-worker`` one worker process is SIGKILLed instead (its node's agent and
daemon alive), the same modes interleaved::

    .venv/bin/python bench/bench_recovery.py --mode in-process,restart --fault kill-worker \\
        --runs 10 --out bench/results/recovery_inprocess_kill_worker.json

With ``--fault rejoin`` the killed node is started again once the survivors train, and what is
measured is how long the survivors stand still for its return (a staged newcomer's)::

    .venv/bin/python bench/bench_recovery.py --mode in-process,restart --fault rejoin \\
        --runs 5 --out bench/results/recovery_inprocess_rejoin.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from elasticd.agent.supervisor import signal_all
from elasticd.launcher import JOB_USER, LocalCluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
TRAIN_DISK = os.path.join(REPO, "bench", "train_disk.py")
STEP_RE = re.compile(rb"step (\d+) world (\d+) rank")
RESTORED_RE = re.compile(rb"restored step (\d+) from (\w+)(?: in [\d.]+ s, steps lost (\d+))?")
TRAIN_ARGS = ["--steps", "1000000", "--step-time", "0.02"]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return b""


def _at_world(path: str, world: int, after: int = 0) -> bool:
    return any(int(m.group(2)) == world for m in STEP_RE.finditer(_read(path), after))


def _last_world(path: str) -> int | None:
    """The world size of the last step this log shows (None: no step yet)."""
    last = None
    for m in STEP_RE.finditer(_read(path)):
        last = m
    return int(last.group(2)) if last else None


def _not_at_full_world(logs: dict[str, str], full: int) -> str:
    """Why a run cannot measure a recovery ("" when every node's last step was at ``full``):
    the job left world ``full`` before the fault, so survivors already training at a smaller
    world would count as recovered at once (seen once: 0.00 s, no restart)."""
    worlds = {n: _last_world(p) for n, p in logs.items()}
    if all(w == full for w in worlds.values()):
        return ""
    return "not at world %d when struck (last step worlds: %s)" % (
        full, ", ".join(f"{n}={w}" for n, w in sorted(worlds.items())))


def _last_step(paths, world: int | None = None) -> int:
    """The highest step any of these logs reached so far (at ``world`` only, if given: read
    after a fault, a survivor's steps at the smaller world are not the ones it lost)."""
    return max((int(m.group(1)) for p in paths for m in STEP_RE.finditer(_read(p))
                if world is None or int(m.group(2)) == world), default=0)


def _kill_phase() -> float:
    """Seconds to wait before the kill: a random point, so a disk checkpoint every N steps is
    hit at a random phase."""
    return random.uniform(1.0, 2.5)


def _resumed(logs: dict[str, str], marks: dict[str, int], killed_at_step: int) -> dict:
    """Where the survivors' restarted workers resumed: step, source, steps lost."""
    found = [RESTORED_RE.search(_read(p), marks[n]) for n, p in logs.items()]
    found = [m for m in found if m]
    if not found:
        return {"resumed_step": None}
    step = min(int(m.group(1)) for m in found)
    reported = [int(m.group(3)) for m in found if m.group(3) is not None]
    return {"resumed_step": step, "sources": sorted({m.group(2).decode() for m in found}),
            "steps_lost": max(0, killed_at_step - step),
            "steps_lost_reported": max(reported) if reported else None}


def _wait(cond, timeout: float, interval: float = 0.05) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(interval)
    return None


def _names(count: int) -> list[str]:
    return [f"n{i + 1}" for i in range(count)]


FAULTS = ("kill", "freeze", "stop-daemon", "partition")


def _partitions(c: LocalCluster, fault: str) -> dict:
    """With ``--fault partition``: each node's cgroup (tests/chaos/partition.py: cgroup v2 +
    eBPF, root), its daemon added right after it started (its agent and workers inherit it)."""
    if fault != "partition":
        return {}
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.chaos.partition import Partition, available

    why = available()
    if why:
        raise SystemExit(f"--fault partition needs cgroup v2 and eBPF: {why}")
    cuts = {}
    for name, node in c.nodes.items():
        cuts[name] = Partition(name)
        cuts[name].add(node.pid)
    return cuts


def _strike(node, fault: str, cut=None) -> tuple[float, str]:
    """Applies ``fault`` to a LocalCluster node (see the module doc); returns the fault's wall
    time and what that moment is. A recovery's seconds count from it, not from the return of
    this call: ``node.kill()`` scans for the node's processes before its first SIGKILL (75-160
    ms here) and again after it until none is left, then waits for the daemon and deletes the
    node's shared memory, all while the survivors already recover (the clock started at its
    return left that tail out)."""
    if fault == "kill":
        before = time.time()
        killed_at = node.kill()
        if killed_at is not None:
            return killed_at, "the first SIGKILL"
        # An older launcher's kill returns no moment (a tree measured for an A/B): its scan
        # before the first SIGKILL then counts as recovery, against that tree.
        return before, "before kill() (this launcher returns no moment: its scan counts)"
    if fault == "freeze":
        pids = [node.pid, *node.tagged()]
        at = time.time()
        signal_all(pids, signal.SIGSTOP)
        return at, "the first SIGSTOP"
    if fault == "partition":
        at = time.time()
        cut.cut()
        return at, "the cut"
    at = time.time()
    signal_all([node.pid], signal.SIGSTOP)
    return at, "the daemon's SIGSTOP"


#: A survivor's daemon revoking a dead peer's lease once its collective broke
#: (elasticd/daemon/peer_probe.py); the line begins with the log's time.
PROBE_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ (\S+) \S+: (\S+)'s daemon "
                      r"refuses connections at \S+ after a collective broke .*revoking its "
                      r"lease", re.M)


def probe_revocation(logs: dict[str, str], victim: str) -> tuple[str, float] | None:
    """The earliest revocation of ``victim``'s lease by a survivor's peer probe in the daemons'
    logs (node name -> log text): (who, wall time), or None. A node killed whole resets its
    connections: a survivor's broken collective has its daemon knock at the victim's port,
    find it refused and revoke its lease at once, well before its TTL ran out."""
    found = []
    for text in logs.values():
        for m in PROBE_RE.finditer(text):
            if m.group(3) == victim:
                at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append((at, m.group(2)))
    if not found:
        return None
    at, who = min(found)
    return who, at


def _workdir(prefix: str, keep: str | None):
    """A temporary work directory, or with ``keep`` one left under it (logs to read later)."""
    if keep:
        os.makedirs(keep, exist_ok=True)
        return contextlib.nullcontext(tempfile.mkdtemp(prefix=prefix, dir=keep))
    return tempfile.TemporaryDirectory(prefix=prefix)


def run_elasticd(victim: str, ttl: int, timeout: float, replication: bool = True,
                 nodes: int = 3, extra_args: tuple = (), fault: str = "kill",
                 keep: str | None = None) -> dict:
    full = nodes
    with _workdir("elasticd-bench-", keep) as d:
        c = LocalCluster(_names(nodes), workdir=d, lease_ttl=ttl, replication=replication,
                         extra_args=extra_args)
        cuts: dict = {}
        try:
            c.start(wait=False)
            cuts = _partitions(c, fault)
            c.wait_for(lambda: all(c.registered(n) for n in c.nodes), 30, "every node registered")
            env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
            subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "job",
                            "--nnodes", f"{full - 1}:{full}", "--nproc-per-node", "1",
                            "--user", JOB_USER,
                            "--", TRAIN, *TRAIN_ARGS], env=env, check=True,
                           capture_output=True, timeout=60)
            logs = {n: os.path.join(d, n, "jobs", "job", "agent.log") for n in c.nodes}
            if _wait(lambda: all(_at_world(p, full) for p in logs.values()), 120) is None:
                return {"victim": victim, "recovered": False,
                        "error": f"never reached world {full}"}
            time.sleep(_kill_phase())
            survivors = [n for n in c.nodes if n != victim]
            marks = {n: len(_read(logs[n])) for n in survivors}
            invalid = _not_at_full_world(logs, full)
            struck_at, moment = _strike(c.nodes[victim], fault, cuts.get(victim))
            returned_at = time.time()
            at_step = _last_step(logs.values(), full)
            t = _wait(lambda: all(_at_world(logs[n], full - 1, marks[n]) for n in survivors),
                      timeout)
            seen_at = time.time()
            if fault != "kill":
                c.nodes[victim].kill()  # SIGKILL ends stopped processes too
            leftovers = len(c.nodes[victim].tagged())
            probe = probe_revocation({n: c.nodes[n].log_text() for n in survivors}, victim)
            return {"victim": victim, "recovered": t is not None,
                    "seconds": seen_at - struck_at if t is not None else None,
                    "struck_at": struck_at, "fault_moment": moment,
                    "strike_returned_after": returned_at - struck_at,
                    **({"revoked_by_probe": {"by": probe[0], "after": probe[1] - struck_at}}
                       if probe else {}),
                    "killed_at_step": at_step,
                    **_resumed({n: logs[n] for n in survivors}, marks, at_step),
                    "leftover_processes": leftovers, **({"invalid": invalid} if invalid else {})}
        finally:
            c.stop()
            for cut in cuts.values():
                cut.remove()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> float:
    """Signals an agent's group and its workers' groups (they have sessions of their own);
    with SIGKILL, waits for the agent. Returns the wall time of the first signal."""
    try:
        kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    except OSError:
        kids = []
    at = time.time()
    for pid in [proc.pid, *map(int, kids)]:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if sig == signal.SIGKILL:
        proc.wait()
    return at


def run_torchrun(victim: str, timeout: float, every: int = 10, nodes: int = 3,
                 fault: str = "kill") -> dict:
    full = nodes
    port = _free_port()
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="torchrun-bench-") as d:
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        logs = {n: os.path.join(d, f"{n}.log") for n in _names(nodes)}
        try:
            for n in _names(nodes):
                with open(logs[n], "wb") as out:
                    procs[n] = subprocess.Popen(
                        [sys.executable, "-m", "torch.distributed.run", "--nnodes",
                         f"{full - 1}:{full}",
                         "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
                         "--rdzv-conf",
                         "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
                         "--max-restarts", "100", "--monitor-interval", "0.1",
                         "--log-dir", os.path.join(d, f"tr-{n}"), TRAIN_DISK,
                         "--ckpt-dir", d, "--every", str(every), *TRAIN_ARGS],
                        stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                if n == "n1":
                    time.sleep(1.0)  # n1 hosts the c10d store
            if _wait(lambda: all(_at_world(p, full) for p in logs.values()), 120) is None:
                return {"victim": victim, "recovered": False,
                        "error": f"never reached world {full}"}
            time.sleep(_kill_phase())
            survivors = [n for n in procs if n != victim]
            marks = {n: len(_read(logs[n])) for n in survivors}
            # No daemon here: "stop-daemon" has no plain-torchrun counterpart; "freeze" stops
            # the agent and its workers.
            struck_at = _kill_tree(procs[victim],
                                   signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            at_step = _last_step(logs.values())

            def trained() -> bool:
                return all(_at_world(logs[n], full - 1, marks[n]) for n in survivors)

            # Killing the c10d store host ends the job (docs/facts.md): stop waiting once every
            # survivor has exited.
            t = _wait(lambda: trained() or all(procs[n].poll() is not None for n in survivors),
                      timeout)
            seen_at = time.time()
            if t is not None and not trained():
                t = None
            return {"victim": victim, "recovered": t is not None,
                    "seconds": seen_at - struck_at if t is not None else None,
                    "survivors_exited": all(procs[n].poll() is not None for n in survivors),
                    "killed_at_step": at_step,
                    **_resumed({n: logs[n] for n in survivors}, marks, at_step)}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    _kill_tree(p)


def detection_floor(ttl: float) -> float:
    """The soonest a node's failure can be found from its lease alone: it expires TTL after its
    last keep-alive, sent every TTL/3, so at least 2/3 TTL after the fault. Sooner takes a
    survivor's peer probe (elasticd/daemon/peer_probe.py): a node killed whole resets its
    connections, a survivor's collective breaks at once, its daemon finds the dead daemon's
    port refusing and revokes the lease; a frozen, stopped or cut-off node refuses nothing."""
    return ttl * 2 / 3


def impossible(run: dict, floor: float | None) -> str:
    """Why a run counted as recovered cannot have measured a recovery ("" when it can).

    Args:
        floor: :func:`detection_floor` for elasticd runs; None for the baseline (its c10d
            keep-alives set no such bound here). It does not bound a run whose victim's lease
            a survivor's probe revoked (``revoked_by_probe``, read from the daemons' logs),
            if that came before the recovery.
    """
    if not run.get("recovered"):
        return ""
    if run.get("resumed_step") is None:
        return ("counted as recovered with no restart seen (no survivor logged a restore): "
                "the survivors were already at the smaller world, so nothing was measured")
    probe = run.get("revoked_by_probe")
    probed = probe is not None and probe["after"] <= run["seconds"]
    if floor is not None and not probed and run["seconds"] < floor:
        return (f"recovered {run['seconds']:.3g} s after the fault, sooner than the failure "
                f"can be detected ({floor:.2f} s: the lease TTL less one keep-alive interval) "
                "and no survivor's probe revoked its lease before")
    return ""


def summarize(runs: list[dict], floor: float | None = None) -> dict:
    """Figures over the valid runs; ``invalid`` counts runs that could not measure a recovery
    (listed in the detail with their reason): struck while not at the full world, or an
    impossible sample (:func:`impossible`), which is marked so here."""
    for r in runs:
        why = "" if r.get("invalid") else impossible(r, floor)
        if why:
            r["invalid"] = why
    invalid = [r for r in runs if r.get("invalid")]
    runs = [r for r in runs if not r.get("invalid")]
    ok = [r["seconds"] for r in runs if r["recovered"]]
    lost = [r["steps_lost"] for r in runs if r["recovered"] and r.get("steps_lost") is not None]
    probed = [r["revoked_by_probe"]["after"] for r in runs
              if r["recovered"] and r.get("revoked_by_probe")]
    return {"runs": len(runs), "invalid": len(invalid), "recovered": len(ok),
            "revoked_by_probe": len(probed),
            "median_probe_seconds": round(statistics.median(probed), 3) if probed else None,
            "median_steps_lost": statistics.median(lost) if lost else None,
            "max_steps_lost": max(lost) if lost else None,
            "median_seconds": round(statistics.median(ok), 2) if ok else None,
            "worst_seconds": round(max(ok), 2) if ok else None,
            "best_seconds": round(min(ok), 2) if ok else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="elasticd runs")
    p.add_argument("--baseline-runs", type=int, default=3, help="plain torchrun runs")
    p.add_argument("--cold-runs", type=int, default=0,
                   help="elasticd runs with --worker-start cold (new interpreters, as torchrun)")
    p.add_argument("--ttl", type=int, default=2)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds after the kill before a run counts as not recovered")
    p.add_argument("--nodes", type=int, default=3, help="nodes (one worker each); one is killed")
    p.add_argument("--disk-every", type=int, default=10,
                   help="the baseline's torch.save checkpoint interval (steps)")
    p.add_argument("--no-replication", action="store_true",
                   help="elasticd without peer replication (local RAM only)")
    p.add_argument("--fault", choices=(*FAULTS, "kill-worker", "rejoin"), default="kill",
                   help="kill: SIGKILL the node; freeze: SIGSTOP all its processes; "
                        "stop-daemon: SIGSTOP its daemon only; kill-worker (with --mode "
                        "only): SIGKILL one worker of the node; rejoin (with --mode only): "
                        "SIGKILL the node, then start it again: the survivors' pause")
    p.add_argument("--victims", metavar="N1,N2",
                   help="nodes to strike, in turn (default: every node, n1 first)")
    p.add_argument("--keep", metavar="DIR",
                   help="keep each elasticd run's work directory (logs) under DIR")
    p.add_argument("--out", default="bench/results/recovery.json")
    p.add_argument("--mode", metavar="MODES",
                   help="in-process,restart: issue 31's benchmark (bench/recovery_inprocess.py)"
                        " with --runs runs of each mode, interleaved; --ttl, --timeout, --keep "
                        "and --out apply")
    p.add_argument("--setup-seconds", type=float, default=0.0,
                   help="with --mode: the script's setup before its first round, seconds "
                        "(examples/train_in_process.py --setup-seconds)")
    p.add_argument("--compile", metavar="BACKEND", default="",
                   help="with --mode: the job compiles its model (examples/train_in_process.py "
                        "--compile BACKEND, e.g. aot_eager)")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="with --mode: the job draws its input through a DataLoader with this "
                        "many worker processes per rank (examples/train_in_process.py)")
    p.add_argument("--append", action="store_true",
                   help="with --mode: keep the runs already in --out and add --runs more of "
                        "each mode (a long benchmark in several sittings)")
    p.add_argument("--budget-minutes", type=float,
                   help="with --mode: begin no round of modes that the slowest so far would "
                        "carry past this (a CPU lock hold ends with whole runs)")
    p.add_argument("--resummarize", metavar="JSON",
                   help="recompute the figures of a result file from its runs with today's "
                        "validity rules (impossible samples out), and rewrite it")
    args = p.parse_args()
    if args.resummarize:
        return resummarize(args.resummarize)
    if args.mode:
        sys.path.insert(0, REPO)
        from bench import recovery_inprocess

        modes = args.mode.split(",")
        if not modes or not set(modes) <= set(recovery_inprocess.MODES):
            p.error(f"--mode {args.mode!r}: modes are {','.join(recovery_inprocess.MODES)}")
        if args.fault == "stop-daemon":
            p.error("--mode takes --fault kill, kill-worker, rejoin, freeze or partition")
        if args.loader_workers < 0:
            p.error(f"--loader-workers must be >= 0, got {args.loader_workers}")
        job = ((("--compile", args.compile) if args.compile else ())
               + (("--loader-workers", str(args.loader_workers)) if args.loader_workers else ()))
        return recovery_inprocess.main(modes, args.runs, args.ttl, args.timeout, args.out,
                                       args.keep, args.append, args.fault,
                                       args.setup_seconds,
                                       args.budget_minutes * 60 if args.budget_minutes else None,
                                       job_args=job)
    if args.compile or args.loader_workers:
        p.error("--compile and --loader-workers shape the job of --mode")
    if args.fault in ("kill-worker", "rejoin"):
        p.error(f"--fault {args.fault} is measured with --mode in-process,restart")
    if args.fault in ("stop-daemon", "partition") and args.baseline_runs:
        p.error(f"--fault {args.fault} has no plain torchrun baseline here: pass "
                "--baseline-runs 0")
    if args.nodes < 2:
        p.error(f"--nodes must be at least 2 (one is killed), got {args.nodes}")
    victims = args.victims.split(",") if args.victims else _names(args.nodes)
    if not set(victims) <= set(_names(args.nodes)):
        p.error(f"--victims {args.victims!r}: nodes are {','.join(_names(args.nodes))}")
    elastic, plain, cold = [], [], []
    for i in range(max(args.runs, args.baseline_runs, args.cold_runs)):
        v = victims[i % len(victims)]
        if i < args.runs:
            r = run_elasticd(v, args.ttl, args.timeout, not args.no_replication, args.nodes,
                             fault=args.fault, keep=args.keep)
            elastic.append(r)
            print(f"elasticd run {i + 1}: {args.fault} {v}: {r}", flush=True)
        if i < args.cold_runs:
            r = run_elasticd(v, args.ttl, args.timeout, not args.no_replication, args.nodes,
                             ("--worker-start", "cold"), fault=args.fault, keep=args.keep)
            cold.append(r)
            print(f"elasticd cold run {i + 1}: {args.fault} {v}: {r}", flush=True)
        if i < args.baseline_runs:
            r = run_torchrun(v, args.timeout, args.disk_every, args.nodes, args.fault)
            plain.append(r)
            print(f"torchrun run {i + 1}: {args.fault} {v}: {r}", flush=True)
    result = {
        "benchmark": "recovery_kill9_node" if args.fault == "kill" else
                     f"recovery_{args.fault.replace('-', '_')}_node",
        "fault": args.fault,
        "command": "bench/bench_recovery.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "job": f"examples/train.py, {args.nodes} nodes x 1 worker, --nnodes "
               f"{args.nodes - 1}:{args.nodes}, gloo CPU, 20 ms steps",
        "nodes": args.nodes,
        "lease_ttl_seconds": args.ttl,
        "replication": not args.no_replication,
        "baseline_disk_checkpoint_every_steps": args.disk_every,
        "target_seconds": args.ttl + 3,
        "elasticd": {**summarize(elastic, detection_floor(args.ttl)), "detail": elastic},
        "elasticd_cold_workers": {**summarize(cold, detection_floor(args.ttl)),
                                  "detail": cold},
        "baseline_plain_torchrun_tuned": {**summarize(plain), "detail": plain},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("elasticd",
          "baseline_plain_torchrun_tuned")} | {"elasticd": summarize(elastic,
          detection_floor(args.ttl)), "elasticd_cold_workers": summarize(
          cold, detection_floor(args.ttl)), "plain_torchrun": summarize(plain)}, indent=2))
    return 0


#: The result file's systems, and whether the detection floor applies to them.
SYSTEMS = {"elasticd": True, "elasticd_cold_workers": True,
           "baseline_plain_torchrun_tuned": False}


def resummarize(path: str) -> int:
    """Rewrites a result file's figures from its own runs under :func:`summarize`'s rules;
    what changed is recorded in the file (``resummarized``)."""
    with open(path) as fh:
        result = json.load(fh)
    floor = detection_floor(result["lease_ttl_seconds"])
    changes = []
    for system, floored in SYSTEMS.items():
        if system not in result:
            continue
        detail = result[system]["detail"]
        before = {k: v for k, v in result[system].items() if k != "detail"}
        after = summarize(detail, floor if floored else None)
        result[system] = {**after, "detail": detail}
        changes += [f"{system}.{k}: {before.get(k)} -> {v}" for k, v in after.items()
                    if before.get(k) != v]
    result.setdefault("resummarized", []).append({
        "command": f"bench/bench_recovery.py --resummarize {path}",
        "why": "impossible samples are invalid, not recoveries (bench_recovery.impossible)",
        "changes": changes})
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
    print("\n".join(changes) or "no change")
    return 0


if __name__ == "__main__":
    sys.exit(main())
