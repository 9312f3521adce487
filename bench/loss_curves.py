"""Every rank's loss across a shrink and a grow of an FSDP2 job, against a failure-free run with
the same schedule of world sizes.

The elasticd run is the chaos scenario of tests/chaos/test_sharded_reshard.py: FSDP2 really
sharded over 3 nodes (tests/integration/workers/fsdp_trainer.py, uneven shards), replication
m = 2, no standby; kill -9 of a node at step 20, the two survivors reshard the committed step
from peers' RAM and go on at world 2; the node's daemon starts again and the job grows back to
3, resharding once more. Each rank's loss at each step comes from the trainer's sample records.

The reference never touches elasticd: the same trainer under plain process groups of gloo ranks
(no daemon, so its Checkpointer is a no-op), at world 3 from scratch to the step the shrink
restored, then ``dcp.load`` of its own DCP save of that step at world 2 to the step the grow
restored, then ``dcp.load`` at world 3 to the end: the same world sizes at the same steps,
without a failure. Each segment saves its last step with ``dcp.save(get_state_dict(...))`` and
the sampler's position beside it.

Reported: for every (world, rank, step) the reference ran, the elasticd run's loss at the same
world, rank and step on the attempt that kept that step, and the largest difference (0.0 means
the curves are the same bit for bit: the restores lost nothing and changed nothing); the steps
the elasticd run ran twice (between the commit it restored and the step it had reached). The
plot: bench/results/plots/loss_shrink_grow.png.

Not in CI (a chaos run and three reference segments, about two minutes). The committed result:

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/loss_curves.py \\
        --out bench/results/loss_curves.json --plot bench/results/plots/loss_shrink_grow.png

``--mode in-process --model ddp|fsdp``: the same comparison for a job in in-process mode
(issue 31): examples/train_in_process.py (``--model``: DDP, or FSDP2 with uneven shards) on 3
nodes x 2 ranks, ``submit --in-process``, replication on; kill -9 of a node (not rank 0's) at
step 30, whose 4 survivors re-form in their own processes at world 4, then the node's daemon
back once they trained 20 steps there, and the job re-forms at world 6 (survivors in-process,
the node's 2 new workers fresh). Each row of the job's step log is (world, rank, step, loss);
the kept one for a key is the last written. The reference: bench/inprocess_reference.py (the
example's own model, step and batch, imported) under plain gloo groups, world 6 to the step
the shrink resumed from, then ``dcp.load`` at world 4 to the step the rejoin resumed from, then
world 6 to the end. The committed results:

    /work/wt/cpulock .venv/bin/python bench/loss_curves.py --mode in-process --model ddp \\
        --out bench/results/loss_curves_inprocess_ddp.json
    /work/wt/cpulock .venv/bin/python bench/loss_curves.py --mode in-process --model fsdp \\
        --out bench/results/loss_curves_inprocess_fsdp.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the chaos harness lives under tests/

from elasticd.launcher import job_writable  # noqa: E402
from tests.chaos.faults import FaultPlan  # noqa: E402
from tests.chaos.harness import ChaosCluster, Outcome, Shape, gloo_job  # noqa: E402

TRAINER = os.path.join(REPO, "tests", "integration", "workers", "fsdp_trainer.py")
STEPS = 120  # the grown job trains a while (a restarted daemon takes ~5 s to join)


def elasticd_run(workdir: str) -> tuple[Outcome, dict[tuple[int, int, int], float]]:
    """The chaos run; returns its outcome and (world, rank, step) -> loss of the kept steps."""
    shape = Shape(standby=(), nnodes="2:3", zero=False, steps=STEPS, step_time=0.1,
                  etcd_members=1)
    plan = FaultPlan().kill_node("n2", at_step=20).restart_node("n2", at_step=26)
    cc = ChaosCluster(workdir, shape, train=TRAINER)
    out = cc.run(plan, timeout=300)
    out.assert_finished()
    worlds = [a.world for a in out.attempts]
    if worlds != [3, 2, 3]:
        raise SystemExit(f"expected attempts of world 3, 2, 3; got {worlds}\n{out.summary()}")
    kept = {(r["world"], r["rank"], r["step"]): r["loss"] for r in out.kept_records()}
    return out, kept


def segment(workdir: str, name: str, world: int, steps: int, resume: str,
            timeout: float = 300.0) -> tuple[list[dict[str, Any]], str]:
    """One failure-free segment: ``world`` gloo ranks of the trainer, no daemon, from
    ``resume`` (a DCP save, or "" for step 0) to ``steps``; saves its last step. Returns its
    sample records and the directory of that save."""
    samples = os.path.join(workdir, name, "samples")
    dcp_dir = os.path.join(workdir, name, "dcp")
    argv = [sys.executable, TRAINER, "--steps", str(steps), "--sample-log", samples,
            "--dcp-dir", dcp_dir, "--dcp-from", str(steps)]
    if resume:
        argv += ["--resume", resume]
    gloo_job(argv, world, timeout)
    records = [json.loads(line) for path in glob.glob(os.path.join(samples, "*.jsonl"))
               for line in open(path)]
    saves = glob.glob(os.path.join(dcp_dir, "*", str(steps)))
    if len(saves) != 1:
        raise SystemExit(f"reference segment {name}: expected one save of step {steps}, "
                         f"found {saves}")
    return records, saves[0]


def plot(path: str, elastic: Outcome, reference: list[dict[str, Any]],
         marks: list[tuple[int, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = ["tab:blue", "tab:orange", "tab:green"]
    labelled: set[int] = set()
    for a in elastic.attempts:
        for rank in sorted(a.steps):
            pts = sorted((r["step"], r["loss"]) for r in a.records if r["rank"] == rank)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[rank],
                    linewidth=2.5, alpha=0.45,
                    label=None if rank in labelled else f"elasticd, rank {rank}")
            labelled.add(rank)
    ref_by: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for r in reference:
        ref_by.setdefault((r["world"], r["rank"]), []).append((r["step"], r["loss"]))
    first = True
    for (world, rank), pts in sorted(ref_by.items()):
        pts.sort()
        # A segment per run of consecutive steps (world 3 runs twice, apart).
        runs, cur = [], [pts[0]]
        for p in pts[1:]:
            if p[0] == cur[-1][0] + 1:
                cur.append(p)
            else:
                runs.append(cur)
                cur = [p]
        runs.append(cur)
        for run in runs:
            ax.plot([p[0] for p in run], [p[1] for p in run], color="black", linewidth=0.9,
                    linestyle="--", label="failure-free reference, same world sizes"
                    if first else None)
            first = False
    for step, text in marks:
        ax.axvline(step, color="grey", linewidth=0.8, linestyle=":")
        ax.text(step + 0.3, ax.get_ylim()[1], text, va="top", fontsize=8, color="dimgrey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (each rank's batch)")
    ax.set_yscale("log")
    ax.set_title("FSDP2 on 3 nodes: kill -9 at step 20 (world 3 -> 2), node back (2 -> 3)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


INPROCESS_STEPS = 400  # the job still trains when the node is back (~5 s to join)
INPROCESS_REFERENCE = os.path.join(REPO, "bench", "inprocess_reference.py")


def inprocess_run(workdir: str, model: str) -> dict[str, Any]:
    """The in-process job's run (see the module docstring); stops every process it started.
    Returns its rows, the shrink's and the rejoin's resumed steps, and the survivors' pids."""
    from elasticd.launcher import LocalCluster
    from tests.chaos.test_in_process import _first_at, _rows, _submit, _wait

    logdir = job_writable(os.path.join(workdir, "steps"))
    cluster = LocalCluster(["n1", "n2", "n3"], workdir=os.path.join(workdir, "cluster"),
                           lease_ttl=2, replication=True)
    try:
        cluster.start()
        _submit(cluster, logdir, INPROCESS_STEPS, train_args=("--model", model))
        first6 = _first_at(_rows(logdir), 6, 0)
        tagged = {n: set(cluster.nodes[n].tagged()) for n in cluster.nodes}
        zero = next(pid for pid, row in first6.items() if row["rank"] == 0)
        victim = next(n for n in sorted(tagged) if set(first6) & tagged[n]
                      and zero not in tagged[n])
        _wait(lambda: max(r["step"] for r in _rows(logdir) if "step" in r) >= 30, 120,
              "step 30", cluster)
        t_kill = time.time()
        cluster.nodes[victim].kill()
        at4 = _wait(lambda: (f := _first_at(_rows(logdir), 4, t_kill)) and len(f) == 4 and f,
                    90, "4 ranks training at world 4", cluster)
        shrink = min(r["step"] for r in at4.values()) - 1
        _wait(lambda: max(r["step"] for r in _rows(logdir) if "step" in r) >= shrink + 20,
              120, "20 steps at world 4", cluster)
        t_back = time.time()
        cluster.start_node(victim)
        again = _wait(lambda: (f := _first_at(_rows(logdir), 6, t_back)) and len(f) == 6
                      and f, 300, "6 ranks training again", cluster)
        _wait(lambda: sum(1 for r in _rows(logdir) if "done" in r) >= 6, 300,
              "the job finishing", cluster)
    finally:
        cluster.stop()
    survivors = set(first6) - tagged[victim]
    return {"rows": [r for r in _rows(logdir) if "step" in r], "victim": victim,
            "shrink": shrink, "rejoin": min(r["step"] for r in again.values()) - 1,
            "survivors": sorted(survivors), "survivors_kept": sorted(survivors & set(at4)
                                                                     & set(again)),
            "paths": {"world 4": sorted({r["path"] for r in at4.values()}),
                      "world 6 again": sorted({r["path"] for r in again.values()})},
            "resumed_at_4": sorted({r["step"] - 1 for r in at4.values()}),
            "resumed_at_6": sorted({r["step"] - 1 for r in again.values()})}


