"""Soak: a long job with a random node killed (SIGKILL: daemon, agent, workers, its RAM) and
restarted at a fixed interval; reports how much of the wall time went into steps that were kept.

It runs the chaos harness's cluster (tests/chaos/harness.py: a 3-member etcd on loopback, three
daemons as separate processes, replication m=2, examples/train.py under torchrun on CPU with
``--nnodes 2:3``, the optimizer state replicated so the job shrinks to two nodes and grows back
to three) for ``--minutes``. Every ``--every`` seconds a node chosen at random (seeded) is
killed; it is restarted ``--down`` seconds later and rejoins. At the end it reports, from what
the workers wrote (never from what the soak expected):

* the effective training time ratio: time spent on steps that were kept (each kept step's
  duration on the attempt that kept it; a step re-run after a restore counts once, on its last
  run) over the wall time from the job's first step to its last;
* the baseline: steps per second in the failure-free stretch before the first kill (world 3,
  snapshots every step), beside the kept steps per wall second of the whole soak (their ratio
  is the step goodput; a world of 2 steps at another speed, so it is not the time ratio), and
  the same in samples (every rank's batch of each kept step: the goodput the job sees, which
  counts running at a smaller world size as slower);
* the steps lost (newest step reached before each restart minus the step restored), each
  restart's downtime (fault to the next attempt's first step) and restore source;
* checks: every restart restored one step on every rank, the kept steps run 1..N with no gap,
  no sample of an epoch seen twice, and nothing (process, /dev/shm file) left behind.

Not in CI (10 minutes). The committed result came from:

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/soak.py --minutes 10 --every 120 \\
        --down 20 --out bench/results/soak.json

``--modes restart,in-process`` is issue 31's soak instead (bench/soak_inprocess.py): the same
faults against examples/train_in_process.py (2 ranks per node) on the restart path and in
in-process mode, ``--minutes`` of each in ``--blocks`` alternating blocks, each rejoin's stop
of the survivors measured::

    .venv/bin/python bench/soak.py --modes restart,in-process --minutes 10 --blocks 2 \\
        --every 120 --down 20 --out bench/results/soak_inprocess.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the chaos harness lives under tests/

from tests.chaos.faults import FaultPlan, Injector  # noqa: E402
from tests.chaos.harness import ChaosCluster, Outcome, Shape  # noqa: E402

SAMPLES_PER_EPOCH = 4096  # examples/train.py make_data()


def plan_faults(minutes: float, every: float, down: float, nodes: list[str],
                rng: random.Random) -> tuple[FaultPlan, list[str]]:
    """A kill every ``every`` seconds (the first after ``every``), each node restarted ``down``
    seconds after its kill; no kill later than ``every`` before the end."""
    plan, victims, t = FaultPlan(), [], every
    while t + min(every, 60.0) <= minutes * 60:
        node = rng.choice(nodes)
        victims.append(node)
        plan.kill_node(node, after=every if not victims[:-1] else every - down)
        plan.restart_node(node, after=down)
        t += every
    return plan, victims


def step_times(records: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """(attempt, step) -> wall time rank 0 logged it."""
    return {(r["attempt"], r["step"]): r["t"] for r in records if r["rank"] == 0}


def analyse(out: Outcome, first_fault_at: float | None) -> dict[str, Any]:
    all_records = [r for a in out.attempts for r in a.records]
    times = step_times(all_records)
    kept = [r for r in out.kept_records() if r["rank"] == 0]
    kept_steps = sorted(r["step"] for r in kept)
    start = min(r["t"] for r in all_records)
    end = max(r["t"] for r in all_records)
    kept_seconds = 0.0
    for r in kept:  # a step's duration: since the same attempt's previous step
        prev = times.get((r["attempt"], r["step"] - 1))
        if prev is not None:
            kept_seconds += r["t"] - prev
    # Baseline: the failure-free stretch before the first kill (world 3, snapshots every
    # step): its steps per second, against the kept steps per wall second of the whole soak.
    first = out.attempts[0]
    base = sorted((r["step"], r["t"]) for r in first.records if r["rank"] == 0
                  and (first_fault_at is None or r["t"] < first_fault_at))
    base_durations = [b[1] - a[1] for a, b in zip(base, base[1:])]
    base_rate = (len(base) - 1) / (base[-1][1] - base[0][1]) if len(base) > 1 else None
    # Goodput in samples (every rank's batch of a kept step): a step at world 2 trains two
    # batches, at world 3 three, so running smaller counts as slower, as it is for the job.
    base_steps = {b[0] for b in base[1:]}
    base_samples = sum(len(r["indices"]) for r in first.records if r["step"] in base_steps)
    base_samples_rate = base_samples / (base[-1][1] - base[0][1]) if len(base) > 1 else None
    kept_samples = sum(len(r["indices"]) for r in out.kept_records())
    restarts = []
    for rec in out.recoveries:
        first_step = min((r["t"] for r in rec.attempt.records), default=None)
        fired = [f for f in out.faults if first_step is None or f.at < first_step]
        cause = fired[-1] if fired else None
        restarts.append({
            "world": rec.attempt.world, "restored_step": rec.step, "reached": rec.reached,
            "steps_lost": rec.true_lost, "sources": sorted(set(rec.sources.values())),
            "cause": cause.fault.describe() if cause else None,
            "downtime_s": round(first_step - cause.at, 3) if cause and first_step else None,
            "reported_lost": sorted(set(rec.reported_lost.values())),
        })
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for r in out.kept_records():
        by_epoch[r["epoch"]] += r["indices"]
    dup_epochs = [e for e, ix in by_epoch.items() if len(ix) != len(set(ix))]
    short_epochs = [e for e, ix in by_epoch.items()
                    if e != max(by_epoch) and sorted(ix) != list(range(SAMPLES_PER_EPOCH))]
    return {
        "wall_s": round(end - start, 1),
        "kept_step_seconds": round(kept_seconds, 1),
        "effective_ratio": round(kept_seconds / (end - start), 4),
        "baseline_steps_per_s_failure_free": round(base_rate, 3) if base_rate else None,
        "baseline_step_s": round(statistics.median(base_durations), 4) if base_durations
        else None,
        "kept_steps_per_s": round(len(kept_steps) / (end - start), 3),
        "goodput_vs_failure_free": (round(len(kept_steps) / (end - start) / base_rate, 4)
                                    if base_rate else None),
        "baseline_samples_per_s_failure_free": (round(base_samples_rate, 2)
                                                if base_samples_rate else None),
        "kept_samples_per_s": round(kept_samples / (end - start), 2),
        "goodput_samples_vs_failure_free": (round(kept_samples / (end - start)
                                                  / base_samples_rate, 4)
                                            if base_samples_rate else None),
        "steps_kept": len(kept_steps),
        "steps_run": len({(r["attempt"], r["step"]) for r in all_records if r["rank"] == 0}),
        "steps_lost": sum(r["steps_lost"] for r in restarts),
        "restarts": restarts,
        "checks": {
            "kept_steps_contiguous": kept_steps == list(range(1, len(kept_steps) + 1)),
            "reported_lost_matches": all(r["reported_lost"] == [r["steps_lost"]]
                                         for r in restarts),
            "no_sample_twice": not dup_epochs,
            "complete_epochs_whole": not short_epochs,
            "nothing_left": not out.left["processes"] and not out.left["shm"]
            and not out.left["etcd"],
        },
    }


def play(cc: ChaosCluster, plan: FaultPlan, minutes: float) -> tuple[Injector, float, float]:
    """Starts ``cc`` (its job training) and plays ``plan`` against it for ``minutes``, saying
    how far it got every 30 s; returns the injector and the wall times it began and ended. The
    cluster is left running (the caller reads it, then stops it); on an error its logs' tails
    are printed."""
    try:
        cc.start()
        began = time.time()
        injector = cc.injector = Injector(cc, plan)
        next_report = began + 30
        while time.time() < began + minutes * 60:
            cc.poll()
            injector.tick(cc.logs.max_step)
            if time.time() >= next_report:
                next_report += 30
                print(f"  {time.time() - began:5.0f} s: step {cc.logs.max_step}, faults fired "
                      f"{len(injector.records)}/{len(plan)}", flush=True)
            time.sleep(0.1)
        injector.undo_all()
        return injector, began, time.time()
    except BaseException:
        print(cc.diagnostics(), flush=True)
        raise


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, default=120.0, help="seconds between kills")
    p.add_argument("--down", type=float, default=20.0,
                   help="seconds a killed node stays down before its daemon restarts")
    p.add_argument("--step-time", type=float, default=None,
                   help="extra seconds per step (default 0.1; with --modes 0.02, as "
                        "bench_recovery.py --mode)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--grow", default="",
                   help="the daemons' --rdzv-grow (immediate, at-failure, interval:MIN); "
                        "default: the daemon's own default")
    p.add_argument("--out", default="", help="write the result as JSON here")
    p.add_argument("--modes", metavar="MODES",
                   help="restart,in-process: issue 31's soak (bench/soak_inprocess.py), "
                        "examples/train_in_process.py in each mode, interleaved")
    p.add_argument("--blocks", type=int, default=1,
                   help="with --modes: each mode's --minutes in this many alternating blocks")
    p.add_argument("--keep", action="store_true",
                   help="with --modes: keep every block's work directory (logs), not only "
                        "those whose checks failed")
    args = p.parse_args()
    if not 0 < args.down < args.every:
        p.error("need 0 < --down < --every")
    if args.modes:
        return soak_modes(p, args)
    if args.step_time is None:
        args.step_time = 0.1

    nodes = ["n1", "n2", "n3"]
    plan, victims = plan_faults(args.minutes, args.every, args.down, nodes,
                                random.Random(args.seed))
    shape = Shape(nodes=tuple(nodes), standby=(), nnodes="2:3", zero=False, steps=10_000_000,
                  step_time=args.step_time,
                  daemon_args=("--rdzv-grow", args.grow) if args.grow else ())
    workdir = tempfile.mkdtemp(prefix="elasticd-soak-")
    cc = ChaosCluster(workdir, shape, job="soak")
    print(f"soak: {args.minutes:g} min, kills of {victims} every {args.every:g} s "
          f"(down {args.down:g} s); logs in {workdir}", flush=True)
    try:
        injector, began, finished = play(cc, plan, args.minutes)
        history = cc.commit_history()
        left = cc.stop()
        out = Outcome(cc, plan, injector.records, history, {}, left, began, finished)
    finally:
        if not cc._stopped:
            cc.stop()
    kills = [f for f in injector.records if f.fault.kind == "kill_node"]
    result = analyse(out, kills[0].at if kills else None)
    result.update({
        "command": " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "params": vars(args), "kills": victims, "faults_fired": len(injector.records),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "workdir": workdir,
    })
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    ok = all(result["checks"].values()) and result["faults_fired"] == len(plan)
    print(f"soak: effective training time ratio {result['effective_ratio']:.1%}, kept steps "
          f"per second {result['goodput_vs_failure_free']} of the failure-free stretch's, "
          f"{result['steps_lost']} steps lost over {len(result['restarts'])} restarts; "
          f"checks {'passed' if ok else 'FAILED: ' + str(result['checks'])}")
    return 0 if ok else 1


def soak_modes(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--modes``: issue 31's soak (bench/soak_inprocess.py)."""
    from bench import soak_inprocess

    modes = args.modes.split(",")
    if not modes or not set(modes) <= set(soak_inprocess.MODES) or len(set(modes)) < len(modes):
        p.error(f"--modes {args.modes!r}: modes are {','.join(soak_inprocess.MODES)}")
    if args.blocks < 1 or args.grow:
        p.error("--modes takes --blocks >= 1 and no --grow")
    if args.step_time is None:
        args.step_time = 0.02
    result = {"command": " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
              "params": vars(args),
              **soak_inprocess.main(modes, args.minutes, args.blocks, args.every, args.down,
                                    args.seed, args.step_time, args.keep),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()}}
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(json.dumps({"modes": result["modes"], "verdict": result["verdict"]}, indent=2))
    return 0 if all(m["checks_passed"] for m in result["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
