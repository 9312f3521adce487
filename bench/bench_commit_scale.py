"""etcd's cost of the per-step commit, against node count: the commit coordinator beside the
protocol it replaced, on one real etcd, in one run.

For each node count (``--sizes``) and each implementation, in interleaved order, a subprocess
runs ``bench/commit_harness.py``: N nodes' own commit code (elasticd's ``CommitTracker``, each
node on an etcd client of its own), 8 ranks per node, m = 2, a snapshot step every
``--period`` seconds, for ``--window`` seconds after a warm-up. ``new`` is this tree;
``base`` is another checkout's ``elasticd`` (``--base``, e.g. a worktree of main), whose nodes
each write a ``ckpt/replicated/<node>`` record and read the whole ``ckpt/`` prefix to decide.
Measured per committed step, for the whole job: etcd revisions (write requests that changed a
key) and keys written under ``ckpt/``, bytes per write, Range and Txn requests, bytes etcd sent
to its clients (reads and watch events), etcd's CPU; the nodes' sync lag in steps (each node's
newest snapshot minus the commit it knows, sampled twice per step); etcd's database size at
the start and end of the window.

``--daemons RUNS`` adds 3 real daemons training a job (``bench/commit_daemons.py``), each tree.

    flock /tmp/elasticd-cpu.lock .venv/bin/python bench/bench_commit_scale.py \\
        --base /work/wt/commit-base --sizes 10,50,100 --daemons 2 \\
        --out bench/results/commit_scale.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from elasticd.coordination.embedded import EmbeddedEtcd  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="root of a checkout with the protocol to compare against")
    p.add_argument("--sizes", default="10,50,100")
    p.add_argument("--period", type=float, default=1.0)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--daemons", type=int, default=0, metavar="RUNS",
                   help="also measure 3 real daemons training (bench/commit_daemons.py), "
                        "RUNS times per tree, interleaved")
    p.add_argument("--out", default=os.path.join(HERE, "results", "commit_scale.json"))
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    impls = [("new", REPO)] + ([("base", os.path.abspath(a.base))] if a.base else [])
    etcd = EmbeddedEtcd().start()
    results = []
    try:
        endpoints = etcd.endpoints
        metrics = f"http://{endpoints.split(',')[0]}/metrics"
        for n in sizes:
            for name, root in impls:
                env = {**os.environ, "PYTHONPATH": root}
                cmd = [sys.executable, os.path.join(HERE, "commit_harness.py"),
                       "--endpoints", endpoints, "--metrics", metrics,
                       "--prefix", f"/bench-{uuid.uuid4().hex[:8]}", "--nodes", str(n),
                       "--ranks-per-node", str(a.ranks_per_node), "--period", str(a.period),
                       "--window", str(a.window), "--warmup", str(a.warmup)]
                out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True,
                                     timeout=a.window + a.warmup + 300)
                if out.returncode != 0:
                    print(out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{name} N={n} failed")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["tree"] = name
                results.append(row)
                print(json.dumps(row), flush=True)
    finally:
        etcd.stop()
    daemons = []
    for i in range(a.daemons):
        for name, root in impls:
            out = subprocess.run([sys.executable, os.path.join(HERE, "commit_daemons.py"),
                                  "--window", str(a.window)],
                                 env={**os.environ, "PYTHONPATH": root}, cwd=root,
                                 capture_output=True, text=True, timeout=a.window + 400)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} daemons run {i} failed")
            row = {"tree": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            daemons.append(row)
            print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    base = (subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=a.base,
                           capture_output=True, text=True).stdout.strip() if a.base else None)
    doc = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(
        timespec="seconds"), "commit": commit, "base_commit": base,
        "etcd": "one member, loopback, the product's flags (elasticd.coordination.embedded)",
        "results": results, "daemons": daemons}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