def inprocess_main(args: argparse.Namespace, workdir: str, started: float) -> int:
    run = inprocess_run(os.path.join(workdir, "elasticd"), args.model)
    kept: dict[tuple[int, int, int], float] = {}
    for r in sorted(run["rows"], key=lambda r: r["t"]):  # the last written wins
        kept[(r["world"], r["rank"], r["step"])] = r["loss"]
    shrink, rejoin = run["shrink"], run["rejoin"]
    print(f"elasticd ({args.model}, in-process): survivors {run['survivors']} kept "
          f"{run['survivors_kept']}; resumed at world 4 from {run['resumed_at_4']}, at world 6 "
          f"again from {run['resumed_at_6']}", flush=True)
    ref_dir = os.path.join(workdir, "reference")
    os.makedirs(ref_dir)
    logs = os.path.join(ref_dir, "losses")
    resume = ""
    segments = [(6, 0, shrink), (4, shrink, rejoin), (6, rejoin, INPROCESS_STEPS)]
    for i, (world, first, last) in enumerate(segments):
        save = os.path.join(ref_dir, f"save-{i}")
        gloo_job([sys.executable, INPROCESS_REFERENCE, "--model", args.model, "--first",
                  str(first), "--steps", str(last), "--save", save, "--log", logs,
                  *(["--resume", resume] if resume else [])], world, 300)
        resume = save
    reference = [json.loads(line) for path in glob.glob(os.path.join(logs, "*.jsonl"))
                 for line in open(path)]
    return finish(args, started, kept, reference, {
        "scenario": f"examples/train_in_process.py --model {args.model}, submit --in-process, "
                    "3 nodes x 2 ranks, --nnodes 2:3, replication on, kill -9 of a node (not "
                    "rank 0's) at step 30, its daemon back 20 steps later, "
                    f"{INPROCESS_STEPS} steps",
        "elasticd": {k: v for k, v in run.items() if k != "rows"},
        "reference_segments": [{"world": w, "steps": [a + 1, b]} for w, a, b in segments]})


