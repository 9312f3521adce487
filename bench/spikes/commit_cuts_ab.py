"""The commit phase of ``bench/scale_native.py`` run against several commits' elasticd in one
go (this tree's simulator, each commit's ``elasticd/`` first on ``PYTHONPATH``), so that each
cut of a node's commit work is measured beside the code before it, in the same lock hold.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/spikes/commit_cuts_ab.py \\
        --n 300 --order base,a,b,c base=7eb1234 a=0e74958 b=529d5d1 c=7840ad9 \\
        --out bench/results/scale_native_commit_cuts.json

Per run: the ``commit`` entry of scale_native (``--commit-only``), plus reports per node per
step (reports relayed to the coordinator / nodes / snapshot steps in the window).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree(commit: str, base: str) -> str:
    path = os.path.join(base, commit)
    if not os.path.isdir(path):
        os.makedirs(path)
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "elasticd"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commits", nargs="+", help="label=commit")
    p.add_argument("--order", required=True, help="labels, comma-separated, in run order")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--procs", type=int, default=4, help="simulator processes")
    p.add_argument("--out", required=True)
    p.add_argument("--scratch", default="/tmp/commit-cuts")
    a = p.parse_args()
    commits = dict(c.split("=", 1) for c in a.commits)
    runs = []
    for label in a.order.split(","):
        # label=commit, or label=commit@--flag=value,--flag=value: the simulator's own options
        # (a cut of the simulator measured beside the simulator before it, same elasticd)
        commit, _, flags = commits[label].partition("@")
        out = os.path.join(a.scratch, f"{label}-{len(runs)}.json")
        cmd = [sys.executable, "scale_native.py", "--sizes", str(a.n), "--commit-only",
               "--commit-seconds", str(a.seconds), "--commit-warmup", "10",
               "--commit-baseline", "10", "--procs", str(a.procs), "--out", out,
               *[f for f in flags.split(",") if f]]
        env = {**os.environ, "PYTHONPATH": tree(commit, a.scratch)}
        started = time.strftime("%H:%M:%S", time.gmtime())
        print(f"{started} {label} ({commit}): {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=os.path.join(ROOT, "bench"), env=env, check=True)
        with open(out) as f:
            entry = next(r for r in json.load(f)["results"] if r["n"] == a.n)
        c = entry["commit"]
        c["reports_per_node_per_step"] = round(
            sum(c["reports_relayed"].values()) / c["nodes"] / c["snapshot_steps_in_window"], 2)
        runs.append({"label": label, "code": commit, "simulator_flags": flags,
                     "started": started, **c})
        print(json.dumps({k: runs[-1].get(k) for k in (
            "label", "reports_per_node_per_step", "simulator_cpu_ms_per_node_second",
            "simulator_cpu_pct", "keepalive_process_cpu_pct", "lag_steps_median",
            "etcd_cpu_pct", "leases_lost",
            "watch_events_per_node_per_step")}), flush=True)
    doc = {"benchmark": "scale_native commit phase, one N, several commits' elasticd in one "
                        "lock hold (bench/spikes/commit_cuts_ab.py)",
           "command": "python bench/spikes/commit_cuts_ab.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "n": a.n, "runs": runs}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
