"""Recovery from kill -9 of a whole node: elasticd vs tuned plain torchrun, same job, same host.

Each run starts 3 "nodes" on this host training examples/train.py (DDP, gloo, 1 worker per
node, ``--nnodes 2:3``), waits until all train at world size 3, kills one node's every process
with SIGKILL (rotating n1, n2, n3: n1 is the first started, the c10d store host for plain
torchrun), and measures the time until every survivor logs a training step at world size 2.

* elasticd: 3 daemons on one etcd, the job submitted with elasticctl.
* plain torchrun (the baseline): c10d rendezvous on the first node, tuned as in FACTS.md
  (``last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3``, worker store sharing
  off with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), ``--max-restarts 100``.

    .venv/bin/python bench/bench_recovery.py --runs 20 --cold-runs 6 --baseline-runs 9 \\
        --out bench/results/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from elasticd.launcher import LocalCluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
STEP_RE = re.compile(rb"step (\d+) world (\d+) rank")
TRAIN_ARGS = ["--steps", "1000000", "--step-time", "0.02"]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return b""


def _at_world(path: str, world: int, after: int = 0) -> bool:
    return any(int(m.group(2)) == world for m in STEP_RE.finditer(_read(path), after))


def _wait(cond, timeout: float, interval: float = 0.05) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(interval)
    return None


def run_elasticd(victim: str, ttl: int, timeout: float, extra_args: tuple = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as d:
        c = LocalCluster(["n1", "n2", "n3"], workdir=d, lease_ttl=ttl, extra_args=extra_args)
        try:
            c.start()
            env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
            subprocess.run([sys.executable, "-m", "elasticd.cli.main", "submit", "job",
                            "--nnodes", "2:3", "--nproc-per-node", "1", "--user", "root",
                            "--", TRAIN, *TRAIN_ARGS], env=env, check=True,
                           capture_output=True, timeout=60)
            logs = {n: os.path.join(d, n, "jobs", "job", "agent.log") for n in c.nodes}
            if _wait(lambda: all(_at_world(p, 3) for p in logs.values()), 120) is None:
                return {"victim": victim, "recovered": False, "error": "never reached world 3"}
            time.sleep(1.0)
            survivors = [n for n in c.nodes if n != victim]
            marks = {n: len(_read(logs[n])) for n in survivors}
            c.nodes[victim].kill()
            t = _wait(lambda: all(_at_world(logs[n], 2, marks[n]) for n in survivors), timeout)
            leftovers = len(c.nodes[victim].tagged())
            return {"victim": victim, "recovered": t is not None, "seconds": t,
                    "leftover_processes": leftovers}
        finally:
            c.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent's group and its workers' groups (they have sessions of their own)."""
    try:
        kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    except OSError:
        kids = []
    for pid in [proc.pid, *map(int, kids)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_torchrun(victim: str, timeout: float) -> dict:
    port = _free_port()
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="torchrun-bench-") as d:
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        logs = {n: os.path.join(d, f"{n}.log") for n in ("n1", "n2", "n3")}
        try:
            for n in ("n1", "n2", "n3"):
                with open(logs[n], "wb") as out:
                    procs[n] = subprocess.Popen(
                        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3",
                         "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
                         "--rdzv-conf",
                         "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
                         "--max-restarts", "100", "--monitor-interval", "0.1",
                         "--log-dir", os.path.join(d, f"tr-{n}"), TRAIN, *TRAIN_ARGS],
                        stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                if n == "n1":
                    time.sleep(1.0)  # n1 hosts the c10d store
            if _wait(lambda: all(_at_world(p, 3) for p in logs.values()), 120) is None:
                return {"victim": victim, "recovered": False, "error": "never reached world 3"}
            time.sleep(1.0)
            survivors = [n for n in procs if n != victim]
            marks = {n: len(_read(logs[n])) for n in survivors}
            _kill_tree(procs[victim])
            t = _wait(lambda: all(_at_world(logs[n], 2, marks[n]) for n in survivors), timeout)
            return {"victim": victim, "recovered": t is not None, "seconds": t}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    _kill_tree(p)


def summarize(runs: list[dict]) -> dict:
    ok = [r["seconds"] for r in runs if r["recovered"]]
    return {"runs": len(runs), "recovered": len(ok),
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
    p.add_argument("--out", default="bench/results/recovery.json")
    args = p.parse_args()
    victims = ["n1", "n2", "n3"]
    elastic, plain, cold = [], [], []
    for i in range(max(args.runs, args.baseline_runs, args.cold_runs)):
        v = victims[i % 3]
        if i < args.runs:
            r = run_elasticd(v, args.ttl, args.timeout)
            elastic.append(r)
            print(f"elasticd run {i + 1}: kill -9 {v}: {r}", flush=True)
        if i < args.cold_runs:
            r = run_elasticd(v, args.ttl, args.timeout, ("--worker-start", "cold"))
            cold.append(r)
            print(f"elasticd cold run {i + 1}: kill -9 {v}: {r}", flush=True)
        if i < args.baseline_runs:
            r = run_torchrun(v, args.timeout)
            plain.append(r)
            print(f"torchrun run {i + 1}: kill -9 {v}: {r}", flush=True)
    result = {
        "benchmark": "recovery_kill9_node",
        "command": "bench/bench_recovery.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "job": "examples/train.py, 3 nodes x 1 worker, --nnodes 2:3, gloo CPU, 20 ms steps",
        "lease_ttl_seconds": args.ttl,
        "target_seconds": args.ttl + 3,
        "elasticd": {**summarize(elastic), "detail": elastic},
        "elasticd_cold_workers": {**summarize(cold), "detail": cold},
        "baseline_plain_torchrun_tuned": {**summarize(plain), "detail": plain},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("elasticd",
          "baseline_plain_torchrun_tuned")} | {"elasticd": summarize(elastic),
          "elasticd_cold_workers": summarize(cold), "plain_torchrun": summarize(plain)},
          indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