def finish(args: argparse.Namespace, started: float, kept: dict[tuple[int, int, int], float],
           reference: list[dict[str, Any]], run: dict[str, Any]) -> int:
    """Compares the elasticd run's ``kept`` losses with the reference's, prints the verdict,
    writes the result (``run``: the mode's scenario, run and reference segments) to
    ``--out``; 0 when every reference loss is there and bitwise equal."""
    diffs, missing = [], []
    for r in reference:
        key = (r["world"], r["rank"], r["step"])
        if key not in kept:
            missing.append(key)
        else:
            diffs.append(abs(kept[key] - r["loss"]))
    compared, equal = len(diffs), sum(d == 0.0 for d in diffs)
    max_diff = max(diffs) if diffs else None
    print(f"compared {compared} (world, rank, step) losses: {equal} bitwise equal, largest "
          f"difference {max_diff}; not in the elasticd run's kept steps: {missing}", flush=True)
    result = {
        "command": "bench/loss_curves.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)) + " UTC",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **run,
        "compared_losses": compared,
        "bitwise_equal": equal,
        "max_abs_difference": max_diff,
        "missing_in_elasticd_run": missing,
        "losses": {
            "elasticd_kept": [[w, rk, st, v] for (w, rk, st), v in sorted(kept.items())],
            "reference": sorted([r["world"], r["rank"], r["step"], r["loss"]]
                                for r in reference),
        },
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")
        print(f"results: {args.out}")
    return 0 if compared and max_diff == 0.0 and not missing else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--mode", choices=("restart", "in-process"), default="restart")
    p.add_argument("--model", choices=("ddp", "fsdp"), default="fsdp",
                   help="--mode in-process: the example's model")
    args = p.parse_args()

    workdir = tempfile.mkdtemp(prefix="elasticd-loss-")  # ours; only the cluster part is the job's
    print(f"loss curves: logs in {workdir}", flush=True)
    started = time.time()
    if args.mode == "in-process":
        return inprocess_main(args, workdir, started)
    out, kept = elasticd_run(job_writable(os.path.join(workdir, "elasticd")))
    shrink, grow = out.recoveries
    print(f"elasticd: attempts {[a.world for a in out.attempts]}, shrink restored step "
          f"{shrink.step} (reached {shrink.reached}) from {sorted(set(shrink.sources.values()))}, "
          f"grow restored step {grow.step} (reached {grow.reached})", flush=True)

    # The reference runs as this process (no job user): its directory is ours alone.
    ref_dir = os.path.join(workdir, "reference")
    os.makedirs(ref_dir)
    a, save_a = segment(ref_dir, "a", 3, shrink.step, "")
    b, save_b = segment(ref_dir, "b", 2, grow.step, save_a)
    c, _ = segment(ref_dir, "c", 3, STEPS, save_b)
    reference = a + b + c

    redone = {f"world {rec.attempt.world} from step {rec.step}":
              list(range(rec.step + 1, rec.reached + 1)) for rec in out.recoveries}
    if args.plot:
        plot(args.plot, out, reference,
             [(shrink.step, f"kill; world 2 from step {shrink.step}"),
              (grow.step, f"grow; world 3 from step {grow.step}")])
        print(f"plot: {args.plot}")
    return finish(args, started, kept, reference, {
        "scenario": "FSDP2, 3 nodes, --nnodes 2:3, m=2, no standby, kill -9 of n2 at step 20, "
                    "its daemon restarted at step 26, 120 steps",
        "elasticd": {
            "worlds": [a.world for a in out.attempts],
            "shrink": {"restored_step": shrink.step, "reached": shrink.reached,
                       "committed": shrink.committed,
                       "sources": sorted(set(shrink.sources.values()))},
            "grow": {"restored_step": grow.step, "reached": grow.reached,
                     "committed": grow.committed,
                     "sources": sorted(set(grow.sources.values()))},
            "steps_run_twice": redone,
        },
        "reference_segments": [{"world": 3, "steps": [1, shrink.step]},
                               {"world": 2, "steps": [shrink.step + 1, grow.step]},
                               {"world": 3, "steps": [grow.step + 1, STEPS]}],
    })


if __name__ == "__main__":
    sys.exit(main())
